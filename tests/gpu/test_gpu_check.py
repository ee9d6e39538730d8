"""tests/gpu/gpu_check.py's reporting, deadline and figures, on CPU (the checks themselves need the GPU machine):
launches stubbed with short Python commands."""
import importlib.util
import json
import os
import sys
import time

import pytest
from helpers import REPO


@pytest.fixture
def gc(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "tests", "gpu", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "header", lambda report: report.say("# header"))  # no torch import, no GPU query
    return mod


def _run(gc, tmp_path, checks: dict, only: str, deadline_s: float):
    for name, fn in checks.items():
        gc.CHECKS[name] = fn
    rc = gc.main(["--only", only, "--rehearse_on_cpu", "--deadline_s", str(deadline_s), "--out",
                  str(tmp_path / "out"), "--results", str(tmp_path / "res")])
    res = tmp_path / "res"
    return rc, (res / "summary.txt").read_text(), json.loads((res / "figures.json").read_text()), \
        (res / "tails.txt").read_text()


def test_offload_phase_names_are_whole(gc):
    """PPO's offload/<phase>_device_freed_gb keys give whole phase names (the old k[8:-17] cut "actor" to "acto")."""
    m = {"offload/actor_device_freed_gb": 1.23456, "offload/ref_device_freed_gb": 0.5, "time/rollout": 2.0}
    assert gc.harness.offload_freed_gb(m) == {"actor": 1.235, "ref": 0.5}


def test_a_launch_past_the_deadline_is_not_run_and_results_come_back(gc, tmp_path, monkeypatch):
    """A launch that would start past the deadline, one that the deadline cuts, and a check never reached are
    NOT RUN (before: FAIL with rc=125, or rc=124 for the cut one), with what ran kept: the small result files hold
    the lines, every launch's tail and its seconds."""
    monkeypatch.setattr(gc.harness, "MIN_START_S", 0.5)

    def left(c, seconds):  # move the deadline to `seconds` from now
        c.deadline_s = time.monotonic() - c.start + seconds

    def two_launches(c):
        c.launch([sys.executable, "-c", "print('first launch ran')"], "first")
        saved = c.deadline_s
        left(c, 0.2)
        try:
            c.launch([sys.executable, "-c", "print('second')"], "second")
        finally:
            c.deadline_s = saved

    def cut(c):
        left(c, 1.5)  # the launch gets 1 s
        c.launch([sys.executable, "-c", "import time; print('cut launch started', flush=True); time.sleep(60)"],
                 "cut")

    checks = {"two": two_launches, "cut": cut, "later": lambda c: None}
    rc, summary, figures, tails = _run(gc, tmp_path, checks, "two,cut,later", deadline_s=60)
    assert rc == 1
    lines = summary.splitlines()
    assert any(ln.startswith("NOT RUN two ") and "left of the part's" in ln for ln in lines), summary
    assert any(ln.startswith("NOT RUN cut cut cut at the part's") and "deadline after 1 s" in ln for ln in lines), summary
    assert any(ln.startswith("NOT RUN later ") for ln in lines), summary
    assert not any(ln.startswith("FAIL") for ln in lines), summary
    assert lines[-1].startswith("0 passed, 0 failed, 3 not run"), summary
    assert "first launch ran" in tails and "===== cut: last" in tails and "=== second" not in tails
    assert figures["checks"]["two"]["status"] == "NOT RUN" and set(figures["checks"]["two"]["launch_s"]) == {"first"}
    assert figures["checks"]["cut"]["launch_s"]["cut"] >= 1


