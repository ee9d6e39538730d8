"""SwiGLU (``kernels.swiglu``'s op) as one Triton kernel each way, on the ``[N, 2F]`` layout megatron's ``linear_fc1``
writes (``[a | b]`` along the last dim).

Forward: ``silu(a) * b`` in fp32, rounded once to the input's dtype. Backward: ``ga = g * b * silu'(a)``,
``gb = g * silu(a)``, both written into one ``[N, 2F]`` gradient; it saves only the input and recomputes ``silu(a)``,
as the torch twin does. Liger-Kernel's ``LigerSiLUMulFunction`` takes ``a`` and ``b`` as two tensors and views them
as ``[-1, F]``, which the two halves of one ``[N, 2F]`` tensor (strided views) are not: a copy each way; this kernel
reads the halves in place. Each program handles one row; the row is read in ``BLOCK`` columns at a time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _swiglu_fwd_kernel(y_ptr, out_ptr, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK
    cols = col0 + tl.arange(0, BLOCK)
    mask = cols < F
    a = tl.load(y_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(y_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    tl.store(out_ptr + row * F + cols, (a * sig * b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(g_ptr, y_ptr, gy_ptr, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(g_ptr + row * F + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(y_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(y_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    silu = a * sig
    ga = g * b * (sig + silu * (1.0 - sig))  # d silu / da = sig * (1 + a * (1 - sig))
    tl.store(gy_ptr + row * 2 * F + cols, ga.to(gy_ptr.dtype.element_ty), mask=mask)
    tl.store(gy_ptr + row * 2 * F + F + cols, (g * silu).to(gy_ptr.dtype.element_ty), mask=mask)


def _block(f: int) -> int:
    return min(1024, triton.next_power_of_2(f))


class SwiGLUTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor) -> Tensor:
        y = y.contiguous()
        f = y.shape[-1] // 2
        rows = y.numel() // (2 * f)
        out = torch.empty(*y.shape[:-1], f, dtype=y.dtype, device=y.device)
        if rows:
            _swiglu_fwd_kernel[(rows, triton.cdiv(f, _block(f)))](y, out, f, BLOCK=_block(f))
        ctx.save_for_backward(y)
        return out

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        g = g.contiguous()
        f = y.shape[-1] // 2
        rows = y.numel() // (2 * f)
        gy = torch.empty_like(y)
        if rows:
            _swiglu_bwd_kernel[(rows, triton.cdiv(f, _block(f)))](g, y, gy, f, BLOCK=_block(f))
        return gy


def swiglu_triton(y: Tensor) -> Tensor:
    """``silu(y[..., :F]) * y[..., F:]`` for ``y`` of last dim ``2F``; differentiable."""
    if y.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dim, got {tuple(y.shape)}")
    return SwiGLUTriton.apply(y)


AOT_SPECS = {  # tests/kernels/triton_aot_cases.py compiles each for sm_90
    "swiglu_fwd": dict(fn=_swiglu_fwd_kernel, signature={"y_ptr": "*bf16", "out_ptr": "*bf16", "F": "i32",
                                                          "BLOCK": "constexpr"}, constexprs={"BLOCK": 1024},
                       num_warps=4),
    "swiglu_bwd": dict(fn=_swiglu_bwd_kernel, signature={"g_ptr": "*bf16", "y_ptr": "*bf16", "gy_ptr": "*bf16",
                                                          "F": "i32", "BLOCK": "constexpr"},
                       constexprs={"BLOCK": 1024}, num_warps=4),
}
