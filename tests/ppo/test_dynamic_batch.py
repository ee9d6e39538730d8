"""--use_dynamic_batch: micro-batches by token count. The step's gradient does not depend on how its rows are
grouped: in fp64, on a linear softmax policy through the real actor loss (every aggregation mode, with the KL and
entropy terms), token-budget groups give the gradient of fixed groups to rounding; and a one-rank PPO run with
token-budget micro-batches (more of them than fixed ones) logs the same step metrics as fixed micro-batching
within fp32 rounding."""
import json

import pytest
import torch
from ppo_common import TINY_GRPO, ppo_args

from rlhf.algo.ppo_losses import ActorLossConfig, make_actor_loss
from rlhf.ppo.stages import token_budget_groups

# Training runs in this process (main(argv)): pytest-timeout interrupts a test whose run hangs after 300 s, 5x the
# slowest of these files' tests on a loaded 2-core AMD EPYC (36-62 s, 2026-11-27; test_rlvr_options 11-50 s).
pytestmark = pytest.mark.timeout(300)

F64 = torch.float64


def _toy(seed=0, B=12, T=6, V=11, H=5):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    prompt = torch.randint(2, 30, (B,), generator=g)  # a long tail of prompt lengths: groups differ in size
    mask = (torch.arange(T)[None] < lens[:, None])
    batch = {"attention_mask": (torch.arange(40)[None] < (prompt + lens)[:, None]).long(), "action_mask": mask,
             "feat": torch.randn(B, T, H, generator=g, dtype=F64),
             "response_ids": torch.randint(0, V, (B, T), generator=g),
             "old_logprobs": torch.randn(B, T, generator=g, dtype=F64) * 0.1 - 2.0,
             "advantages": torch.randn(B, T, generator=g, dtype=F64),
             "ref_logprobs": torch.randn(B, T, generator=g, dtype=F64) * 0.1 - 2.0}
    return batch, torch.randn(H, V, generator=g, dtype=F64)


def _grad(batch, W0, groups, cfg):
    W = W0.clone().requires_grad_(True)

    def logprobs(mb, _):
        logits = mb["feat"] @ W  # (b, T, V)
        lp = torch.log_softmax(logits, -1)
        ent = -(lp.exp() * lp).sum(-1)
        return lp.gather(-1, mb["response_ids"].unsqueeze(-1)).squeeze(-1), ent

    fn = make_actor_loss(logprobs, cfg, kl_coef=0.05)
    total, count = 0.0, 0
    for g in groups:
        ix = torch.tensor(g)
        s, n, _ = fn({k: v[ix] for k, v in batch.items()}, None)
        total, count = total + s, count + int(n)
    (total / count).backward()  # megatron's per-token contract: the step's sums over the step's counts
    return W.grad


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_gradient_does_not_depend_on_the_grouping_fp64(mode):
    batch, W0 = _toy()
    cfg = ActorLossConfig(loss_agg_mode=mode, entropy_coef=0.01, kl_in_loss=True, kl_estimator="k3")
    fixed = [list(range(i, i + 4)) for i in range(0, 12, 4)]
    budget = token_budget_groups(batch, list(range(12)), max_tokens=60)
    assert sorted(i for g in budget for i in g) == list(range(12)) and len(budget) != len(fixed)
    assert all(int(batch["attention_mask"][g].sum()) <= 60 for g in budget)
    a, b = _grad(batch, W0, fixed, cfg), _grad(batch, W0, budget, cfg)
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-15), (a - b).abs().max()
    c = _grad(batch, W0, [[i] for i in range(12)], cfg)  # one row per group: the same again
    assert torch.allclose(a, c, rtol=1e-12, atol=1e-15)


def test_a_sample_over_the_budget_names_the_flag():
    batch, _ = _toy()
    with pytest.raises(ValueError, match="exceeds --max_tokens_per_gpu=8"):
        token_budget_groups(batch, list(range(12)), max_tokens=8)


def test_ppo_step_with_token_budget_microbatches_equals_fixed(ppo_setup, tmp_path, monkeypatch):
    from helpers import free_port
    from rlhf.ppo import main

    def run(out, *extra):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--reward_fn": "_rule_reward:char_code_reward",
                                                "--rollout_backend": "megatron", "--max_samples": "8",
                                                "--packing_samples": "", "--prompt_max_len": "16",
                                                "--micro_train_batch_size": "4", "--micro_rollout_batch_size": "4"})
        assert main(argv + list(extra)) == 0
        return json.load(open(out / "ppo_result.json"))["history"]

    fixed = run(tmp_path / "fixed")
    dyn = run(tmp_path / "dyn", "--use_dynamic_batch", "--max_tokens_per_gpu", "20")
    for a, b in zip(fixed, dyn):
        assert a["microbatches/forward"] == 2 and b["microbatches/forward"] > 2, (a, b)  # regrouped for real
        assert b["microbatches/update"] > a["microbatches/update"]
        for k in ("reward", "actor/grad_norm", "entropy", "kl", "advantages_abs"):
            assert b[k] == pytest.approx(a[k], rel=2e-5, abs=1e-7), (k, a[k], b[k])
        # The policy loss is a token mean of advantage-weighted ratios whose advantages nearly cancel (GRPO: zero
        # mean per group), so its fp32 rounding scales with the mean |advantage|, not with the loss: summing ~100
        # token terms in another grouping moves it by up to ~100 x 2^-24 x mean|A| ~ 6e-6 x mean|A|. Measured
        # differences: AMD EPYC < 3.8e-7 (the loss 0.019, mean|A| ~0.8); Intel Xeon with AMX 5.6e-7.
        assert abs(b["actor/policy_loss"] - a["actor/policy_loss"]) <= 1e-5 * a["advantages_abs"], \
            (a["actor/policy_loss"], b["actor/policy_loss"], a["advantages_abs"])
