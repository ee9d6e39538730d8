"""Weight gradients straight into megatron's fp32 ``main_grad``, inside the GEMM.

megatron's DDP gives each trained weight an fp32 ``main_grad``. Its linear layers' backward returns a weight
gradient in the weight's dtype (bf16 under ``--bf16``), which DDP's hook then adds into ``main_grad``: one more pass
over every weight per micro-batch, and the gradient rounded to bf16 first. megatron's ``gradient_accumulation_fusion``
does the add inside the GEMM, but only with apex's ``fused_weight_gradient_mlp_cuda``, which is not installed here.
``MainGradLinear`` does it with torch: ``main_grad.addmm_(g.T, x)`` in fp32 and, for bf16 on CUDA, ``torch.addmm(
main_grad, g.T, x, out_dtype=torch.float32, out=main_grad)`` (cuBLAS: bf16 operands, fp32 accumulation and output,
beta 1): the bf16 weight gradient is never written nor rounded. Forward and input gradient are megatron's own
products (``torch.matmul``).

On CPU ``rlhf.compat.onednn`` routes to it. On CUDA the fused path's part ``wgrad`` (``RLHF_FUSED_PARTS``; opt-in
until measured on a GPU) routes every trained local linear layer whose call needs no communication inside the layer
(TP 1, or a row-parallel layer; no sequence parallelism) to it (``use_main_grad_linears``), once torch's op has been
checked on the device against an fp64 product. Where that check fails (torch releases whose ``out_dtype`` form wants
``self`` in the operands' dtype), megatron's own path stays, logged once.
"""
from __future__ import annotations

import logging
import types

import torch

log = logging.getLogger(__name__)
_checked: dict[str, bool] = {}
COMM_ARGS = ("bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel", "grad_output_buffer")
"""megatron-core 0.16.1's ``_forward_impl(input, weight, *args)`` positional arguments after the weight."""


class MainGradLinear(torch.autograd.Function):
    """megatron's linear (``torch.matmul``), its weight gradient accumulated straight into the weight's ``main_grad``
    (``into_main_grad``) instead of a fresh gradient that DDP's hook then adds there."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        y = torch.matmul(x, w.t())
        return y + b if b is not None else y

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, w = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = gy.matmul(w)
        g2 = gy.reshape(-1, gy.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            gw = into_main_grad(w, g2, x2)
            if gw is None:
                gw = g2.t().matmul(x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def main_grad(w: torch.Tensor) -> torch.Tensor | None:
    """The fp32 gradient buffer megatron's DDP gave a trained ``w`` (its hook skips its own add once
    ``grad_added_to_main_grad`` is set, until the next ``zero_grad_buffer``), else None."""
    mg = getattr(w, "main_grad", None)
    if mg is None or not hasattr(w, "grad_added_to_main_grad") or mg.dtype != torch.float32 or mg.shape != w.shape:
        return None
    return mg


def accumulate(mg: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor) -> None:
    """``mg += g2.T @ x2`` in fp32: ``addmm_`` for fp32 operands, the fp32-output GEMM for bf16/fp16 ones (CUDA)."""
    if g2.dtype == torch.float32:
        mg.addmm_(g2.t(), x2)
    else:
        torch.addmm(mg, g2.t(), x2, out_dtype=torch.float32, out=mg)


def into_main_grad(w: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor | None:
    """``main_grad += g2.T @ x2`` (fp32) when ``w`` has one; returns the placeholder gradient autograd hands on
    (uninitialized, as megatron's fused path returns), or None where ``w`` has no ``main_grad``."""
    mg = main_grad(w)
    if mg is None:
        return None
    accumulate(mg, g2, x2)
    w.grad_added_to_main_grad = True
    # megatron-core 0.16.1 marks an LM head tied to the embedding on the same stage zero_out_wgrad: the lookup's
    # gradient reaches .grad through autograd, summed with this placeholder, and DDP's hook adds that sum to
    # main_grad. An uninitialized placeholder there gave tied bf16 models NaN grad norms; megatron's own is zeros.
    if getattr(w, "zero_out_wgrad", False):
        return torch.zeros(w.shape, dtype=w.dtype, device=w.device)
    return torch.empty(w.shape, dtype=w.dtype, device=w.device)


def needs_no_comm(got: dict) -> bool:
    """A layer call (``COMM_ARGS`` by name) that needs no communication inside the layer nor megatron's own fused
    accumulation."""
    return not (got.get("allreduce_dgrad") or got.get("sequence_parallel") or got.get("gradient_accumulation_fusion")
                or got.get("grad_output_buffer") is not None)


def bf16_accumulation_works(device: torch.device | str) -> bool:
    """Whether ``accumulate`` runs for bf16 operands on ``device`` and agrees with an fp64 product (checked once per
    device type; a failure is logged once, naming the fallback)."""
    device = torch.device(device)
    if device.type not in _checked:
        ok, why = False, ""
        try:
            gen = torch.Generator().manual_seed(0)
            mg, g, x = (torch.randn(*s, generator=gen) for s in ((29, 64), (37, 29), (37, 64)))
            g, x = g.bfloat16(), x.bfloat16()
            want = mg.double() + g.double().t() @ x.double()
            got = mg.to(device)
            accumulate(got, g.to(device), x.to(device))
            # fp32 sums of 37 exact bf16 x bf16 products of size ~1: off by ~1e-6; a bf16 rounding would be ~1e-2
            err = (got.double().cpu() - want).abs().max().item()
            ok, why = err < 1e-4, f"it is off by {err:.3g}"
        except (RuntimeError, NotImplementedError, TypeError) as e:
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if not ok:
            log.warning("fused part wgrad on %s: torch's fp32-output bf16 GEMM into main_grad is not usable (%s); "
                        "megatron's own weight gradient runs, added into main_grad by DDP", device.type, why)
        _checked[device.type] = ok
    return _checked[device.type]


def _cuda_forward_impl(self, input, weight, *args, **kwargs):
    """A CUDA layer's ``_forward_impl``: ``MainGradLinear`` for a trained weight where the call needs no
    communication inside the layer, else megatron's own, called exactly as given."""
    got = {**dict(zip(COMM_ARGS, args)), **kwargs}
    if needs_no_comm(got) and input.dtype == weight.dtype and main_grad(weight) is not None:
        return MainGradLinear.apply(input, weight, got.get("bias"))
    return type(self)._forward_impl(self, input, weight, *args, **kwargs)


def use_main_grad_linears(model: torch.nn.Module, device: torch.device | str) -> int:
    """Route ``model``'s megatron linear layers on ``device`` through ``MainGradLinear`` where their weight gets a
    ``main_grad``, if ``bf16_accumulation_works(device)``; returns how many layers were given the routing (0 when
    the check failed)."""
    if not bf16_accumulation_works(device):
        return 0
    return route_linears(model, _cuda_forward_impl)


def route_linears(model: torch.nn.Module, forward_impl) -> int:
    """Give every megatron ``ColumnParallelLinear`` / ``RowParallelLinear`` of ``model`` ``forward_impl`` as its
    ``_forward_impl`` (called as ``forward_impl(layer, input, weight, *args, **kwargs)``); returns how many."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    n = 0
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m._forward_impl = types.MethodType(forward_impl, m)
            n += 1
    return n