def test_a_fail_line_carries_the_traceback(gc, tmp_path):
    """A failing launch's FAIL line quotes the end of the rank's traceback, its error line and its last lines, and
    of torchrun's report after them only the exit code; a check that raises quotes its own traceback."""
    crash = tmp_path / "rank.py"  # a rank's traceback and error line, then torchrun's own report
    crash.write_text("import sys, traceback\ndef step():\n    return 1 / 0\ntry:\n    step()\nexcept Exception:\n"
                     "    traceback.print_exc()\n    print('error: step 1 failed', file=sys.stderr)\n"
                     "print('rank output ' * 3, flush=True)\n"
                     "print('Traceback (most recent call last):\\n  File \"torch/distributed/run.py\"\\n'\n"
                     "      'ChildFailedError: \\n  rank : 0\\n  exitcode : 1 (pid: 7)\\n=====')\n"
                     "sys.exit(1)\n")

    def failing(c):
        rc = c.launch([sys.executable, str(crash)], "failing")
        c.report.add("failing", rc == 0, f"rc={rc}", {"rc": rc}, c.log("failing"))

    def raising(c):
        raise KeyError("no such metric")

    rc, summary, figures, tails = _run(gc, tmp_path, {"failing": failing, "raising": raising}, "failing,raising",
                                       deadline_s=60)
    assert rc == 1
    block = summary[summary.index("FAIL failing"):summary.index("FAIL raising")]
    assert "    | ZeroDivisionError: division by zero" in block and "return 1 / 0" in block, block
    assert "    | error: step 1 failed" in block and "    | rank output" in block, block
    assert "    |   exitcode : 1 (pid: 7)" in block and "ChildFailedError" not in block, block  # torchrun's, cut
    assert "    | KeyError: 'no such metric'" in summary[summary.index("FAIL raising"):]
    assert figures["checks"]["failing"]["status"] == "FAIL" and figures["checks"]["failing"]["rc"] == 1
    assert "ZeroDivisionError" in tails
    assert summary.splitlines()[-1].startswith("0 passed, 2 failed, 0 not run")


def test_parts_and_mfu_figures(gc):
    """Every check is in exactly one part; the MFU of the speed part's steps counts 6 x matmul weights + causal
    attention (by hand at SmolLM2-135M's shape: 1.019 GFLOP per token at a mean context of 1024.5)."""
    in_parts = [n for p in gc.PARTS.values() for n in p]
    assert sorted(in_parts) == sorted(gc.CHECKS) and len(set(in_parts)) == len(in_parts)
    assert set(gc.PARTS) == set(gc.PART_BUDGET_S)
    assert gc.select("fp32,sft_bf16") == (list(gc.PARTS["fp32"]) + ["sft_bf16"],
                                          gc.PART_BUDGET_S["fp32"] + gc.PART_BUDGET_S["bf16"])
    with pytest.raises(ValueError, match="--only: unknown part or check 'gpu'"):
        gc.select("gpu")
    layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
    by_hand = 6 * (30 * layer + 576 * 49152) + 12 * 30 * 576 * 1024.5
    assert gc.harness.train_flops_per_token(gc.harness.SMOLLM2_135M, 1024.5) == pytest.approx(by_hand)
    steps = {1: {"tokens_per_s": 10.0}, 2: {"tokens_per_s": 50.0}, 3: {"tokens_per_s": 200e3},
             4: {"tokens_per_s": 210e3}, 5: {"tokens_per_s": 190e3}}
    m = gc.harness.mfu_of(steps, by_hand, gc.harness.bf16_peak_tflops("NVIDIA H100 80GB HBM3"))
    assert m["tokens_per_s"] == 200e3 and m["timed_steps"] == 3
    assert m["mfu"] == pytest.approx(by_hand * 200e3 / 989e12)
    peak = gc.harness.bf16_peak_tflops
    assert peak("NVIDIA H100 PCIe") == 756.0 and peak("NVIDIA H200") == 989.0


