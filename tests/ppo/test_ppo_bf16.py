"""PPO --bf16 end to end through launch/ppo.py on 2 ranks, padded and --packing_samples: 2
steps against the fp32 run from the same models, prompts and seed, per-step metrics within bounds measured on this
machine, and the bf16 rollout log-prob drift (vLLM's sampling log-probs vs the trainer's old log-probs) bounded.

The padded bf16 run forces torch's own bf16 kernels (``RLHF_CPU_BF16_GEMM=bf16``: bf16 GEMMs, attention and vLLM
TP2 in bf16); the packed one takes the CPU's default (``auto``: on a CPU whose bf16 products are slower than fp32's,
bf16 operands multiplied in fp32 and vLLM in fp32 on the synced bf16 weights), so every machine runs both.
Three launches of about 30 s: fp32 (padded), bf16 padded, bf16 packed. One fp32 baseline serves both bf16 runs:
packed and padded fp32 agree to 2e-5 (tests/ppo/test_ppo_packing.py), far inside the bf16 bounds. One update per
role per step (train batch = rollout batch, 1 epoch) and lr 1e-3 keep the two trajectories comparable.
"""
import os

import pytest
from helpers import REPO, require, run_torchrun, tail
from ppo_common import ppo_args

from rlhf.observability.metrics import metric_series

PPO = os.path.join(REPO, "launch/ppo.py")
require("vllm")
STEPS = 2

# |bf16 - fp32| allowed per logged metric, steps 1 and 2, worst step of the padded (forced bf16 kernels) and packed
# runs, with the ordinary sequence-classification reward model of tests/ppo/conftest.py. Measured per CPU kind:
#   AMD EPYC, AVX512_BF16 (2026-11-26): reward 8.0e-3, reward_std 4.1e-3, kl 8.1e-4, advantages_abs 1.5e-3,
#     entropy 4.3e-5, critic/value_loss 0.69 (of 36), critic/values 7.6e-2 (of 7), critic/grad_norm 0.95 (packed;
#     0.14 padded, of 616), actor/grad_norm 9.7e-3 (of 1.3-2.1), actor/policy_loss 1.7e-6, response_length 0
#   Intel Xeon, AVX512_BF16, no AMX (2026-11): reward 9.0e-3, reward_std 4.1e-3, kl 9.0e-4, advantages_abs 1.7e-3,
#     entropy 4.0e-5, critic/value_loss 0.64, critic/values 6.9e-2, critic/grad_norm 0.13-0.32,
#     actor/grad_norm 8.7e-3, actor/policy_loss 7.9e-8 .. 1.13e-6, response_length 0
#   Intel Xeon with AMX (2026-11-26, padded run; its other metrics unmeasured): advantages_abs 7.1e-3, and
#     reward, reward_std and kl within the earlier bounds 3e-2, 4e-2, 1.5e-2 (checked before it in the loop)
#   AMD EPYC without AVX-512 (lscpu "AMD EPYC", family 25, avx2 only; 2026-11-27; its packed run multiplies bf16
#     operands in fp32): padded / packed: reward 7.8e-3 / 6.6e-3, reward_std 4.1e-3 / 8.0e-4, kl 7.8e-4 / 6.4e-4,
#     advantages_abs 1.7e-3 / 5.1e-4, entropy 4.1e-5 / 2.7e-5, critic/value_loss 0.64 / 0.70, critic/values
#     6.9e-2 / 7.8e-2, critic/grad_norm 0.14 / 2.8, actor/grad_norm 8.7e-3 / 1.2e-2, actor/policy_loss 1.3e-6 /
#     2.0e-6, response_length 0 / 0
# The bounds are about 3x the largest figure of any kind. advantages_abs is 5x AMD's on AMX, probably a reply
# sampled differently in one run (a near-tie at one token, which bf16 rounding can flip; not verified there): that
# moves the batch's whitened advantages and its mean reward by about 1/32 of a score, and reward and reward_std
# keep room for it. critic/grad_norm (a norm of about 616) moved by 0.13-0.95 on three kinds and 2.8 (0.45%) on the
# AMD EPYC without AVX-512: bf16 keeps 8 significant bits (a relative step of 2^-8 = 0.39%), so differences of a
# few tenths of a percent are its rounding, not a bug; its bound, 8 (1.3%), is 3x that figure and still fails a
# critic gradient that is off by a factor (e.g. a loss counted twice: 100%). kl's and the critic's AMX figures are
# unknown: if they fail there, measure and widen. actor/policy_loss is minus the mean of whitened advantages at
# ratio 1: zero up to rounding, so its difference is noise.
TOL = {"reward": 3e-2, "reward_std": 3e-2, "kl": 3e-3, "advantages_abs": 2e-2, "entropy": 1.5e-4,
       "critic/value_loss": 2.0, "critic/values": 0.25, "critic/grad_norm": 8.0, "actor/grad_norm": 3e-2,
       "actor/policy_loss": 5e-6, "response_length": 0.25}
