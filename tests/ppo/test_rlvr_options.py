"""The RLVR loss options reach a real PPO run (launch/ppo.py's body in this process, one rank, the megatron
generator, a rule reward): RLOO with GSPO at the paper's clip range clips whole sequences on the second pass over a
batch, where the same run at a 0.2 range clips none. The formulas themselves: tests/algo/test_rlvr_losses.py."""
from __future__ import annotations

import json

import pytest
import torch

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


def test_dynamic_filtering_fills_the_batch_and_resumes_exactly(ppo_setup, tmp_path, monkeypatch, capsys):
    """A binary verifier (even reply length) on groups of 2: about half the groups agree and are dropped, and
    further rollouts fill the batch. With the overlong penalty on 3-token replies. Three steps straight equal one
    step, a stop, and a resume (the sampler's position after the extra rollouts is in the checkpoint)."""
    from crash_harness import assert_resumed
    from helpers import free_port
    from rlhf.ppo import main

    def run(out, *extra):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--reward_fn": "_rule_reward:parity_reward",
                                                "--rollout_backend": "megatron", "--max_samples": "64",
                                                "--num_episodes": "1", "--save_steps": "1",
                                                "--advantage_estimator": "grpo", "--dynamic_filtering": "",
                                                "--overlong_buffer_len": "2", "--actor_learning_rate": "1e-3",
                                                "--dynamic_filtering_max_rounds": "8"})
        assert main(argv + list(extra)) == 0
        return capsys.readouterr().err

    straight = tmp_path / "straight"
    run(straight, "--stop_after_steps", "3")
    from rlhf.metrics import read_metrics_jsonl

    m = read_metrics_jsonl(str(straight / "metrics.jsonl"), "ppo")
    assert sorted(m) == [1, 2, 3]
    for s in m:  # about 1 group in 5 passes here
        d = {k.split("/")[1]: v for k, v in m[s].items() if k.startswith("dynamic_filtering/")}
        assert d["pass_rate"] < 1 and d["rounds"] >= 2, d  # groups were dropped and further rollouts made
        assert d["prompts"] == 4 * d["rounds"] and d["generated_tokens"] == d["prompts"] * 2 * 3, d
        assert d["filled"] == max(0, 4 - round(d["pass_rate"] * d["prompts"])), d  # short only after 8 rollouts
        assert m[s]["advantages_abs"] > 0, m[s]
        assert m[s]["overlong_penalized_frac"] == 1.0, m[s]  # every 3-token reply is past 3 - 2 tokens
    assert any(m[s]["dynamic_filtering/filled"] == 0 for s in m), m
    resumed = tmp_path / "resumed"
    run(resumed, "--stop_after_steps", "1")
    from rlhf.openrlhf_cli import without_effect

    # with every OpenRLHF flag accepted as "no effect here" (tests/test_openrlhf_cli.py): the metrics below show it
    log = run(resumed, "--load_checkpoint", "--stop_after_steps", "2", *without_effect("ppo"))
    assert_resumed(log, "ppo", step=1)
    assert "--ckpt.max_mem (OpenRLHF) accepted, no effect here" in log
    got = read_metrics_jsonl(str(resumed / "metrics.jsonl"), "ppo")
    # the resumed steps drew the same prompts and samples: the same metrics to the last bit (timings, memory and
    # the weight-sync counter of the new process aside)
    skip = ("time/", "tokens_per_s", "mem/", "offload/", "weight_sync/", "weight_version")
    for s in (2, 3):
        same = {k: v for k, v in m[s].items() if not k.startswith(skip)}
        assert {k: v for k, v in got[s].items() if not k.startswith(skip)} == same, s
        assert "dynamic_filtering/pass_rate" in same and "reward" in same


