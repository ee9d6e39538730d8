"""The RLVR loss options reach a real PPO run (launch/ppo.py's body in this process, one rank, the megatron
generator, a rule reward): RLOO with GSPO at the paper's clip range clips whole sequences on the second pass over a
batch, where the same run at a 0.2 range clips none. The formulas themselves: tests/algo/test_rlvr_losses.py."""
from __future__ import annotations

import json

from ppo_common import TINY_GRPO, ppo_args


def _run(setup, out, monkeypatch, capsys, low_high):
    from helpers import free_port
    from rlhf.ppo import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    argv = ppo_args(setup, str(out), **{**TINY_GRPO, "--reward_fn": "_rule_reward:length_reward",
                                        "--rollout_backend": "megatron", "--max_samples": "8",
                                        "--advantage_estimator": "rloo", "--policy_loss_type": "gspo",
                                        "--entropy_coef": "0.01", "--max_epochs": "2",
                                        "--actor_learning_rate": "1e-5"}) + ["--eps_clip_low_high", *low_high]
    assert main(argv) == 0
    log = capsys.readouterr().err
    return json.load(open(out / "ppo_result.json"))["history"], log


def test_gspo_rloo_entropy_reach_the_update(ppo_setup, tmp_path, monkeypatch, capsys):
    hist, log = _run(ppo_setup, tmp_path / "narrow", monkeypatch, capsys, ["3e-4", "4e-4"])
    assert "actor loss: gspo, ratio clipped to [0.9997, 1.0004], seq_mean_token_mean, entropy_coef 0.01, KL in the " \
           "reward" in log, log[-3000:]
    narrow = [h["actor/clip_frac"] for h in hist]
    # the first pass over a batch has ratio 1 (nothing clipped); on the second, sequences whose ratio moved past
    # +-4e-4 in the direction of their advantage are clipped, whole
    assert all(f > 0 for f in narrow), narrow
    wide = [h["actor/clip_frac"] for h in _run(ppo_setup, tmp_path / "wide", monkeypatch, capsys, ["0.2", "0.2"])[0]]
    assert all(w == 0 for w in wide), (narrow, wide)  # a small learning rate moves no ratio by 20%
