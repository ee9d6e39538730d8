"""PPO end to end through launch/ppo.py on 2 ranks with vLLM TP=2 in-process: reward rises, vLLM log-probs
match the trainer's after every weight sync, the HF export loads, and a killed + resumed run ends bit-identical
to an uninterrupted one."""
import json
import os
import re

import pytest
import torch
from ppo_common import ppo_args
from crash_harness import assert_resumed
from helpers import REPO, run_torchrun, tail, require

PPO = os.path.join(REPO, "launch/ppo.py")
require("vllm")


def history(save):
    return json.load(open(os.path.join(save, "ppo_result.json")))["history"]


def load_weights(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


@pytest.fixture(scope="module")
def straight(ppo_setup, tmp_path_factory):
    """8 PPO steps straight through (2 episodes x 4 steps), checkpoints every 4. Under torchrun's own launch (a
    rank per interpreter), where the other jobs of the suite fork their ranks (tests/helpers.py: LAUNCHER): the
    resumed runs below, forked, end bit-identical to it."""
    save = str(tmp_path_factory.mktemp("straight") / "out")
    p = run_torchrun(PPO, 2, ppo_args(ppo_setup, save, **{"--num_episodes": 2, "--save_steps": 4}), timeout=900,
                     launcher="torchrun")
    assert p.returncode == 0, tail(p)
    return save, p


def test_reward_rises_and_vllm_matches_trainer(straight):
    save, p = straight
    h = history(save)
    assert len(h) == 8
    rewards = [m["reward"] for m in h]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.3, rewards
    assert h[-1]["entropy"] < h[0]["entropy"]
    for m in h:
        # vLLM sampled with the weights the trainer had when it computed old log-probs (synced every step):
        # every sampled token's log-prob agrees (fp32).
        assert m["rollout_logprob_drift_max"] <= 1e-4, m
        for phase in ("weight_sync", "rollout", "actor_fwd", "ref_fwd", "reward_fwd", "critic_fwd", "advantages",
                      "critic_update", "actor_update"):
            assert m[f"time/{phase}"] > 0, phase
    assert [m["weight_version"] for m in h] == list(range(1, 9))
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(save)
    assert model.config.architectures == ["LlamaForCausalLM"]
    # The progress line carries the phase timings.
    assert "time/rollout=" in p.stdout + p.stderr
    # vLLM's socket files were in rank 0's own folder, gone with the job (rlhf.compat.vllm_files.private_ipc_dir)
    m = re.search(r"socket files under (\S+) \(removed at exit\)", p.stdout + p.stderr)
    assert m and os.path.basename(m.group(1)).startswith("rlhf-ipc-"), tail(p)
    assert not os.path.exists(m.group(1))
    # vLLM's start-up warnings that mean nothing here are not shown, each said once instead (rlhf.compat.quiet)
    log = p.stdout + p.stderr
    assert "LD_PRELOAD. For best performance" not in log and "Disabling this manually may cause" not in log
    assert log.count("vLLM: chunked prefill is off on CPU on purpose") == 1, tail(p)


def test_resume_is_exact(ppo_setup, straight, tmp_path):
    save_a, _ = straight
    save = str(tmp_path / "out")
    args = ppo_args(ppo_setup, save, **{"--num_episodes": 2, "--save_steps": 4})
    p = run_torchrun(PPO, 2, args + ["--stop_after_steps", "4"], timeout=900)
    assert p.returncode == 0, tail(p)
    assert not os.path.exists(os.path.join(save, "model.safetensors"))  # stopped before the end
    # negative control: the same relaunch without --load_checkpoint (one step) fails the resume check
    q = run_torchrun(PPO, 2, ppo_args(ppo_setup, str(tmp_path / "control"), **{
        "--num_episodes": 2, "--save_steps": 4, "--ckpt_path": os.path.join(save, "checkpoints"),
        "--stop_after_steps": 1}), timeout=900)
    assert q.returncode == 0, tail(q)
    with pytest.raises(AssertionError, match="did not resume"):
        assert_resumed(q.stdout + q.stderr, "ppo", step=4)
    p = run_torchrun(PPO, 2, args + ["--load_checkpoint"], timeout=900)
    assert p.returncode == 0, tail(p)
    assert_resumed(p.stdout + p.stderr, "ppo", step=4, total=8)
    ha, hb = history(save_a), history(save)
    assert [m["reward"] for m in hb] == [m["reward"] for m in ha[4:]]
    wa, wb = load_weights(save_a), load_weights(save)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_sigkill_anywhere_then_resume_is_exact(ppo_setup, straight, tmp_path):
    """The whole PPO job (torchrun, both ranks with their vLLM shards, the export's subprocess) SIGKILLed at seeded
    moments: start-up, a step before the first checkpoint (the relaunch starts afresh), mid-save of step 4, a step
    after it, mid-export; each relaunch resumes from what was published. The final weights equal the
    uninterrupted run's bit for bit."""
    import random

    from crash_harness import crash_and_resume

    rng = random.Random(5)
    points = [("startup", rng.uniform(3.0, 8.0)), ("step", rng.randint(1, 3)), ("save", 4),
              ("step", rng.randint(5, 7)), ("export", 0)]
    if os.environ.get("RLHF_CRASH_SLOW") == "1":  # every step, both saves
        points = [points[0]] + [("step", k) for k in (1, 2, 3)] + [("save", 4)] + [("step", k) for k in (5, 6, 7)] \
            + [("save", 8), ("export", 0)]
    save = str(tmp_path / "out")
    args = ppo_args(ppo_setup, save, **{"--num_episodes": 2, "--save_steps": 4})
    records = crash_and_resume(PPO, 2, args, "ppo", os.path.join(save, "checkpoints"), points, seed=5, total=8)
    assert all(r["killed"] for r in records[:-1]), ([(r["point"], r["killed"]) for r in records],  # the ended one:
        [r["log"][-1500:] for r in records[:-1] if not r["killed"]])
    exported = [r for r in records if r["point"] == ("export", 0)][0]["log"]  # killed mid-export, not after it
    assert "fault injection: hang at export" in exported and "exported HF model" not in exported, exported[-1500:]
    # Nothing is published before step 4's save, and the launch killed in it hangs there until the kill, so the
    # launches up to the one after it start afresh. crash_and_resume checked every launch that had a checkpoint:
    # 'resumed from ... (step k)', only later steps.
    first_save = points.index(("save", 4))
    assert not any(r["had_checkpoint"] for r in records[:first_save + 2])
    assert records[-1]["resumed_step"] >= 4
    wa, wb = load_weights(straight[0]), load_weights(save)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_grpo_packed_offloaded_with_fallback_generator_and_combined_rewards(ppo_setup, reward_pair, tmp_path):
    """GRPO (no critic, KL in the loss), --packing_samples, both offload flags, and the megatron fallback
    generator (as on a machine without vLLM): runs, says loudly which generator it uses, and its sampling
    log-probs agree with the trainer's. The reward is two reward models (each --normalize_reward'ed with its own
    saved statistics) plus a rule function, weighted: the logged per-source means combine to the logged totals."""
    save = str(tmp_path / "out")
    w = {"rm0": 0.7, "rm1": 0.3, "fn": 0.5}
    args = ppo_args(ppo_setup, save, **{"--advantage_estimator": "grpo", "--packing_samples": "",
                                        "--ref_reward_offload": "", "--adam_offload": "",
                                        "--rollout_backend": "megatron", "--rollout_batch_size": 8,
                                        "--train_batch_size": 16, "--micro_rollout_batch_size": 8,
                                        "--stop_after_steps": 2, "--init_kl_coef": 0.05,
                                        # k3 (GRPO's usual KL-loss estimator) is >= 0, and > 0 once the policy
                                        # moved: the kl_loss check below cannot pass by a sample's sign
                                        "--kl_estimator": "k3",
                                        "--reward_pretrain": ",".join(reward_pair),
                                        "--reward_weights": f"{w['rm0']},{w['rm1']}",
                                        "--reward_fn": "_rule_reward:length_reward", "--reward_fn_weight": w["fn"],
                                        "--normalize_reward": ""})
    p = run_torchrun(PPO, 2, args, timeout=900, PYTHONPATH=f"{REPO}{os.pathsep}{os.path.dirname(__file__)}")
    assert p.returncode == 0, tail(p)
    assert "ROLLOUT FALLBACK" in p.stdout + p.stderr
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "[ppo 2/" in ln]
    assert lines, tail(p)
    m = dict(kv.split("=") for kv in lines[0].split("] ", 1)[1].split())
    assert float(m["rollout_logprob_drift_max"]) <= 1e-4, m
    assert "critic/value_loss" not in m and float(m["actor/kl_loss"]) > 0, m
    assert float(m["time/reward_fwd"]) > 0 and float(m["time/reward1_fwd"]) > 0, m
    # --ref_reward_offload / --adam_offload moved parts off the device (copies on CPU: RLHF_OFFLOAD_ON_CPU=1)
    assert float(m["offload/make_experience_in_mb"]) > 0 and float(m["offload/actor_update_out_mb"]) > 0, m
    r = {k: float(m[f"reward/{k}"]) for k in w}
    norm = {"rm0": (0.1, 0.8), "rm1": (-0.2, 1.5)}  # the reward_pair fixture's saved statistics
    raw = sum(w[k] * r[k] for k in w)
    normalized = w["fn"] * r["fn"] + sum(w[k] * (r[k] - norm[k][0]) / norm[k][1] for k in norm)
    tol = 2e-3 * (1 + sum(abs(v) for v in r.values()))  # the progress line prints 4 significant digits
    assert float(m["reward"]) == pytest.approx(raw, abs=tol), m
    assert float(m["reward_normalized"]) == pytest.approx(normalized, abs=tol), m


