"""Helpers shared by tests: run a script under torchrun, make tiny HF models once per session."""
from __future__ import annotations

import os
from rlhf.distributed.env import free_port  # noqa: F401  (tests import it from here)
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)


def require(module: str, why: str = "") -> None:
    """A test's dependency: skip where it is missing on a developer's machine, fail under CI=true, where a missing
    package is an install bug that a skip would hide (the suite would stay green with whole trainers untested)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec(module) is not None:
        return
    msg = f"{module} is not installed{': ' + why if why else ''} (bash tools/setup_env.sh installs it)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true: {msg}", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def test_env(**extra: str) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


def run_torchrun(script: str, nproc: int, args: list[str], timeout: float = 600, **env: str):
    """Run ``torchrun --nproc_per_node nproc script args``; returns the CompletedProcess (text)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), script, *args]
    return subprocess.run(cmd, cwd=REPO, env=test_env(**env), capture_output=True, text=True, timeout=timeout)


def run_python(args: list[str], timeout: float = 600, **env: str):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=test_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def tail(proc, n: int = 3000) -> str:
    return (proc.stdout[-n:] + "\n--- stderr ---\n" + proc.stderr[-n:])
