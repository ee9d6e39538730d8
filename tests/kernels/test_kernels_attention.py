"""varlen_attention (torch path): packed THD attention equals padded-batch attention for every sequence."""

from __future__ import annotations

import pytest
import torch

import kernels
from _kernels_testlib import ATTN_TOL, packed_qkv, padded_attention
from kernels.reference import varlen_attention_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,hq,hkv,d", [([5, 17, 1, 9], 4, 2, 16), ([8], 2, 2, 8), ([3, 0, 12], 6, 1, 32)])
def test_packed_matches_padded(dtype, lens, hq, hkv, d):
    q, k, v, grad_out, cu = packed_qkv(lens, hq, hkv, d, dtype)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = kernels.varlen_attention(*leaves, cu, max(lens))
    out.backward(grad_out)

    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = padded_attention(*ref_leaves, cu)
    ref.backward(grad_out.double())

    assert out.shape == q.shape and out.dtype == dtype
    tol = ATTN_TOL[dtype]
    # Compared sequence by sequence so that a leak across a boundary names the sequence.
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        torch.testing.assert_close(out[s:e].double(), ref[s:e], **tol, msg=lambda m: f"seq {i} output: {m}")
        for name, a, b in zip("qkv", leaves, ref_leaves):
            torch.testing.assert_close(a.grad[s:e].double(), b.grad[s:e], **tol,
                                       msg=lambda m: f"seq {i} d{name}: {m}")


def test_softmax_scale_and_sequence_isolation():
    q, k, v, _, cu = packed_qkv([4, 6], 2, 2, 8, torch.float32)
    out = kernels.varlen_attention(q, k, v, cu, 6, softmax_scale=0.3)
    torch.testing.assert_close(out.double(), padded_attention(q, k, v, cu, scale=0.3), **ATTN_TOL[torch.float32])
    # Changing the second sequence must not move the first one's output.
    k2 = k.clone()
    k2[4:] += 1.0
    torch.testing.assert_close(kernels.varlen_attention(q, k2, v, cu, 6)[:4],
                               varlen_attention_reference(q, k, v, cu, 6)[:4])


def test_shape_errors():
    q, k, v, _, cu = packed_qkv([4], 3, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        kernels.varlen_attention(q, k, v, cu, 4)
    with pytest.raises(ValueError, match="expected q"):
        kernels.varlen_attention(q[:, :2], k, v[:2], cu, 4)
