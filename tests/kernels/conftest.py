"""Shared helpers for tests/kernels.

Triton never gets imported into the main pytest process: the interpreter (TRITON_INTERPRET=1) and the
ahead-of-time compile checks run in child pytest processes (see test_kernels_triton.py), so the env var
cannot leak into the rest of the session.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# `kernels` is a top-level package of the repo; `_kernels_testlib` sits here. Both must import under any
# --import-mode, in this process and in child processes (see _child_env).
for _p in (REPO, HERE):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


def _child_env(**overrides: str | None) -> dict[str, str]:
    """Environment for child processes: 1 thread, the repo importable, given vars set (None removes one)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(HERE), env.get("PYTHONPATH")) if p)
    for key in ("TRITON_INTERPRET", "RLHF_KERNELS_FORCE_TRITON", "RLHF_KERNELS_FORCE_TORCH"):
        env.pop(key, None)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _run_child_pytest(path: Path, env: dict[str, str], *extra: str, timeout: int = 300) -> None:
    """Run a pytest file in a fresh process; fail with its output if any of its tests fail."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", str(path), *extra]
    from helpers import run_tagged  # tests/helpers.py: the child pytest and whatever it starts end with the test

    proc = run_tagged(cmd, timeout, full_env=env)
    if proc.returncode != 0:
        pytest.fail(f"{path.name} failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")


@pytest.fixture
def child_env():
    """`child_env(**overrides)` -> env dict for a child process (1 thread, repo on PYTHONPATH)."""
    return _child_env


@pytest.fixture
def run_child_pytest():
    """`run_child_pytest(path, env, *args)`: run a pytest file in a fresh process, fail with its output."""
    return _run_child_pytest


@pytest.fixture(autouse=True)
def _torch_only_path(monkeypatch):
    """In this process the kernels always take the torch path, whatever the caller's environment says."""
    monkeypatch.delenv("RLHF_KERNELS_FORCE_TRITON", raising=False)
    monkeypatch.delenv("RLHF_KERNELS_FORCE_TORCH", raising=False)
