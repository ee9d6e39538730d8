"""Verifiable rewards (rlhf/rewards/verifiers.py) by hand cases, and OpenRLHF's own reward files (tests/peers/openrlhf, the
math one with its import line changed) run through --remote_rm_url's file path: rewards, scores, extra logs."""
import os

import pytest
import torch
from helpers import REPO

from rlhf.rewards import verifiers as V
from rlhf.rewards.sources import call_remote_rm_full, check_remote_rm

PEERS = os.path.join(REPO, "tests", "peers", "openrlhf")


@pytest.mark.parametrize("text,want", [
    ("so \\boxed{42}.", "42"), ("\\boxed{\\frac{1}{2}} and later \\boxed{x^{2}+1}", "x^{2}+1"),
    ("\\fbox{7}", "7"), ("no box", None), ("\\boxed{unclosed", None), ("\\boxed 5.", "5")])
def test_extract_boxed(text, want):
    assert V.extract_boxed_answer(text) == want


@pytest.mark.parametrize("text,want", [("it is 1,234 apples", "1234"), ("-3 then 2.5.", "2.5"), ("3/4", "3/4"),
                                       ("none", None)])
def test_extract_last_number(text, want):
    assert V.extract_last_number(text) == want


@pytest.mark.parametrize("given,truth,ok", [
    ("42", "42", True), ("42.0", "42", True), ("0.5", "\\frac{1}{2}", True), ("\\dfrac{1}{2}", "0.5", True),
    ("3/4", "0.75", True), ("1+2x", "2x+1", True), ("\\sqrt{4}", "2", True), ("43", "42", False),
    ("x+1", "x-1", False), (None, "1", False), ("", "0", False), ("12\\%", "12", True)])
def test_grade_answer(given, truth, ok):
    assert V.grade_answer(given, truth) is ok


def test_math_reward_boxed_then_last_number_and_needs_labels():
    replies = ["I think \\boxed{12}", "so 3 + 4 = 7", "the answer is 8", "\\boxed{7} but 12"]
    assert V.math_reward(["q"] * 4, replies, ["12", "7", "7", "7"]) == [1.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="--label_key"):
        V.math_reward(["q"], ["1"], [None])


def test_without_math_verify_strings_and_numbers_remain(monkeypatch, caplog):
    import builtins

    real = builtins.__import__

    def no_math_verify(name, *a, **k):
        if name == "math_verify":
            raise ImportError("no math_verify")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    monkeypatch.setattr(V, "_warned", False)
    assert V.grade_answer("0.5", "\\frac{1}{2}") and V.grade_answer("7", "7")
    assert not V.grade_answer("1+2x", "2x+1")  # symbolic needs math-verify: the named fallback says so
    assert "math-verify is not installed" in caplog.text


def test_openrlhf_math_reward_file_runs_with_its_import_changed():
    url = os.path.join(PEERS, "math_reward_func.py")
    check_remote_rm(url)
    prompts = ["What is 3+4? ", "Half of one? ", "2*6? "]
    replies = ["\\boxed{7}", "\\boxed{0.5}", "\\boxed{13}"]
    out = call_remote_rm_full(url, [p + r for p, r in zip(prompts, replies)], prompts, ["7", "\\frac{1}{2}", "12"])
    assert out.rewards.tolist() == [1.0, 1.0, 0.0] and out.scores.tolist() == [1.0, 1.0, 0.0]
    assert float(out.extra_logs["math_accuracy"]) == pytest.approx(2 / 3)


def test_openrlhf_reward_file_runs_unchanged(capsys):
    url = os.path.join(PEERS, "reward_func.py")
    torch.manual_seed(0)
    out = call_remote_rm_full(url, ["a b", "c d", "e f"], ["a ", "c ", "e "], [None] * 3)
    assert out.rewards.shape == (3,) and set(out.rewards.tolist()) <= {0.0, 1.0}
    assert torch.equal(out.scores, out.rewards) and "dummy_scores" in out.extra_logs


@pytest.mark.parametrize("body,needle", [("x = 1\n", "defines no function reward_func"),
                                         ("import no_such_module\n", "importing it failed: ModuleNotFoundError")])
def test_bad_reward_files_name_the_flag(tmp_path, body, needle):
    f = tmp_path / "rf.py"
    f.write_text(body)
    with pytest.raises(ValueError, match=f"--remote_rm_url {f}: {needle}"):
        check_remote_rm(str(f))
    with pytest.raises(ValueError, match="no such file"):
        check_remote_rm(str(tmp_path / "missing.py"))


def test_arith_task_splits_are_disjoint_and_right():
    """The real-model example's task (rlhf/demo/arith_task.py): distinct questions, none of the held-out ones
    trained on, every answer right (checked by evaluating the question), the three kinds present."""
    import re

    from rlhf.demo.arith_task import make_split

    train, held = make_split(seed=0)
    assert (len(train), len(held)) == (512, 64)
    key = lambda r: tuple(sorted(map(int, re.findall(r"\d+", r["prompt"])))) + ("times" in r["prompt"],)  # noqa
    assert len({key(r) for r in train + held}) == 576
    for r in train + held:
        a, b = map(int, re.findall(r"\d+", r["prompt"]))
        assert int(r["answer"]) == (a * b if "times" in r["prompt"] else a + b)
    kinds = {("times" in r["prompt"], max(map(int, re.findall(r"\d+", r["prompt"]))) > 30) for r in train}
    assert (True, False) in kinds and (False, True) in kinds and (False, False) in kinds
    assert make_split(seed=0) == (train, held) and make_split(seed=1) != (train, held)
