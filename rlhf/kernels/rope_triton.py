"""RoPE (``kernels.rope.rotary_half``'s op, non-interleaved halves) as one Triton kernel each way, taking megatron's
angles directly.

``t`` is ``[S, B, H, D]`` (any strides with a unit last one: megatron's query and key are views of the fused QKV
output), ``freqs`` ``[S, 1, 1, D]`` the angles megatron builds (fp32); cos and sin are computed in the kernel in fp32
(times ``mscale``), the rotation in fp32, the result rounded once to t's dtype. The torch twin rounds cos, sin and
each product to t's dtype as megatron's expression does, so in bf16 the two differ by rounding only (the tests
bound it against an fp64 reference). One program per (position, row) and block of heads; the backward applies the
transposed rotation (``[x1 c1 + x2 s2, x2 c2 - x1 s1]``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rope_kernel(x_ptr, f_ptr, o_ptr, B, H, sxs, sxb, sxh, sf, mscale, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr, TRANSPOSE: tl.constexpr):
    sb = tl.program_id(0).to(tl.int64)
    s = sb // B
    b = sb % B
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dm = d < HALF
    mask = (h < H) & dm
    f1 = tl.load(f_ptr + s * sf + d, mask=dm, other=0.0).to(tl.float32)
    f2 = tl.load(f_ptr + s * sf + HALF + d, mask=dm, other=0.0).to(tl.float32)
    c1, s1 = tl.cos(f1) * mscale, tl.sin(f1) * mscale
    c2, s2 = tl.cos(f2) * mscale, tl.sin(f2) * mscale
    x = x_ptr + s * sxs + b * sxb + h * sxh
    x1 = tl.load(x + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF + d, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSE:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    o = o_ptr + (sb * H + h) * (2 * HALF)
    tl.store(o + d, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o + HALF + d, o2.to(o_ptr.dtype.element_ty), mask=mask)


def _apply(x: Tensor, freqs: Tensor, mscale: float, transpose: bool) -> Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    s, b, h, d = x.shape
    out = torch.empty((s, b, h, d), dtype=x.dtype, device=x.device)
    f = freqs.reshape(freqs.shape[0], d)
    if f.stride(-1) != 1:
        f = f.contiguous()
    block_h = min(16, triton.next_power_of_2(h))
    if s * b:
        _rope_kernel[(s * b, triton.cdiv(h, block_h))](x, f, out, b, h, x.stride(0), x.stride(1), x.stride(2),
                                                       f.stride(0), float(mscale), HALF=d // 2, BLOCK_H=block_h,
                                                       BLOCK_D=triton.next_power_of_2(d // 2), TRANSPOSE=transpose)
    return out


class RopeTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, freqs: Tensor, mscale: float) -> Tensor:
        ctx.save_for_backward(freqs)
        ctx.mscale = mscale
        return _apply(t, freqs, mscale, transpose=False)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (freqs,) = ctx.saved_tensors
        return _apply(grad, freqs, ctx.mscale, transpose=True), None, None


def rope_triton(t: Tensor, freqs: Tensor, mscale: float = 1.0) -> Tensor:
    """RoPE of ``t`` ``[S, B, H, D]`` by the angles ``freqs`` ``[S, 1, 1, D]`` (no gradient to them)."""
    if t.dim() != 4 or t.shape[-1] % 2 or freqs.shape[-1] != t.shape[-1] or freqs.shape[0] != t.shape[0] \
            or freqs[0].numel() != t.shape[-1]:
        raise ValueError(f"rope_triton: t {tuple(t.shape)} needs [S, B, H, D] with D even and freqs "
                         f"{tuple(freqs.shape)} [S, 1, 1, D]")
    return RopeTriton.apply(t, freqs.detach(), float(mscale))


AOT_SPECS = {  # tests/kernels/triton_aot_cases.py compiles it for sm_90
    f"rope_{'transposed' if tr else 'forward'}": dict(
        fn=_rope_kernel,
        signature={"x_ptr": "*bf16", "f_ptr": "*fp32", "o_ptr": "*bf16", "B": "i32", "H": "i32", "sxs": "i64",
                   "sxb": "i64", "sxh": "i64", "sf": "i64", "mscale": "fp32", "HALF": "constexpr",
                   "BLOCK_H": "constexpr", "BLOCK_D": "constexpr", "TRANSPOSE": "constexpr"},
        constexprs={"HALF": 32, "BLOCK_H": 16, "BLOCK_D": 32, "TRANSPOSE": tr}, num_warps=4)
    for tr in (False, True)
}
