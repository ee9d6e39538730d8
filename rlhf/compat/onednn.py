"""megatron-core 0.16.1's linear layers on CPU in fp32: oneDNN's GEMM instead of torch's default BLAS (MKL).

megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` multiply with ``torch.matmul``, which for fp32 on CPU
is MKL's ``sgemm``. On AMD CPUs MKL dispatches to a generic kernel; oneDNN picks its kernel by instruction set.
Measured on the AMD EPYC (Zen 5, AVX-512) of our CI machines, one thread: 100-108 GFLOP/s with MKL against
177-258 GFLOP/s with oneDNN for the matmuls of the bench models (``tools/bench_cpu_update.py`` prints both).

``use_onednn_linears(model)`` gives each such layer of ``model`` a ``_forward_impl`` that runs
``OneDNNLinear`` (forward and both backward GEMMs through ``torch.ops.mkldnn._linear_pointwise``) when the call
needs no tensor-parallel communication inside the layer (TP1, or a row-parallel layer, whose reduce is outside),
no sequence parallelism, no fused gradient accumulation and fp32 CPU tensors; every other call goes to megatron's
own function, unchanged.

Which GEMM is faster depends on the CPU, so ``RLHF_CPU_LINEAR`` picks: ``auto`` (the default) takes oneDNN on
every CPU but Intel's and torch's default (MKL) on Intel's, where MKL has its own kernels: on a 2-core Intel Xeon
(AVX-512), MKL ran the 25M bench model's products at 121 GFLOP/s on one thread and 223 on two, oneDNN at 98 and
168. The choice is by vendor, not by timing at start-up, so that a resumed run multiplies with the same kernel
(bit-exact resume). ``onednn`` and ``torch`` force either. Before the first use, a small product is checked
against torch's; if oneDNN's op is missing or disagrees, the layers stay as they are and that is logged once.
"""
from __future__ import annotations

import logging
import os
import types
from typing import Any

import torch

log = logging.getLogger(__name__)
_state: dict[str, Any] = {}


def _gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w.T`` (a: [m, k], w: [n, k], fp32 on CPU, any 2-D strides) by oneDNN, which rejects empty operands
    (an MoE expert that got no tokens: m = 0, or k = 0 in its weight gradient); those are zeros."""
    if a.numel() == 0 or w.numel() == 0:
        return a.new_zeros(a.shape[0], w.shape[0])
    return torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")


class OneDNNLinear(torch.autograd.Function):
    """``y = x @ w.T (+ b)`` over the last dim of ``x``; the backward's two GEMMs by oneDNN as well."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        ctx.save_for_backward(x2, w)
        ctx.x_shape, ctx.has_bias = x.shape, b is not None
        y = _gemm(x2, w.contiguous())
        if b is not None:
            y = y + b
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x2, w = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1]).contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:  # transposed views, no copies: oneDNN takes strides (and is faster so)
            gx = _gemm(g2, w.t()).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            gw = _gemm(g2.t(), x2.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def onednn_linear_works() -> bool:
    """Whether oneDNN's fp32 GEMM is there and agrees with torch's on a small product (checked once)."""
    if "ok" not in _state:
        ok, why = False, ""
        try:
            gen = torch.Generator().manual_seed(0)
            a, w, g = (torch.randn(*s, generator=gen) for s in ((37, 64), (29, 64), (37, 29)))
            # the three forms OneDNNLinear uses: a @ w.T, g @ w (strided w.T), g.T @ a (both strided)
            got = (_gemm(a, w), _gemm(g, w.t()), _gemm(g.t(), a.t()))
            want = (a.double() @ w.double().T, g.double() @ w.double(), g.double().T @ a.double())
            err = max((x.double() - y).abs().max().item() for x, y in zip(got, want))
            ok, why = err < 1e-4, f"its products are off by up to {err:.3g}"
        except (AttributeError, RuntimeError) as e:
            why = f"{type(e).__name__}: {e}"
        if not ok:
            log.warning("fp32 linear layers on CPU: oneDNN's GEMM is not usable (%s); using torch's default",
                        str(why).splitlines()[0][:200])
        _state["ok"] = ok
    return _state["ok"]


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...) from /proc/cpuinfo, or "" elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


_ARGS = ("bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel", "grad_output_buffer")


def _forward_impl(self, input, weight, *args, **kwargs):
    """A layer's ``_forward_impl``: ``OneDNNLinear`` where it applies, else megatron's, called exactly as given."""
    got = {**dict(zip(_ARGS, args)), **kwargs}
    if (got.get("allreduce_dgrad") or got.get("sequence_parallel") or got.get("gradient_accumulation_fusion")
            or got.get("grad_output_buffer") is not None or input.device.type != "cpu"
            or input.dtype != torch.float32 or weight.dtype != torch.float32):
        return type(self)._forward_impl(self, input, weight, *args, **kwargs)
    return OneDNNLinear.apply(input, weight, got.get("bias"))


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Route ``model``'s megatron linear layers through ``OneDNNLinear`` where it applies (see the module's
    docstring). Returns how many layers were given it (0 when turned off or unusable)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    choice = os.environ.get("RLHF_CPU_LINEAR", "auto")
    if choice not in ("auto", "onednn", "torch"):
        raise ValueError(f"RLHF_CPU_LINEAR must be 'auto', 'onednn' or 'torch', got {choice!r}")
    if choice == "auto":
        vendor = cpu_vendor()
        choice = "torch" if vendor == "GenuineIntel" else "onednn"
        if choice == "torch" and not _state.get("announced"):
            _state["announced"] = True
            log.info("fp32 linear layers on CPU: torch's default GEMM (MKL), the faster one on %s CPUs "
                     "(RLHF_CPU_LINEAR=onednn for oneDNN's)", vendor)
    if choice == "torch" or not onednn_linear_works():
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m._forward_impl = types.MethodType(_forward_impl, m)
            n += 1
    if n and not _state.get("announced"):
        _state["announced"] = True
        log.info("fp32 linear layers on CPU: oneDNN's GEMM (RLHF_CPU_LINEAR=torch for torch's default)")
    return n
