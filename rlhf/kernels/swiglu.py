"""SwiGLU, ``silu(a) * b`` over ``y = [a | b]`` (the last dim halved), as one autograd function.

megatron's unfused MLP activation (``mlp.py``'s ``glu``) computes ``silu(a) * (b + glu_linear_offset)``: with the
offset at 0.0 that is a full pass over ``b`` for nothing, and its backward joins the two halves' gradients with a
``cat`` (``chunk``'s backward), a second copy of the whole ``[N, 2F]`` gradient. ``swiglu`` keeps the same
arithmetic, so the same bits forward and backward in fp32 and bf16 (asserted in the tests), without either pass:
the forward multiplies ``silu(a)`` by ``b`` in place, and the backward writes both halves' gradients straight into
one ``[N, 2F]`` tensor. It saves only ``y`` (the unfused form saves ``a``, ``silu(a)`` and ``b + 0``) and recomputes
``silu(a)`` in the backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor) -> Tensor:
        a, b = y.chunk(2, dim=-1)
        ctx.save_for_backward(y)
        return F.silu(a).mul_(b)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        a, b = y.chunk(2, dim=-1)
        gy = torch.empty_like(y)
        ga, gb = gy.chunk(2, dim=-1)  # views: each half's gradient is written in place
        torch.mul(g, F.silu(a), out=gb)
        torch.ops.aten.silu_backward.grad_input(g * b, a, grad_input=ga)
        return gy


def swiglu(y: Tensor) -> Tensor:
    """``silu(y[..., :F]) * y[..., F:]`` for ``y`` of last dim ``2F``; differentiable."""
    if y.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dim, got {tuple(y.shape)}")
    return SwiGLUFunction.apply(y)
