"""Causal varlen attention through torch's own FlashAttention-2 kernels (``aten::_flash_attention_forward`` /
``_flash_attention_backward``, the kernels behind ``scaled_dot_product_attention``'s flash backend and
``torch.nn.attention.varlen``), for CUDA fp16/bf16 tensors where the flash-attn package is not installed.

The packed (THD) layout of ``kernels.varlen_attention`` is the layout these kernels take: ``q [T, Hq, D]``,
``k, v [T, Hkv, D]`` with Hq a multiple of Hkv (GQA handled inside the kernel; the backward returns the gradients of
the Hkv heads), ``cu_seqlens [B + 1]`` int32. The public wrapper ``torch.nn.attention.varlen.varlen_attn`` changed
its arguments between torch releases (2.9 took ``is_causal``, 2.13 a ``window_size``), the aten ops did not, so the
autograd function below calls them. ``usable`` runs one small forward and backward on the device once: a torch
built without flash kernels (or a GPU they do not support) makes it False and the next path (Triton) runs, with one
warning (``kernels._select``).
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

logger = logging.getLogger("rlhf.kernels")


class TorchFlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int, scale: float) -> Tensor:
        q, k, v = (x.contiguous() for x in (q, k, v))
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_seqlen, ctx.max_seqlen, 0.0, True, rng, unused,
            scale=ctx.scale)
        return dq, dk, dv, None, None, None


def flash_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                           scale: float) -> Tensor:
    """Causal attention of each packed sequence over itself; ``[T, Hq, D]`` in q's dtype."""
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return TorchFlashVarlen.apply(q, k, v, cu, int(max_seqlen), float(scale))


@functools.cache
def usable(device_index: int) -> bool:
    """Whether the kernels run on this CUDA device: one tiny causal GQA forward and backward, checked against
    plain attention (a build or GPU without them raises; a wrong result would be a silent error)."""
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return False
    try:
        dev = torch.device("cuda", device_index)
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(24, h, 64, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_(True)
                   for h in (4, 2, 2))
        cu = torch.tensor([0, 9, 24], dtype=torch.int32, device=dev)
        out = flash_varlen_attention(q, k, v, cu, 15, 0.125)
        out.float().sum().backward()
        ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[s:e].float().transpose(0, 1), k[s:e].float().repeat_interleave(2, 1).transpose(0, 1),
            v[s:e].float().repeat_interleave(2, 1).transpose(0, 1), is_causal=True, scale=0.125).transpose(0, 1)
            for s, e in ((0, 9), (9, 24))])
        err = (out.float() - ref).abs().max().item()
        ok = err < 3e-2 and k.grad is not None and k.grad.shape == k.shape
        if not ok:
            logger.warning("kernels: torch's flash varlen attention disagrees with plain attention on cuda:%d "
                           "(max error %.3g): not used", device_index, err)
        return ok
    except Exception as e:  # noqa: BLE001 - no flash kernels in this build or for this GPU: the next path
        logger.warning("kernels: torch's flash varlen attention does not run on cuda:%d (%s: %s): not used",
                       device_index, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return False
