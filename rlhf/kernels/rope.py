"""Rotary position embedding (non-interleaved halves, as Llama/Qwen/Mistral use it) as one autograd function.

``out = t * cos + rotate_half(t) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``. The textbook expression (and
megatron-core's unfused ``_apply_rotary_pos_emb_bshd``) builds it from a chunk, a negation, a ``cat``, two
products and a sum, and autograd replays each of them backward. ``rotary_half`` computes each half of the output
straight into its place (no ``cat``), and its backward is the transposed rotation, ``grad_t = g * cos +
rotate_half^T(g * sin)``, with ``rotate_half^T([y1, y2]) = [y2, -y1]``; it saves only cos and sin. It rounds
exactly as megatron's expression does, so both directions are bit-identical to it (asserted in the test, which
also compares it with transformers' own ``apply_rotary_pos_emb`` in float64).
"""
from __future__ import annotations

import torch
from torch import Tensor


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, transpose: bool) -> Tensor:
    """``x * cos + R(x) * sin`` (``R = rotate_half``, or its transpose), written half by half into a new tensor."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    c1, c2, s1, s2 = cos[..., :h], cos[..., h:], sin[..., :h], sin[..., h:]
    out = torch.empty(torch.broadcast_shapes(x.shape, cos.shape), dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :h], out[..., h:]
    # forward: [x1 c1 - x2 s1, x2 c2 + x1 s2]; transposed: [x1 c1 + x2 s2, x2 c2 - x1 s1]. Each product is
    # rounded before the sum (no fused multiply-add), as in transformers' and megatron's own expression, so the
    # result is bit-identical to theirs.
    if not transpose:
        torch.mul(x1, c1, out=o1).sub_(x2 * s1)
        torch.mul(x2, c2, out=o2).add_(x1 * s2)
    else:
        torch.mul(x1, c1, out=o1).add_(x2 * s2)
        torch.mul(x2, c2, out=o2).sub_(x1 * s1)
    return out


class RotaryHalf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin, transpose=False)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, transpose=True), None, None


def rotary_half(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE of ``t`` (``[..., D]``, D even) with ``cos``/``sin`` broadcastable to it (``[..., D]``, constants:
    no gradient flows to them). Differentiable wrt ``t``."""
    if t.shape[-1] % 2 or cos.shape[-1] != t.shape[-1] or sin.shape != cos.shape:
        raise ValueError(f"rotary_half: t {tuple(t.shape)} needs an even last dim equal to cos/sin's "
                         f"{tuple(cos.shape)}/{tuple(sin.shape)}")
    return RotaryHalf.apply(t, cos.detach(), sin.detach())
