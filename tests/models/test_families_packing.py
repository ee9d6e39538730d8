"""Packed (THD) micro-batches of the 2026 families, one in-process rank: DeepSeek-V3's MLA (its keys 64 wide, values
32: LatentCoreAttention pads them to one width for the varlen kernel) and GLM-4.5's partial rotary give, packed, the
logits of the padded batch, and their gradients; GPT-OSS (sinks, a sliding window) is refused by name when packed,
and context parallelism by name for all three. The memory planner counts each model's tensors."""
import pytest
import torch

LENGTHS = [7, 19, 1, 12]


@pytest.fixture(scope="module")
def mesh_and_models(tmp_path_factory):
    from helpers import free_port
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.models.tiny import make_tiny_family

    work = tmp_path_factory.mktemp("family_packing")
    paths = {n: make_tiny_family(str(work / n), n, seed=30 + i)
             for i, n in enumerate(("deepseek_v3", "glm4_moe", "gpt_oss"))}
    mesh = initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"))
    yield mesh, paths
    destroy_mesh()


def _load(path):
    from rlhf.models.convert import fill_from_hf
    from rlhf.models.gpt import build_model
    from rlhf.models.spec import load_hf_config, padded_vocab_size, spec_from_hf_config

    spec = spec_from_hf_config(load_hf_config(path))
    pv = padded_vocab_size(spec.vocab_size)
    model = build_model(spec, tp=1, pp=1, pp_rank=0, padded_vocab=pv)
    fill_from_hf(model, path, spec, pv, tp=1, pp=1, tp_rank=0, pp_rank=0)
    return spec, model


def _batch(vocab):
    g = torch.Generator().manual_seed(3)
    width = max(LENGTHS)
    ids = torch.randint(3, vocab, (len(LENGTHS), width), generator=g)
    mask = torch.arange(width) < torch.tensor(LENGTHS).unsqueeze(1)
    return ids.masked_fill(~mask, 0), mask


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_packed_equals_padded(mesh_and_models, name):
    from rlhf.models.packing import make_packed_batch, split_packed

    _, paths = mesh_and_models
    spec, model = _load(paths[name])
    ids, mask = _batch(spec.vocab_size)
    padded = model(ids)  # (B, L, V)
    mb = make_packed_batch(ids, mask)
    packed = model(mb["input_ids"], mb["position_ids"], packed_seq_params=mb["packed_seq_params"])
    parts = split_packed(mb, packed)
    diff = max((padded[i, :n] - p).abs().max().item() for i, (n, p) in enumerate(zip(LENGTHS, parts)))
    assert diff <= 1e-5
    # and the gradients of the same loss on the real tokens
    (sum(padded[i, :n].float().logsumexp(-1).sum() for i, n in enumerate(LENGTHS))).backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    packed = model(mb["input_ids"], mb["position_ids"], packed_seq_params=mb["packed_seq_params"])
    sum(p.float().logsumexp(-1).sum() for p in split_packed(mb, packed)).backward()
    rel = max((p.grad - ref[k]).abs().max().item() / (ref[k].abs().max().item() + 1e-12)
              for k, p in model.named_parameters() if k in ref)
    assert rel <= 1e-5


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe", "gpt_oss"])
def test_memory_planner_counts_the_models_parameters(mesh_and_models, name):
    """The planner's per-rank tensors (rlhf.planner.stage_param_numels) are the megatron model's, one by one; at EP 2
    half the experts."""
    from rlhf.planner import stage_param_numels

    spec, model = _load(mesh_and_models[1][name])
    ours = [p.numel() for p in model.parameters()]
    planned = stage_param_numels(spec, 1, 1, 0, False)
    assert sorted(planned) == sorted(ours)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".local_experts." in n)
    assert sum(stage_param_numels(spec, 1, 1, 0, False, ep=2)) == sum(ours) - experts // 2


def test_gpt_oss_packed_and_families_under_cp_are_refused(mesh_and_models):
    from rlhf.models.packing import make_packed_batch

    _, paths = mesh_and_models
    spec, model = _load(paths["gpt_oss"])
    ids, mask = _batch(spec.vocab_size)
    mb = make_packed_batch(ids, mask)
    with pytest.raises(ValueError, match="is not supported with packed sequences"):
        model(mb["input_ids"], mb["position_ids"], packed_seq_params=mb["packed_seq_params"])
    from rlhf.models.families import check_family_layout

    for name in paths:
        with pytest.raises(ValueError, match="context parallelism"):
            check_family_layout(spec if name == "gpt_oss" else _load(paths[name])[0], cp=2)