# bf16 rollout_logprob_drift (vLLM bf16 vs the trainer's bf16 forward, after each weight sync), measured per step:
# mean 1.02e-3..1.33e-3, max 3.9e-3..5.9e-3 (padded and packed alike). fp32: mean 2e-7, max 1e-6.
DRIFT_MEAN, DRIFT_MAX = 4e-3, 2e-2


@pytest.fixture(scope="module")
def runs(ppo_setup, tmp_path_factory):
    out = {}
    for name, extra, env in (("fp32", {}, {}), ("bf16", {"--bf16": ""}, {"RLHF_CPU_BF16_GEMM": "bf16"}),
                             ("bf16_packed", {"--bf16": "", "--packing_samples": ""}, {})):
        save = str(tmp_path_factory.mktemp(name) / "out")
        args = ppo_args(ppo_setup, save, **{"--rollout_batch_size": 8, "--train_batch_size": 32,
                                            "--micro_train_batch_size": 16, "--max_epochs": 1,
                                            "--actor_learning_rate": "1e-3", "--critic_learning_rate": "1e-3",
                                            "--stop_after_steps": STEPS, "--tensorboard": save + "/tb", **extra})
        p = run_torchrun(PPO, 2, args, timeout=900, **env)
        assert p.returncode == 0, tail(p)
        out[name] = (metric_series(save, "ppo"), p.stdout + p.stderr)
    return out


def test_vllm_ran_in_the_run_dtype(runs):
    from rlhf.rollout.types import generator_dtype

    for name, (_, log) in runs.items():
        dtype = "float32" if name == "fp32" else "bfloat16"
        vllm = {"fp32": "float32", "bf16": "bfloat16", "bf16_packed": generator_dtype(True, on_cuda=False)[0]}[name]
        assert f"(external_launcher, {vllm}:" in log, name  # the vLLM engine's start-up line
        for role in ("ref", "reward"):  # the frozen models are stored in the run's dtype (half the bytes in bf16)
            assert f"{role}: frozen, weights in {dtype} (" in log, (name, role)
    # the packed run's forwards went through the packed (THD) attention path, the padded runs' did not
    assert "core attention: packed (THD) batches" in runs["bf16_packed"][1]
    assert "core attention: packed (THD) batches" not in runs["bf16"][1]


@pytest.mark.parametrize("run", ["bf16", "bf16_packed"])
def test_bf16_steps_match_fp32(runs, run):
    fp32, bf16 = runs["fp32"][0], runs[run][0]
    diffs = {}
    for metric in TOL:
        a, b = fp32[metric][:STEPS], bf16[metric][:STEPS]
        assert len(a) == len(b) == STEPS, (metric, a, b)
        diffs[metric] = max(abs(x - y) for x, y in zip(a, b))
    print(f"bf16 - fp32 ({run}): " + ", ".join(f"{k} {v:.2g}" for k, v in diffs.items()))  # the figures above
    over = {k: f"{v:.3g} > {TOL[k]:g}" for k, v in diffs.items() if v > TOL[k]}  # every one, not just the first
    assert not over, (run, over)
    assert bf16["critic/value_loss"][:STEPS] != fp32["critic/value_loss"][:STEPS]  # fp32 runs are deterministic


@pytest.mark.parametrize("run", ["bf16", "bf16_packed"])
def test_bf16_rollout_logprob_drift(runs, run):
    """vLLM samples with the weights the trainer synced (every step); in bf16 both sides round differently, so the
    drift is bf16-sized but bounded. In fp32 the same runs agree to ~1e-6, so a bf16-sized drift also shows
    that bf16 ran."""
    m, fp32 = runs[run][0], runs["fp32"][0]
    assert len(m["rollout_logprob_drift"]) == STEPS
    for mean, mx in zip(m["rollout_logprob_drift"], m["rollout_logprob_drift_max"]):
        assert 1e-4 < mean <= DRIFT_MEAN and mean <= mx <= DRIFT_MAX, m
    assert max(fp32["rollout_logprob_drift_max"]) <= 1e-5, fp32
