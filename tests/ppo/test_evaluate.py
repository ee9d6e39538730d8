"""launch/evaluate.py, a real 2-rank job (2 vLLM engines, each sampling its share of every chunk; the rule reward
scored on each rank's share of the replies): the results are the hand count of its own samples (each reward
recomputed here from the reply's text by the rule, pass@k by enumerating every k-subset, maj@k by counting the
first k answers), and a run stopped after one chunk, its file torn, then relaunched, ends with the uninterrupted
run's samples and results; the straight run takes its evaluation flags from a TOML --config file, the resumed one
from the command line, and both resolve to the same flags. The metric functions alone:
tests/offline/test_eval_metrics.py."""
from __future__ import annotations

import itertools
import json
import os
from collections import Counter

import pytest

from helpers import REPO, run_torchrun, tail

EVAL = os.path.join(REPO, "launch/evaluate.py")
N, KS, PROMPTS = 4, (1, 2, 4), 4


EVAL_FLAGS = ["--n_samples_per_prompt", str(N), "--k", ",".join(map(str, KS)), "--reward_fn",
              "_rule_reward:parity_reward", "--answer_fn", "_rule_reward:first_word"]
TOML = f"""n_samples_per_prompt = {N}
k = "{",".join(map(str, KS))}"
reward_fn = "_rule_reward:parity_reward"
answer_fn = "_rule_reward:first_word"
"""


def _job(setup, out, *extra):
    args = ["--pretrain", setup["actor"], "--dataset", setup["prompts"], "--input_key", "prompt", "--max_samples",
            str(PROMPTS), "--chunk_size", "2", "--max_new_tokens", "6", "--prompt_max_len", "32", "--seed", "5",
            "--vllm_kv_cache_mb", "32", "--rollout_backend", "vllm", "--output_dir", str(out), *extra]
    p = run_torchrun(EVAL, 2, args, timeout=600, PYTHONPATH=f"{REPO}{os.pathsep}{os.path.join(REPO, 'tests', 'ppo')}")
    assert p.returncode == 0, tail(p)
    return p


@pytest.fixture(scope="module")
def straight(ppo_setup, tmp_path_factory):
    """The evaluation's flags from a TOML --config file; the resumed run below gives them on the command line."""
    out = tmp_path_factory.mktemp("eval") / "straight"
    cfg = out.parent / "eval.toml"
    cfg.write_text(TOML)
    _job(ppo_setup, out, "--config", str(cfg))
    return out


def _rows(out):
    return [json.loads(line) for line in open(out / "samples.jsonl")]


def test_results_are_the_hand_count(straight):
    rows = _rows(straight)
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, s) for p in range(PROMPTS) for s in range(N)]
    by_prompt: dict = {}
    for r in rows:
        words = r["output"].split()
        assert r["reward"] == float(len(r["output"]) % 2 == 0) == r["scores"]["fn"]  # the rule, recomputed
        assert r["correct"] == (r["reward"] >= 1.0) and r["answer"] == (words[0] if words else None)
        by_prompt.setdefault(r["prompt_index"], []).append(r)
    assert 0 < sum(r["correct"] for r in rows) < len(rows)
    want = {}
    for k in KS:
        want[f"pass@{k}"] = sum(sum(any(r["correct"] for r in s) for s in itertools.combinations(g, k)) /
                                len(list(itertools.combinations(g, k))) for g in by_prompt.values()) / PROMPTS
        want[f"avg@{k}"] = sum(sum(r["correct"] for r in g[:k]) / k for g in by_prompt.values()) / PROMPTS
        maj = 0
        for g in by_prompt.values():
            votes = Counter(r["answer"] for r in g[:k] if r["answer"] is not None)
            if votes:
                top = [a for a, c in votes.items() if c == max(votes.values())]
                first = next(r for r in g[:k] if r["answer"] in top)  # ties: the answer seen first
                maj += first["correct"]
        want[f"maj@{k}"] = maj / PROMPTS
    want["mean_reward"] = sum(r["reward"] for r in rows) / len(rows)
    res = json.load(open(straight / "results.json"))
    assert res["metrics"] == pytest.approx(want, abs=1e-12) and res["k"] == list(KS)
    assert want["pass@4"] > want["pass@1"]  # the samples of a prompt differ: k matters
    assert open(straight / "results.md").read().strip() == res["table"]


def test_a_stopped_run_resumes_to_the_straight_run(ppo_setup, straight, tmp_path):
    out = tmp_path / "resumed"
    _job(ppo_setup, out, *EVAL_FLAGS, "--stop_after_chunks", "1")
    assert len(_rows(out)) == 2 * N and not os.path.exists(out / "results.json")
    with open(out / "samples.jsonl", "a") as f:
        f.write('{"prompt_index": 2, "sam')  # a torn write from a killed run
    _job(ppo_setup, out, *EVAL_FLAGS)
    assert open(out / "samples.jsonl").read() == open(straight / "samples.jsonl").read()
    import yaml

    a, b = (yaml.safe_load(open(d / "run_config.yaml")) for d in (straight, out))
    assert {k for k in a if a[k] != b[k]} == {"output_dir"} and a["k"] == "1,2,4"  # the file's flags, resolved
    assert json.load(open(out / "results.json")) == json.load(open(straight / "results.json"))


def test_judge_in_the_evaluation_scores_each_sample_by_its_verdict(ppo_setup, tmp_path):
    """--judge_pretrain in launch/evaluate.py (2 ranks, the judge answering data-parallel): every sample's reward is
    the scripted judge's known verdict on its own reply (tests/ppo/_judge.py), none failed, and pass@1 is their
    mean."""
    from _judge import TEMPLATE, make_rule_judge, rule

    judge = make_rule_judge(str(tmp_path / "judge"), ppo_setup["actor"])
    tpl = tmp_path / "judge.txt"
    tpl.write_text(TEMPLATE)
    out = tmp_path / "judged"
    _job(ppo_setup, out, "--n_samples_per_prompt", str(N), "--k", "1", "--judge_pretrain", judge,
         "--judge_template", str(tpl), "--judge_parser", "choice:Y=1,N=0", "--judge_max_new_tokens", "1")
    rows = _rows(out)
    assert len(rows) == PROMPTS * N
    assert [r["reward"] for r in rows] == [float(rule(r["output"])) for r in rows] == [r["scores"]["judge"]
                                                                                      for r in rows]
    assert 0 < sum(r["reward"] for r in rows) < len(rows) and all(r["judge_failure"] is None for r in rows)
    res = json.load(open(out / "results.json"))
    assert res["judge_failures"] == {"parse_failed": 0.0, "too_long": 0.0, "refused": 0.0}
    assert res["metrics"]["pass@1"] == pytest.approx(sum(r["reward"] for r in rows) / len(rows), abs=1e-12)
    assert "judge" in res["reward"]
