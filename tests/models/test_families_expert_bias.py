"""DeepSeek's expert-bias correction during training (rlhf.models.families): frozen by default (slime's
--moe-router-bias-update-rate 0), or updated after each step at a rate (megatron's moe_router_bias_update_rate; verl
sets megatron's 1e-3): each expert's bias moves by exactly the rate towards balance, +rate for an expert below the
average load, -rate above it (megatron's ``get_updated_expert_bias``), counted over the step's tokens. One in-process
rank, the tiny DeepSeek-V3."""
import pytest
import torch


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from helpers import free_port
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.models.tiny import make_tiny_family

    path = make_tiny_family(str(tmp_path_factory.mktemp("expert_bias") / "ds"), "deepseek_v3", seed=40)
    initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"))
    yield path
    destroy_mesh()


def _step(path, rate):
    """The expert bias before and after one training step, and the tokens each expert got in it."""
    from rlhf.models.convert import fill_from_hf
    from rlhf.models.ddp import wrap_ddp
    from rlhf.models.gpt import build_model
    from rlhf.models.pipeline import run_microbatches
    from rlhf.models.spec import load_hf_config, padded_vocab_size, spec_from_hf_config

    spec = spec_from_hf_config(load_hf_config(path))
    pv = padded_vocab_size(spec.vocab_size)
    model = build_model(spec, tp=1, pp=1, pp_rank=0, padded_vocab=pv, expert_bias_update_rate=rate)
    fill_from_hf(model, path, spec, pv, tp=1, pp=1, tp_rank=0, pp_rank=0)
    router = model.decoder.layers[1].mlp.router
    before = router.expert_bias.clone()
    seen = []
    router.register_forward_hook(lambda m, i, out: seen.append(out[1].detach().sum(0).float()))
    ddp = wrap_ddp(model)
    ids = torch.randint(3, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_fn(batch, logits):
        return logits.float().logsumexp(-1).mean(), {}

    run_microbatches(ddp, [{"input_ids": ids}], loss_fn=loss_fn)
    return before, router.expert_bias.clone(), seen[0]


def test_expert_bias_is_frozen_by_default(deepseek):
    before, after, _ = _step(deepseek, 0.0)
    assert torch.equal(before, after) and before.abs().max() > 0  # (the tiny model's bias is drawn non-zero)


def test_expert_bias_moves_at_megatrons_rate_towards_balance(deepseek):
    rate = 1e-3
    before, after, load = _step(deepseek, rate)
    expected = before + rate * torch.sign(load.mean() - load)
    assert torch.allclose(after, expected, atol=1e-7, rtol=0), (after - before) / rate
    assert (after != before).any()
