"""``--reward_fn code`` in a real PPO job (launch/ppo.py, one rank, vLLM, GRPO) with dynamic filtering and partial
rollouts: every reply of every step is graded in the sandbox against its prompt's tests (MBPP's test_list form),
the reasons are logged as reward_extra/code_* (shares that sum to 1), and the job runs to its end. The tiny random
actor writes no valid Python, so every test is a compile error here and dynamic filtering finds no passing group
(the grading itself is checked against hand-made verdicts in tests/sandbox/test_code_reward.py; learning, on
SmolLM2-135M-Instruct, in docs/code_rl.md)."""
import json
import os

from helpers import REPO, require, run_torchrun, tail

from ppo_common import TINY_GRPO, ppo_args

require("vllm")


def test_code_reward_with_dynamic_filtering_and_partial_rollouts(ppo_setup, tmp_path):
    from rlhf.demo.code_task import tasks
    from rlhf.metrics import read_metrics_jsonl

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
