"""Record the suite's measured durations in ``tests/durations.json``, which ``tests/conftest.py`` reads to run the
heaviest files first (so that pytest-xdist's two workers end together) and to mark the slow tests (``-m "not slow"``,
the quick tier, leaves them out).

    .venv/bin/python -m pytest tests -q --junitxml=/tmp/suite.xml
    .venv/bin/python tools/test_durations.py /tmp/suite.xml

A test's time is pytest's junit figure (set-up, call and tear-down; a module fixture's cost lands on the first test
that uses it). The file records the machine (lscpu model name), the date and the commit it was measured at.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "durations.json")


def node_id(classname: str, name: str) -> str:
    """junit's ``tests.ppo.test_x`` + ``test_y[p]`` -> pytest's ``tests/ppo/test_x.py::test_y[p]``."""
    return classname.replace(".", "/") + ".py::" + name


def read_junit(paths: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for path in paths:
        for tc in ET.parse(path).getroot().iter("testcase"):
            out[node_id(tc.get("classname"), tc.get("name"))] = round(float(tc.get("time", 0.0)), 2)
    return out


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("junit", nargs="+", help="pytest --junitxml files of full runs")
    p.add_argument("--out", default=OUT)
    p.add_argument("--commit", default=None, help="the commit the junit files were measured at (default: HEAD)")
    args = p.parse_args(argv)
    tests = read_junit(args.junit)
    if not tests:
        print(f"error: no test cases in {args.junit}", file=sys.stderr)
        return 2
    files: dict[str, float] = collections.Counter()
    for nid, sec in tests.items():
        files[nid.split("::")[0]] += sec
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                           text=True).stdout.strip()
    doc = {"measured": {"date": datetime.date.today().isoformat(), "commit": commit, "cpu": cpu_model(),
                        "tests": len(tests), "seconds": round(sum(tests.values()), 1)},
           "files": {f: round(s, 1) for f, s in sorted(files.items(), key=lambda kv: -kv[1])},
           "tests": dict(sorted(tests.items()))}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"{args.out}: {len(tests)} tests, {doc['measured']['seconds']} s of test time, {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
