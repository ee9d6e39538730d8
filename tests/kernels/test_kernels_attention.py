"""varlen_attention (torch path): packed THD attention equals padded-batch attention for every sequence."""

from __future__ import annotations

import pytest
import torch

import rlhf.kernels as kernels
from _kernels_testlib import ATTN_TOL, packed_qkv, padded_attention
from rlhf.kernels.reference import varlen_attention_reference


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,hq,hkv", [([30, 27, 0, 33, 29], 4, 2), ([12, 11, 12], 3, 3)])
def test_batched_torch_path_matches_fp64(dtype, lens, hq, hkv, monkeypatch):
    """Close lengths take the padded-batch path (one SDPA call); it must equal the fp64 padded reference and the
    per-sequence loop, outputs and all three grads, padding rows never leaking into real ones."""
    from rlhf.kernels import attention_torch

    assert attention_torch.padding_pays(lens)
    calls = []
    monkeypatch.setattr(kernels, "varlen_attention_padded",
                        lambda *a: calls.append(1) or attention_torch.varlen_attention_padded(*a))
    q, k, v, grad_out, cu = packed_qkv(lens, hq, hkv, 16, dtype)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = kernels.varlen_attention(*leaves, cu, max(lens))
    out.backward(grad_out)
    assert calls, "the batched path did not run"
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    padded_attention(*ref_leaves, cu).backward(grad_out.double())
    tol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.double(), padded_attention(q, k, v, cu), **tol)
    for name, a, b in zip("qkv", leaves, ref_leaves):
        torch.testing.assert_close(a.grad.double(), b.grad, **tol, msg=lambda m: f"d{name}: {m}")
    monkeypatch.setenv(kernels.VARLEN_LOOP_ENV, "1")  # the switch back to the loop
    calls.clear()
    torch.testing.assert_close(kernels.varlen_attention(q, k, v, cu, max(lens)),
                               varlen_attention_reference(q, k, v, cu, max(lens)))
    assert not calls


def test_padding_pays_only_for_close_lengths():
    from rlhf.kernels.attention_torch import padding_pays

    assert padding_pays([58, 61, 55, 60]) and padding_pays([10, 0, 11])
    assert not padding_pays([300, 20, 25, 30]) and not padding_pays([40]) and not padding_pays([0, 0])


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
