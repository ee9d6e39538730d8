"""`import rlhf.kernels` (and running its torch paths) must not import triton."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys, torch
import rlhf.kernels as kernels
assert "triton" not in sys.modules, "import kernels pulled in triton"
logits, targets = torch.randn(3, 8, requires_grad=True), torch.zeros(3, dtype=torch.long)
kernels.token_logprobs(logits, targets, return_entropy=True)[0].sum().backward()
q = torch.randn(4, 2, 8)
kernels.varlen_attention(q, q, q, kernels.cu_seqlens_from_lengths([1, 3]), 3)
kernels.balance_microbatches([3, 4], 8)
assert "triton" not in sys.modules, "the CPU torch path pulled in triton"
print("ok")
"""


def test_import_does_not_pull_triton(child_env):
    out = subprocess.run([sys.executable, "-c", CODE], env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


BROKEN = """
import sys, types, logging, torch
import rlhf.kernels as kernels
logging.basicConfig(level=logging.INFO)
t = types.SimpleNamespace(is_cuda=True, device=torch.device("cpu"), dtype=torch.bfloat16)  # a CUDA tensor's looks
print("PATH", kernels._select("varlen_attention", t, fast_paths=("flash_attn",)))
"""


def test_broken_fast_path_falls_back(child_env, tmp_path):
    """An installed flash-attn that does not import (a wheel built for another torch) is passed over with one
    warning; a working one is chosen (the control)."""
    for name, body, want in (("broken", "raise ImportError('undefined symbol: _ZN3c10')", False),
                             ("working", "", True)):
        pkg = tmp_path / name / "flash_attn"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(body + "\n")
        env = child_env()
        env["PYTHONPATH"] = f"{tmp_path / name}:{env.get('PYTHONPATH', '')}"
        out = subprocess.run([sys.executable, "-c", BROKEN], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        path = out.stdout.split("PATH ")[-1].strip()
        assert (path == "flash_attn") is want, (name, path, out.stderr[-1500:])
        warned = "flash_attn is installed but does not import (ImportError: undefined symbol: _ZN3c10)"
        assert (warned in out.stderr) is not want, out.stderr[-1500:]
