"""``kernels.set_cpu_bf16_in_fp32``: bf16 CPU attention and fused log-probs computed in fp32, against fp64
references, and the switch itself (on: exactly the fp32 computation rounded to bf16; off: torch's bf16 kernel)."""

from __future__ import annotations

import pytest
import torch

import rlhf.kernels as kernels
from _kernels_testlib import ATTN_TOL, naive_logprobs, packed_qkv, padded_attention


@pytest.fixture
def in_fp32():
    before = kernels._cpu_bf16_in_fp32["on"]
    yield kernels.set_cpu_bf16_in_fp32
    kernels.set_cpu_bf16_in_fp32(before)


def _attention(q, k, v, grad_out, cu):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = kernels.varlen_attention(*leaves, cu, int((cu[1:] - cu[:-1]).max()))
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("lens", [[30, 27, 0, 33, 29], [40, 5, 3]])  # the batched path and the loop
def test_attention_bf16_in_fp32(in_fp32, lens, monkeypatch):
    q, k, v, grad_out, cu = packed_qkv(lens, 6, 2, 16, torch.bfloat16)
    seen = []
    monkeypatch.setattr(kernels, "varlen_attention_reference",
                        lambda q, *a: seen.append(q.dtype) or kernels.reference.varlen_attention_reference(q, *a))
    monkeypatch.setattr(kernels, "varlen_attention_padded",
                        lambda q, *a: seen.append(q.dtype) or kernels.attention_torch.varlen_attention_padded(q, *a))
    in_fp32(True)
    out, grads = _attention(q, k, v, grad_out, cu)
    assert seen == [torch.float32]
    out32, grads32 = _attention(q.float(), k.float(), v.float(), grad_out.float(), cu)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    assert torch.equal(out, out32.to(torch.bfloat16))  # the fp32 computation, rounded once
    for g, g32 in zip(grads, grads32):
        assert torch.equal(g, g32.to(torch.bfloat16))
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = padded_attention(*ref_leaves, cu)
    ref.backward(grad_out.double())
    torch.testing.assert_close(out.double(), ref.detach(), **ATTN_TOL[torch.bfloat16])
    for g, r in zip(grads, ref_leaves):
        torch.testing.assert_close(g.double(), r.grad, **ATTN_TOL[torch.bfloat16])
    in_fp32(False)
    seen.clear()
    _attention(q, k, v, grad_out, cu)
    assert seen == [torch.bfloat16]


def test_fused_logprobs_bf16_in_fp32(in_fp32):
    g = torch.Generator().manual_seed(3)
    n, h, v = 24, 32, 300
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) / h**0.5).bfloat16()
    targets = torch.randint(0, v, (n,), generator=g)
    gl = torch.randn(n, generator=g)

    def run(x, w):
        x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp = kernels.fused_linear_logprobs(x, w, targets, temperature=0.7, chunk_size=8)
        (lp * gl).sum().backward()
        return lp.detach(), x.grad, w.grad

    in_fp32(True)
    lp, gh, gw = run(hidden, weight)
    lp32, gh32, gw32 = run(hidden.float(), weight.float())
    assert gh.dtype == gw.dtype == torch.bfloat16
    assert torch.equal(lp, lp32)
    assert torch.equal(gh, gh32.bfloat16()) and torch.equal(gw, gw32.bfloat16())
    x64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    ref = naive_logprobs(x64 @ w64.t(), targets, 0.7)[0]
    (ref * gl.double()).sum().backward()
    # fp32 logits: as tight as fp32's forward, where torch's bf16 logits are only bf16-accurate
    torch.testing.assert_close(lp.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh.double(), x64.grad, atol=1e-2, rtol=2e-2)
    torch.testing.assert_close(gw.double(), w64.grad, atol=1e-2, rtol=2e-2)
    in_fp32(False)
    lp16 = run(hidden, weight)[0]
    assert not torch.equal(lp16, lp)  # the bf16 logits: the switch does change the kernel
