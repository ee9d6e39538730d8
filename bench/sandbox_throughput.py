"""Sandbox throughput: sandboxed test runs per second, the way the code reward spends them.

    .venv/bin/python bench/sandbox_throughput.py [--replies 16] [--tests 3] [--rounds 3] [--out FILE]

Two figures, each the median of ``--rounds`` rounds, on the machine's every isolation layer:
* ``serial_runs_per_s``: one stdin program after another, one sandboxed run each (``run_program``);
* ``grade_tests_per_s``: ``code_reward.grade`` over ``--replies`` replies of ``--tests`` MBPP-style call tests each,
  with the reward's default two workers (what a rank's reward phase does).
Prints one JSON line (figures, commit, CPU); ``--out`` also writes it to a file."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._machine import commit, cpu_model  # noqa: E402

PROGRAM = "def f(x):\n    return x + 3\n"
STDIN_PROGRAM = "import sys\nprint(sum(map(int, sys.stdin.read().split())))\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replies", type=int, default=16)
    p.add_argument("--tests", type=int, default=3)
    p.add_argument("--serial_runs", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from rlhf.sandbox import SandboxConfig, probe, run_program
    from rlhf.sandbox.code_reward import CodeRewardConfig, grade

    missing = {k: v for k, v in probe().items() if v}
    if missing:
        print(f"sandbox layers missing: {missing}", file=sys.stderr)
        return 1
    cfg = SandboxConfig(timeout_s=10)
    label = json.dumps({"test_list": [f"assert f({i}) == {i + 3}" for i in range(args.tests)]})
    replies = [f"```python\n{PROGRAM}```"] * args.replies
    serial, graded = [], []
    for _ in range(args.rounds):
        t0 = time.monotonic()
        for i in range(args.serial_runs):
            r = run_program(STDIN_PROGRAM, f"{i} 1 2", cfg)
            assert r.status == "ok" and r.stdout == f"{i + 3}\n", r
        serial.append(args.serial_runs / (time.monotonic() - t0))
        t0 = time.monotonic()
        rewards, verdicts = grade(replies, [label] * args.replies, CodeRewardConfig(code_timeout_s=10))
        assert rewards == [1.0] * args.replies, verdicts
        graded.append(args.replies * args.tests / (time.monotonic() - t0))
    out = {"serial_runs_per_s": round(statistics.median(serial), 2),
           "grade_tests_per_s": round(statistics.median(graded), 2),
           "rounds": {"serial": [round(x, 2) for x in serial], "grade": [round(x, 2) for x in graded]},
           "replies": args.replies, "tests_per_reply": args.tests, "workers": 2,
           "commit": commit(), "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d")}
    line = json.dumps(out)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
