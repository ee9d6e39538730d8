"""`import kernels` (and running its torch paths) must not import triton."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys, torch, kernels
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
