"""CISPO, SAPO, Clip-Cov and KL-Cov in real PPO runs (launch/ppo.py's body in this process, one rank, the megatron
generator, a rule reward, two passes over each batch so the second sees ratios away from 1): every actor micro-batch
the job dumped (``--dump_experience``) has the loss of verl's function (tests/peer_math.py, transcribed from
verl/trainer/ppo/core_algos.py at b178a3cd) on its own tensors, with the job's non-default parameters (the flags
reach the loss). Clip-Cov's random picks are verl's ``torch.randperm`` replayed from the seed the step gives its
generator (``--seed`` x 7919 + step), call after call. Each job has a control: the peer's function at verl's
default parameters (or plain PPO) gives another loss on some micro-batch."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from peer_math import verl_agg_loss, verl_cispo, verl_clip_cov, verl_kl_cov, verl_sapo, verl_vanilla_per_token
from ppo_common import TINY_GRPO, ppo_args

pytestmark = pytest.mark.timeout(300)
SEED = 3  # ppo_args' --seed
FLAGS = {
    "cispo": {"--eps_clip_low_high": "0.01 0.02"},
    "sapo": {"--tau_pos": "0.5", "--tau_neg": "3.0"},
    "clip_cov": {"--clip_cov_ratio": "0.05", "--clip_cov_lb": "0.0005", "--clip_cov_ub": "2.0",
                 "--eps_clip": "0.01"},
    "kl_cov": {"--kl_cov_ratio": "0.2", "--ppo_kl_coef": "5.0"},
}


@pytest.fixture(scope="module", params=sorted(FLAGS))
def job(request, ppo_setup, tmp_path_factory):
    """One step of 4 prompts x 2 samples of up to 10 tokens, 2 epochs of 2 micro-batches: the actor's records."""
    from helpers import free_port
    from rlhf.ppo import main

    kind = request.param
    out = tmp_path_factory.mktemp(kind)
    flags = {**TINY_GRPO, "--reward_fn": "_rule_reward:char_code_reward", "--rollout_backend": "megatron",
             "--max_samples": "4", "--generate_max_len": "10", "--max_epochs": "2", "--init_kl_coef": "0",
             "--actor_learning_rate": "2e-2", "--policy_loss_type": kind, "--dump_experience": str(out / "dump")}
    extra = [w for k, v in FLAGS[kind].items() for w in (k, *v.split())]
    mp = pytest.MonkeyPatch()
    mp.setenv("MASTER_PORT", str(free_port()))
    try:
        assert main(ppo_args(ppo_setup, str(out), **flags) + extra) == 0
    finally:
        mp.undo()
    recs = [torch.load(f) for f in sorted(glob.glob(os.path.join(out / "dump", "step*_rank0.pt")))]
    assert [r["step"] for r in recs] == [1]
    return kind, recs[0]["actor"]


def _t(r):
    return (r["old_logprobs"].double(), r["logprobs"].double(), r["advantages"].double(),
            r["action_mask"].double())


def _defaults(kind, old, lp, adv, m):
    """verl's function at its defaults (the control)."""
    if kind == "cispo":
        return verl_cispo(old, lp, adv, m)[1]
    if kind == "sapo":
        return verl_sapo(old, lp, adv, m)[1]
    if kind == "clip_cov":
        return verl_agg_loss(verl_vanilla_per_token(old, lp, adv, 0.01, 0.01, c=1e9), m, "token-mean")
    return verl_kl_cov(old, lp, adv, m)[1]


def test_the_job_loss_is_verls(job):
    kind, actor = job
    assert len(actor) == 4  # 2 epochs x 2 micro-batches
    moved = told = 0
    torch.manual_seed(SEED * 7919 + 0)  # the first step's Clip-Cov generator (the trainer counts from 0; the dump
    # names the step 1), replayed on verl's global one
    for r in actor:
        old, lp, adv, m = _t(r)
        moved += float(((lp - old).abs() * m).max()) > 1e-3
        if kind == "cispo":
            want = verl_cispo(old, lp, adv, m, low=0.01, high=0.02)[1]
        elif kind == "sapo":
            want = verl_sapo(old, lp, adv, m, tau_pos=0.5, tau_neg=3.0)[1]
        elif kind == "clip_cov":
            want = verl_clip_cov(old, lp, adv, m, low=0.01, high=0.01, clip_cov_ratio=0.05, lb=0.0005, ub=2.0)[1]
        else:
            want = verl_kl_cov(old, lp, adv, m, kl_cov_ratio=0.2, ppo_kl_coef=5.0)[1]
        got = float(r["loss"]) / float(r["count"])
        assert got == pytest.approx(float(want), rel=1e-5, abs=1e-7), (kind, r["microbatch"])
        told += abs(float(_defaults(kind, old, lp, adv, m)) - float(want)) > 1e-5
    assert moved >= 1, "the second pass never moved the ratio"
    acted = sum(float(r["metrics"]["clip_frac"][0]) for r in actor)  # clipped, dropped or penalised tokens
    assert (acted == 0) if kind == "sapo" else (acted > 0), (kind, acted)
    assert told >= 1, f"{kind}: verl's defaults give the same loss; the flags were not seen"