def test_one_update_per_batch_skips_the_old_logprob_forward(ppo_setup, tmp_path, monkeypatch, capsys):
    """With one on-policy update per batch (--max_epochs 1, TINY_GRPO's --train_batch_size = the step's 8 samples)
    the old log-probs are the update's own forward, detached: no actor forward in make_experience, ratio exactly 1,
    and the same gradient as with the forward (within fp32 rounding: the two forwards of the same weights differ in
    the last bits), so the same loss and grad norm step by step; the drift check is measured in the update."""
    from helpers import free_port
    from rlhf.ppo import main

    def run(out, *extra):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--reward_fn": "_rule_reward:char_code_reward",
                                                "--rollout_backend": "megatron", "--max_samples": "8",
                                                "--actor_learning_rate": "1e-3", "--max_epochs": "1"})
        assert main(argv + list(extra)) == 0
        return json.load(open(out / "ppo_result.json"))["history"], capsys.readouterr().err

    skip, log = run(tmp_path / "skip")
    assert "old log-probs: the update's own forward, detached" in log, log[-2000:]
    keep, log = run(tmp_path / "keep", "--old_logprobs_forward", "always")
    assert "old log-probs: the actor's forward in make_experience (--old_logprobs_forward always)" in log
    assert len(skip) == len(keep) == 2
    for a, b in zip(skip, keep):
        assert a["advantages_abs"] > 0.1  # the policy gradient is live, not only the KL loss's
        assert "time/actor_fwd" not in a and b["time/actor_fwd"] > 0
        assert a["actor/ratio"] == 1.0 and abs(b["actor/ratio"] - 1.0) < 1e-6
        # fp32 rounding of one forward against another (|log ratio| <= 1e-6 per token): relative 1e-5 is loose
        for k in ("actor/policy_loss", "actor/grad_norm", "entropy", "reward"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (k, a[k], b[k])
        assert 0 < a["rollout_logprob_drift_max"] <= 1e-5 and a["rollout_logprob_drift"] <= a["rollout_logprob_drift_max"]


def test_openrlhf_reward_file_and_its_extra_logs(ppo_setup, tmp_path, monkeypatch):
    """OpenRLHF's examples/python/reward_func.py, unchanged (tests/peers), as --remote_rm_url: its random 0/1
    rewards train the step and its extra log (the same tensor) reaches metrics.jsonl and TensorBoard as
    reward_extra/dummy_scores, equal to the logged reward."""
    import os

    from helpers import REPO, free_port
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlhf.metrics import read_metrics_jsonl
    from rlhf.ppo import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = tmp_path / "o"
    argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--rollout_backend": "megatron", "--max_samples": "8",
                                            "--remote_rm_url": os.path.join(REPO, "tests/peers/openrlhf/reward_func.py"),
                                            "--tensorboard": str(out / "tb")})
    assert main(argv) == 0
    m = read_metrics_jsonl(str(out / "metrics.jsonl"), "ppo")
    assert sorted(m) == [1, 2]
    for s in m:
        assert m[s]["reward_extra/dummy_scores"] == pytest.approx(m[s]["reward"], abs=1e-6), m[s]
    ev = EventAccumulator(str(out / "tb"))
    ev.Reload()
    assert "ppo/reward_extra/dummy_scores" in ev.Tags()["scalars"]


def test_evaluation_during_training(ppo_setup, tmp_path, monkeypatch):
    """--eval_dataset: held-out reward and pass@k at step 0, every --eval_steps and after the last step, in
    metrics.jsonl (prefix eval); pass@k is the mean over prompts of the best of k, so it is at least the mean.
    Every held-out prompt is used: more of them than the training's --max_samples (which once capped them)."""
    from helpers import free_port
    from ppo_common import write_prompts

    from rlhf.metrics import read_metrics_jsonl
    from rlhf.ppo import main
    from rlhf.ppo.evaluation import pass_at_k

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = tmp_path / "o"
    held_out = write_prompts(tmp_path / "eval.jsonl", 25, seed=9)
    argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--rollout_backend": "megatron", "--max_samples": "20",
                                            "--reward_fn": "_rule_reward:char_code_reward", "--eval_dataset": held_out,
                                            "--eval_steps": "2", "--eval_n_samples_per_prompt": "3",
                                            "--num_episodes": "1"})
    assert main(argv) == 0
    ev = read_metrics_jsonl(str(out / "metrics.jsonl"), "eval")
    assert sorted(ev) == [0, 2, 4, 5], sorted(ev)  # 20 prompts / 4 per step: 5 steps
    for m in ev.values():
        assert m["prompts"] == 25 and 0 <= m["reward"] <= m["pass@3"] <= 1 and m["response_length"] == 3, m
    assert pass_at_k(torch.tensor([0.0, 1.0, 0.5, 0.2, 0.2, 0.2]), 3) == pytest.approx((2.1 / 6, 0.6))


def test_eval_needs_a_rule_reward(ppo_setup, tmp_path, monkeypatch, capsys):
    from rlhf.ppo import main

    argv = ppo_args(ppo_setup, str(tmp_path / "o"), **{"--eval_dataset": ppo_setup["prompts"]})
    assert main(argv) == 2
    assert "--eval_dataset scores the held-out replies with the run's rule reward" in capsys.readouterr().err


def test_dynamic_filtering_regenerates_with_vllm(ppo_setup, tmp_path, monkeypatch, capsys):
    """With vLLM on CPU the engine releases its weights after each rollout; dynamic filtering's further rounds within
    a step must sync them again (once failed: "vLLM's weights were freed after the last rollout")."""
    from helpers import free_port
    from rlhf.metrics import read_metrics_jsonl
    from rlhf.ppo import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = tmp_path / "o"
    argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--reward_fn": "_rule_reward:parity_reward",
                                            "--rollout_backend": "vllm", "--max_samples": "64",
                                            "--dynamic_filtering": "", "--dynamic_filtering_max_rounds": "4",
                                            "--stop_after_steps": "2", "--actor_learning_rate": "1e-3"})
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    m = read_metrics_jsonl(str(out / "metrics.jsonl"), "ppo")
    assert sorted(m) == [1, 2] and max(s["dynamic_filtering/rounds"] for s in m.values()) >= 2, m
