"""Run the registry of planted bugs (tests/mutants/): each mutant applied alone to a copy of the tree, its tests run
there, killed (a test failed) or survived (all passed) reported with the time it took.

    .venv/bin/python tools/mutants.py                      # every area
    .venv/bin/python tools/mutants.py --area sandbox       # one area
    .venv/bin/python tools/mutants.py --name sandbox-no-pids-max --name sandbox-usr-writable
    .venv/bin/python tools/mutants.py --list

The copy holds the checkout's tracked and untracked-but-not-ignored files (its .venv stays where it is and is used
as it is); the runner checks that the copy's ``rlhf`` (its kernels too) and ``tests`` are what its processes import, and
that every selected mutant's tests pass on the copy before any mutant is applied (a test that fails anyway kills
nothing). A mutant whose text is not found exactly once, or whose tests are not collected, is an error of the
registry. Exit status 0 when every mutant was killed, 1 otherwise. ``--json FILE`` writes the table."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.mutants import load  # noqa: E402


def copy_tree(dst: str) -> None:
    """The checkout's files, as git sees them (tracked, and untracked but not ignored), into ``dst``."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                         check=True).stdout.decode().split("\0")
    for rel in filter(None, out):
        src = os.path.join(REPO, rel)
        if not os.path.isfile(src):  # deleted in the work tree
            continue
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dst, rel))


def env_for(root: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = root
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_imports(root: str) -> None:
    code = "import rlhf, rlhf.kernels as k, tests.mutants as t; print(rlhf.__file__, k.__file__, t.__file__)"
    p = subprocess.run([sys.executable, "-c", code], cwd=root, env=env_for(root), capture_output=True, text=True)
    paths = p.stdout.split()
    if p.returncode != 0 or len(paths) != 3 or not all(os.path.realpath(x).startswith(os.path.realpath(root))
                                                        for x in paths):
        raise SystemExit(f"mutants: the copy at {root} is not what its processes import: {p.stdout}{p.stderr}")


def run_tests(root: str, tests: list[str], timeout: float) -> tuple[int, str, float]:
    """(pytest's exit status, the failed tests' lines, seconds)."""
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "0", "-o", "addopts=",
           "-rfE", *tests]
    try:
        p = subprocess.run(cmd, cwd=root, env=env_for(root), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {timeout:g} s: {(e.stdout or b'')[-400:]!r}", time.monotonic() - t0
    failed = "\n".join(ln for ln in p.stdout.splitlines() if ln.startswith(("FAILED", "ERROR")))
    return p.returncode, failed or p.stdout[-600:], time.monotonic() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--area", default=None)
    p.add_argument("--name", action="append", default=[])
    p.add_argument("--list", action="store_true")
    p.add_argument("--timeout_s", type=float, default=900.0, help="per mutant (and for the unmutated run)")
    p.add_argument("--json", default=None)
    p.add_argument("--keep", action="store_true", help="keep the copy (its path is printed)")
    args = p.parse_args(argv)
    selected = [(a, m) for a, m in load(args.area) if not args.name or m.name in args.name]
    if args.name and len(selected) != len(set(args.name)):
        raise SystemExit(f"mutants: unknown name(s): {sorted(set(args.name) - {m.name for _, m in selected})}")
    if args.list:
        for a, m in selected:
            print(f"{m.name:48s} {m.file:36s} {m.claim}")
        return 0
    root = tempfile.mkdtemp(prefix="rlhf-mutants-")
    rows = []
    try:
        copy_tree(root)
        check_imports(root)
        tests = sorted({t for _, m in selected for t in m.tests})
        code, failed, secs = run_tests(root, tests, args.timeout_s)
        print(f"unmutated: {len(tests)} tests, exit {code}, {secs:.1f} s", flush=True)
        if code != 0:
            raise SystemExit(f"mutants: the tests fail without any mutant; fix them first:\n{failed}")
        for area, m in selected:
            path = os.path.join(root, m.file)
            original = open(path).read()
            n = original.count(m.find)
            if n != 1:
                rows.append({"name": m.name, "area": area, "result": f"error: text found {n} times", "seconds": 0})
                print(f"{m.name:48s} ERROR: its text is found {n} times in {m.file}", flush=True)
                continue
            with open(path, "w") as f:
                f.write(original.replace(m.find, m.replace))
            try:
                code, failed, secs = run_tests(root, list(m.tests), args.timeout_s)
            finally:
                with open(path, "w") as f:
                    f.write(original)
            result = {0: "SURVIVED", 1: "killed", 124: "killed (timeout)"}.get(code, f"error (pytest exit {code})")
            rows.append({"name": m.name, "area": area, "result": result, "seconds": round(secs, 1),
                         "failed": failed.splitlines()[:4]})
            print(f"{m.name:48s} {result:18s} {secs:6.1f} s  {failed.splitlines()[0][:100] if failed else ''}",
                  flush=True)
    finally:
        if args.keep:
            print(f"copy kept at {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    killed = sum(r["result"].startswith("killed") for r in rows)
    print(f"{killed} of {len(rows)} killed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "killed": killed, "total": len(rows)}, f, indent=1)
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
