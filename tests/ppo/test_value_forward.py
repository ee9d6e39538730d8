"""Reward and critic forwards (rlhf.experience.forward_role) against HF transformers per token, on collated
(right-padded) and packed micro-batches, with an ordinary tiny reward model whose attention and MLP layers are
all live: a position, mask, packing or context error in the value path changes the scores. One in-process rank."""
import pytest
import torch


@pytest.fixture(scope="module")
def engines(ppo_setup):
    from helpers import free_port
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.runtime.role import ModelRole

    mesh = initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"))
    yield ModelRole(mesh, ppo_setup["rm"], value_head=True, name="reward")
    destroy_mesh()


def _samples(vocab: int):
    from rlhf.rollout.types import Sample

    g = torch.Generator().manual_seed(3)
    shapes = [(5, 4), (9, 1), (3, 6), (7, 3)]  # (prompt, response) lengths: rows of different widths
    out = []
    for i, (p, r) in enumerate(shapes):
        ids = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        out.append(Sample(i, ids[:p], ids[p:], [0.0] * r, True))
    return out


def _hf_scores(rm_dir: str, samples) -> list[torch.Tensor]:
    """HF's score head at every position of each sample alone (no padding): (L,) per sample."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            out.append(model.score(model.model(input_ids=ids).last_hidden_state)[0, :, 0])
    return out


@pytest.mark.parametrize("packing", [False, True])
def test_reward_and_critic_match_hf_per_token(ppo_setup, engines, packing):
    from rlhf.ppo.experience import collate_sequences, forward_role, prepare_microbatches, select_rows

    eng = engines
    samples = _samples(eng.spec.vocab_size)
    T = 6
    batch = collate_sequences(samples, pad_id=0, T=T)
    mbs = prepare_microbatches([select_rows(batch, [0, 1], True), select_rows(batch, [2, 3], True)],
                               packing=packing, pp=1, pad_id=0)
    assert ("packed_seq_params" in mbs[0]) == packing
    rewards = forward_role(eng, "reward", mbs, 1.0)  # (B,)
    values = forward_role(eng, "critic", mbs, 1.0)  # (B, T)
    ref = _hf_scores(ppo_setup["rm"], samples)
    want_rewards = torch.stack([r[-1] for r in ref])
    assert torch.allclose(rewards, want_rewards, atol=2e-5), (rewards, want_rewards)
    assert want_rewards.std() > 0.1  # the scores differ between sequences: the comparison can see errors
    for b, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        want = ref[b][p - 1: p - 1 + r]  # the value of the state before each response token
        assert torch.allclose(values[b, :r], want, atol=2e-5), (b, values[b, :r], want)
    # the score varies along a sequence: the per-position comparison above checks real values, not a constant
    assert ref[0].std() > 1e-2


def _openrlhf_by_hand(hf_rm: str, out) -> str:
    """OpenRLHF's reward-model folder, written here from an HF *ForSequenceClassification folder without our
    converter: the base model's keys, ``value_head.weight``, the causal LM's architectures, its statistics."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_rm, out)
    sd = load_file(f"{out}/model.safetensors")
    sd["value_head.weight"] = sd.pop("score.weight")
    save_file(sd, f"{out}/model.safetensors", metadata={"format": "pt"})
    with open(f"{out}/config.json") as f:
        cfg = json.load(f)
    for k in ("num_labels", "id2label", "label2id"):
        cfg.pop(k, None)
    cfg.update(architectures=["LlamaForCausalLM"], normalize_reward=True, mean=0.3, std=2.0,
               value_head_prefix="value_head")
    with open(f"{out}/config.json", "w") as f:
        json.dump(cfg, f)
    return str(out)


def test_openrlhf_format_reward_model_scores_as_hf(ppo_setup, engines, tmp_path):
    """An OpenRLHF-format reward model loads as --reward_pretrain and scores as HF does, raw and normalized
    with its own mean/std; our converter takes it to our format and back without changing a weight."""
    from safetensors.torch import load_file

    from rlhf.runtime.role import ModelRole
    from rlhf.models.reward_format import from_openrlhf, to_openrlhf
    from rlhf.models.spec import load_hf_config
    from rlhf.rewards.sources import RewardConfig, combine_rewards, score_sequences

    path = _openrlhf_by_hand(ppo_setup["rm"], tmp_path / "openrlhf_rm")
    cfg = RewardConfig(reward_pretrain=path, normalize_reward=True)
    norms = cfg.norms(cfg.validate_models(1, 1))
    assert norms == {"rm0": (0.3, 2.0)}
    eng = ModelRole(engines.mesh, path, value_head=True, name="reward1")
    samples = _samples(eng.spec.vocab_size)
    scores = score_sequences(eng, [s.prompt_ids + s.response_ids for s in samples], pad_id=0, micro_batch_size=2)
    want = torch.stack([r[-1] for r in _hf_scores(ppo_setup["rm"], samples)])
    assert torch.allclose(scores, want, atol=2e-5), (scores, want)
    normalized, raw = combine_rewards({"rm0": scores}, cfg.source_weights, norms)
    assert torch.allclose(normalized, (want - 0.3) / 2.0, atol=2e-5) and torch.equal(raw, scores)
    ours = from_openrlhf(path, str(tmp_path / "ours"))
    assert load_hf_config(ours)["rlhf"] == {"reward_mean": 0.3, "reward_std": 2.0}
    assert load_hf_config(ours)["architectures"] == ["LlamaForSequenceClassification"]
    original = load_file(f"{ppo_setup['rm']}/model.safetensors")
    converted = load_file(f"{ours}/model.safetensors")
    assert converted.keys() == original.keys() and all(torch.equal(converted[k], original[k]) for k in original)
    back = load_file(f"{to_openrlhf(ours, str(tmp_path / 'back'))}/model.safetensors")
    assert torch.equal(back["value_head.weight"], original["score.weight"])