def test_speed_rows_are_2048_tokens_and_only_the_goal_passes(tmp_path, monkeypatch):
    """The speed part (tests/gpu/gpu_speed.py; it replaced the MFU bar): its generated texts fill 2048-token rows with
    the check's tokenizer, HF is fed the same texts' tokens, and the check, its launches stubbed with their result
    files, is a PASS only when ours reaches the goal against transformers + Liger (1.15x at the 1B shape) at no more
    peak memory: 1.16x with less memory passes; 1.14x, or 1.2x with more memory, fails."""
    import transformers

    import rlhf.models.tiny as tiny
    from rlhf.demo.sort_task import corpus

    sys.path.insert(0, os.path.join(REPO, "tests", "gpu"))
    import gpu_speed as gs

    gc = gs.harness
    tok_dir = str(tmp_path / "tok")
    tok = tiny.make_tokenizer(tok_dir, vocab_size=384, seed=0, texts=corpus())
    texts = gc.long_texts(tok, 3, gs.SHAPE["max_len"] + 16)
    assert len(texts) == 3 and len(set(texts)) == 3 and gs.SHAPE["max_len"] == 2048
    assert all(len(tok(t)["input_ids"]) >= 2064 for t in texts)

    def config_only(out, *args, **dims):  # the model's config is all the check reads back
        dims = {k: v for k, v in dims.items() if k not in ("tokenizer_dir", "dtype", "seed")}
        transformers.LlamaConfig(**dims).save_pretrained(out)
        return out

    monkeypatch.setattr(tiny, "make_tiny_hf", config_only)
    monkeypatch.setattr(gc, "bf16_peak_tflops", lambda name: 989.0)
    monkeypatch.setattr(gs, "SHAPE", dict(max_len=64, micro=2, batch=2, steps=4))  # small data, same code
    for case, (ours, ours_peak, status) in enumerate(((1.16, 40.0, "PASS"), (1.14, 40.0, "FAIL"),
                                                      (1.2, 47.0, "FAIL"))):
        tps = {"ours": ours * 1e4, "ours_unfused": 0.9e4, "hf": 0.8e4, "hf+liger": 1e4}
        peak = {"ours": ours_peak, "ours_unfused": 50.0, "hf": 70.0, "hf+liger": 46.0}
        seen_rows = []

        def torchrun(script, args, label):
            v = "ours" if "--use_liger_kernel" in args else "ours_unfused"
            save = args[args.index("--save_path") + 1]
            os.makedirs(save, exist_ok=True)
            with open(os.path.join(save, "metrics.jsonl"), "w") as f:
                for step in range(1, int(args[args.index("--stop_after_steps") + 1]) + 1):
                    f.write(json.dumps({"prefix": "sft", "step": step, "mem/peak_gb": peak[v],
                                        "tokens_per_s": tps[v] / (10 if step < 3 else 1)}) + "\n")
            return 0

        def launch(cmd, label):
            v = "hf+liger" if cmd[cmd.index("--liger") + 1] == "1" else "hf"
            with open(cmd[cmd.index("--rows_file") + 1]) as f:
                seen_rows.append(json.load(f))
            with open(cmd[cmd.index("--json") + 1], "w") as f:
                json.dump({"tokens_per_s": [tps[v] / 10, tps[v] / 10] + [tps[v]] * 2, "peak_mem_gib": peak[v]}, f)
            return 0

        report = gc.Report(None, "speed")
        c = gc.Check(str(tmp_path / f"c{case}"), report, 100.0, rehearse=False)
        c._assets, c.torchrun, c.launch, c.current = {"tokenizer": tok_dir}, torchrun, launch, "speed_1b"
        gs.check_speed(c, "llama32_1b")
        assert report.status["speed_1b"] == status, report.lines
        fig = report.figures["checks"]["speed_1b"]
        assert fig["ratios"]["ours/hf+liger"] == pytest.approx(ours)  # steps 1-2 (10x slower) left out
        assert fig["ours"]["peak_gib"] == ours_peak
        rows = seen_rows[0]
        assert len(rows) >= 8 and {len(r) for r in rows} == {64} and seen_rows[1] == rows


def test_gpu_check_stops_clearly_without_a_gpu(tmp_path):
    """tests/gpu/gpu_check.sh on a CPU machine: the environment header, a note that no wheels were found, then one
    STOP line at its first GPU-only step and exit status 2, before any heavy work."""
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run for real")
    env = dict(os.environ, PYTHON=sys.executable, RLHF_WHEELS=str(tmp_path / "no_wheels"))
    p = subprocess.run(["bash", os.path.join(REPO, "tests", "gpu", "gpu_check.sh"), "--out", str(tmp_path / "out")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert any(ln.startswith("# torch ") and "setup.py pins torch 2.13.0" in ln for ln in lines), lines
    assert any(ln.startswith("# megatron-core 0.16.1") for ln in lines), lines
    assert "# no wheels in" in p.stdout
    assert lines[-1].startswith("STOP: no CUDA device"), lines
    assert not os.path.exists(tmp_path / "out")  # nothing heavy started


def test_gpu_carry_fits_one_call(monkeypatch, capsys):
    """tests/gpu/gpu_carry.py: the tree plus the wheels the GPU machine lacks (zipped from the installed packages where
    tests/gpu/wheels is empty) under the 64 MiB one device call may carry; measured here 23.9 MiB (tree 6.0,
    transformers 12.0, megatron-core 2.5, regex 0.8, liger-kernel 0.9, and the grpo part's trl 1.0, datasets 0.6,
    dill 0.1, multiprocess 0.1). Control: a limit below the total fails."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_carry", os.path.join(REPO, "tests", "gpu", "gpu_carry.py"))
    carry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(carry)
    parts = carry.carry()
    total = sum(b for b, _ in parts.values())
    assert set(parts) == {"tree", "megatron-core", "transformers", "regex", "liger-kernel", "trl", "datasets", "dill",
                          "multiprocess"}
    assert all(b > 100_000 for b, _ in parts.values()), parts
    assert total < carry.LIMIT and carry.main() == 0, parts
    monkeypatch.setattr(carry, "LIMIT", total - 1)
    assert carry.main() == 1
