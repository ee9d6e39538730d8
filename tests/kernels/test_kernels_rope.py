"""kernels.rope.rotary_half against transformers' own Llama RoPE in float64, forward and backward, and megatron's
unfused RoPE routed through it (rlhf.compat.megatron.rotary_half_rope) on the BSHD and packed THD paths."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope

from rlhf.kernels.rope import rotary_half


def _cos_sin(seq: int, dim: int, dtype=torch.float64):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    emb = torch.cat((freqs, freqs), dim=-1)  # (S, D), HF's layout
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
def test_matches_transformers_forward_and_backward(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 3, 7, 16
    q = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    g = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    cos, sin = _cos_sin(s, d)
    # transformers in fp64, the reference: (B, H, S, D) with cos/sin (B, S, D) unsqueezed at dim 1
    ref_q = q.clone().requires_grad_()
    ref, _ = hf_rope(ref_q, ref_q, cos[None].expand(b, s, d), sin[None].expand(b, s, d))
    ref.backward(g)
    mine_q = q.to(dtype).requires_grad_()
    out = rotary_half(mine_q, cos.to(dtype)[None, None], sin.to(dtype)[None, None])
    out.backward(g.to(dtype))
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max() < tol * ref.abs().max()
    assert (mine_q.grad.double() - ref_q.grad).abs().max() < tol * ref_q.grad.abs().max()
    assert (ref - q).abs().max() > 0.5  # the rotation moved it: a no-op would fail above


def test_megatron_unfused_rope_goes_through_it(monkeypatch):
    """megatron's BSHD and THD entry points with the patch equal megatron's own unfused code (RLHF_ROPE_IMPL=
    megatron restores it), partial rotary dims too; and the patch really runs."""
    from megatron.core.models.common.embeddings import rope_utils

    from rlhf.kernels import rope as rope_mod
    from rlhf.compat.megatron import rotary_half_rope

    monkeypatch.setenv("RLHF_ROPE_IMPL", "megatron")
    rotary_half_rope()
    orig = rope_utils._apply_rotary_pos_emb_bshd
    monkeypatch.delenv("RLHF_ROPE_IMPL")
    rotary_half_rope()
    assert rope_utils._apply_rotary_pos_emb_bshd is not orig
    calls = []
    real = rope_mod.RotaryHalf.apply
    monkeypatch.setattr(rope_mod.RotaryHalf, "apply", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(1)
    for rot in (16, 8):  # full and partial rotary dim
        t = torch.randn(9, 2, 3, 16, generator=gen)  # (S, B, H, D)
        freqs = torch.randn(9, 1, 1, rot, generator=gen)
        a, b = (t.clone().requires_grad_() for _ in range(2))
        got = rope_utils._apply_rotary_pos_emb_bshd(a, freqs, mscale=1.3)
        want = orig(b, freqs, mscale=1.3)
        assert torch.equal(got, want)  # bit-identical: the same rounded products and sums
        g = torch.randn(got.shape, generator=gen)
        got.backward(g)
        want.backward(g)
        assert torch.equal(a.grad, b.grad)  # backward too: the two contributions per half summed once
    assert len(calls) == 2
    # interleaved stays megatron's
    t = torch.randn(5, 1, 2, 8, generator=gen)
    freqs = torch.randn(5, 1, 1, 8, generator=gen)
    torch.testing.assert_close(rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=True),
                               orig(t, freqs, rotary_interleaved=True))
    assert len(calls) == 2
    monkeypatch.setenv("RLHF_ROPE_IMPL", "megatron")
    rotary_half_rope()
    assert rope_utils._apply_rotary_pos_emb_bshd is orig
    monkeypatch.setenv("RLHF_ROPE_IMPL", "fused")
    with pytest.raises(ValueError, match="RLHF_ROPE_IMPL"):
        rotary_half_rope()
