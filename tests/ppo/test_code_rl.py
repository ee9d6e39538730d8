"""``--reward_fn code`` in a real PPO job (launch/ppo.py, one rank, vLLM, GRPO) with dynamic filtering and partial
rollouts: every reply of every step is graded in the sandbox against its prompt's tests (MBPP's test_list form),
the reasons are logged as reward_extra/code_* (shares that sum to 1), and the job runs to its end. The tiny random
actor writes no valid Python, so every test is a compile error here and dynamic filtering finds no passing group
(the grading itself is checked against hand-made verdicts in tests/sandbox/test_code_reward.py; learning, on
SmolLM2-135M-Instruct, in docs/code_rl.md)."""
import json
import os

import pytest

from helpers import REPO, require, run_torchrun, tail
from rlhf.observability.metrics import read_metrics_jsonl

from ppo_common import TINY_GRPO, ppo_args

require("vllm")


def test_code_reward_with_dynamic_filtering_and_partial_rollouts(ppo_setup, tmp_path):
    from rlhf.demo.code_task import tasks
    from rlhf.observability.metrics import read_metrics_jsonl

    prompts = tmp_path / "code.jsonl"
    with open(prompts, "w") as f:
        for t in tasks(0)[:12]:
            f.write(json.dumps({"prompt": t["prompt"], "tests": t["tests"]}) + "\n")
    save = tmp_path / "out"
    args = ppo_args({**ppo_setup, "prompts": str(prompts)}, str(save), **{
        **TINY_GRPO, "--reward_fn": "code", "--label_key": "tests", "--generate_max_len": "8",
        "--code_timeout_s": "2", "--code_sandbox_workers": "2"}) + [
        "--num_episodes", "1", "--max_samples", "8", "--dynamic_filtering", "--dynamic_filtering_max_rounds", "2",
        "--partial_rollout", "--max_staleness", "1"]
    p = run_torchrun(os.path.join(REPO, "launch", "ppo.py"), 1, args, timeout=600)
    assert p.returncode == 0, tail(p)
    hist = read_metrics_jsonl(os.path.join(save, "metrics.jsonl"), "ppo")
    assert sorted(hist) == [1, 2], hist
    for h in hist.values():
        shares = {k: v for k, v in h.items() if k.startswith("reward_extra/code_")
                  and k not in ("reward_extra/code_tests_in_sandbox", "reward_extra/code_runs")}
        assert len(shares) == 9 and abs(sum(shares.values()) - 1) < 1e-6, shares
        assert h["reward_extra/code_runs"] > 0 and h["time/reward_fn"] > 0, h
        assert h["reward_extra/code_compile_error"] + h["reward_extra/code_runtime_error"] > 0.5, shares
        assert h["dynamic_filtering/rounds"] == 2 and h["dynamic_filtering/pass_rate"] == 0, h


def test_each_samples_reward_is_its_own_programs_verdict(ppo_setup, tmp_path):
    """Rewards that vary: each reply picks one of three programs (passing 3 of 3 MBPP tests, 2 of 3, or not compiling;
    tests/ppo/_rule_reward.py scripted_code_reward) graded by the real sandbox, in a job with dynamic filtering (groups
    whose replies all scored alike dropped) and partial rollouts (unfinished replies carried into the next step). In
    every step's dump, each trained sample's raw reward is the verdict of the program its own reply picks (decoded
    from its own tokens), so a reward carried with another sample, or shifted by the filter, fails here."""
    import torch
    from transformers import AutoTokenizer

    from _rule_reward import scripted_program

    label = json.dumps({"test_list": ["assert f(1, 2) == 3", "assert f(0, 0) == 0", "assert f(5, 0) == 5"]})
    prompts = tmp_path / "code.jsonl"
    with open(prompts, "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"write f number {i}", "tests": label}) + "\n")
    save, dump = tmp_path / "out", tmp_path / "dump"
    args = ppo_args({**ppo_setup, "prompts": str(prompts)}, str(save), **{
        **TINY_GRPO, "--reward_fn": "_rule_reward:scripted_code_reward", "--label_key": "tests",
        "--rollout_backend": "megatron", "--generate_max_len": "6", "--code_timeout_s": "10",
        "--dump_experience": str(dump)}) + [
        "--num_episodes", "1", "--max_samples", "16", "--dynamic_filtering", "--dynamic_filtering_max_rounds", "3",
        "--partial_rollout", "--max_staleness", "1"]
    p = run_torchrun(os.path.join(REPO, "launch", "ppo.py"), 1, args, timeout=600,
                     PYTHONPATH=f"{REPO}{os.pathsep}{os.path.dirname(os.path.abspath(__file__))}")
    assert p.returncode == 0, tail(p)
    tok = AutoTokenizer.from_pretrained(ppo_setup["actor"])
    want_of = {0: 1.0, 1: 2 / 3, 2: 0.0}
    from _rule_reward import SCRIPTED_PROGRAMS

    seen = set()
    files = sorted(dump.glob("step*_rank0.pt"))
    assert len(files) >= 2
    for f in files:
        e = torch.load(f)["experience"]
        mask = e.get("reward_mask", e["action_mask"]).bool()
        for b in range(mask.shape[0]):
            reply = tok.decode(e["response_ids"][b][mask[b]].tolist(), skip_special_tokens=True)
            k = SCRIPTED_PROGRAMS.index(scripted_program(reply))
            assert float(e["raw_rewards"][b]) == pytest.approx(want_of[k], abs=1e-6), (f.name, b, reply)
            seen.add(k)
    assert seen == {0, 1, 2}, seen  # passing, failing and non-compiling programs all trained
    hist = read_metrics_jsonl(os.path.join(save, "metrics.jsonl"), "ppo")
    assert any(h["partial/max_token_age"] >= 1 for h in hist.values()), hist  # a carried reply was trained on
    assert any(h["dynamic_filtering/pass_rate"] < 1 for h in hist.values()), hist  # and groups were filtered out