def test_grpo_with_a_rule_reward_and_no_reward_model(ppo_setup, tmp_path):
    """--reward_fn alone (no --reward_pretrain): GRPO needs no critic, so no reward, critic or value engine is
    built; the reward is the rule's alone (weight 1): each step's mean of min(len(reply), 12) / 12 over 32 replies.
    The run exports the actor."""
    save = str(tmp_path / "out")
    args = ppo_args(ppo_setup, save, **{"--advantage_estimator": "grpo", "--rollout_backend": "megatron",
                                        "--rollout_batch_size": 8, "--train_batch_size": 16,
                                        "--micro_rollout_batch_size": 8, "--num_episodes": 1, "--max_samples": 16,
                                        "--init_kl_coef": 0.05, "--reward_fn": "_rule_reward:length_reward",
                                        "--reward_pretrain": None})
    assert "--reward_pretrain" not in args
    p = run_torchrun(PPO, 2, args, timeout=900, PYTHONPATH=f"{REPO}{os.pathsep}{os.path.dirname(__file__)}")
    assert p.returncode == 0, tail(p)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "[ppo " in ln and "reward=" in ln]
    assert len(lines) == 2, tail(p)
    for ln in lines:
        m = dict(kv.split("=") for kv in ln.split("] ", 1)[1].split())
        assert 0.0 < float(m["reward"]) <= 1.0, m
        # no reward model's phase (time/reward) or critic; the rule's own phase is time/reward_fn
        assert not any(k == "time/reward" or k.startswith(("time/critic", "critic/", "reward/")) for k in m), m
    hist = history(save)
    assert len(hist) == 2 and all(h["time/reward_fn"] > 0 for h in hist), hist
    for h in hist:  # the mean over 8 prompts x 4 samples of k/12: a whole number of 1/384ths
        assert abs(h["reward"] * 384 - round(h["reward"] * 384)) < 1e-4, h["reward"]
    assert os.path.exists(os.path.join(save, "model.safetensors"))
