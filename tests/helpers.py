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


test_env.__test__ = False  # a helper, not a test, in the modules that import it by name


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


def make_seq_cls_rm(out: str, tokenizer_dir: str, seed: int = 0, scale: float = 1.0, **dims) -> str:
    """An ordinary tiny HF Llama ``ForSequenceClassification`` (random, every attention and MLP layer live, so its
    score depends on the whole context and on positions) for reward-model and critic tests. Only its score head is
    rescaled, so that scores of random token sequences spread with std ``scale`` (a random init's spread is too
    small for a policy to move within a few test steps)."""
    import torch
    import transformers

    from rlhf.models.tiny import make_tiny_hf

    make_tiny_hf(out, "llama", seq_cls=True, seed=seed, tokenizer_dir=tokenizer_dir, **dims)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    g = torch.Generator().manual_seed(seed + 17)
    ids = torch.randint(3, model.config.vocab_size, (64, 12), generator=g)
    with torch.no_grad():
        scores = model(input_ids=ids).logits.squeeze(-1)  # (64,): the last token's score
        model.score.weight.mul_(scale / scores.std())
    model.save_pretrained(out)
    return out
