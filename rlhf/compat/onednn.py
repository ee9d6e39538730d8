"""megatron-core 0.16.1's linear layers on CPU: the faster GEMM of this CPU, in fp32 and in bf16.

megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` multiply with ``torch.matmul``, which for fp32 on CPU
is MKL's ``sgemm``. On AMD CPUs MKL dispatches to a generic kernel; oneDNN picks its kernel by instruction set.
Measured on the AMD EPYC (Zen 5, AVX-512) of our CI machines, one thread: 100-108 GFLOP/s with MKL against
177-258 GFLOP/s with oneDNN for the matmuls of the bench models (``bench/cpu_update.py`` prints both).

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

bf16 (``--bf16``): a bf16 GEMM is fast only where the CPU multiplies bf16 natively at more than fp32's rate.
On the Zen 5 EPYC bf16 peaked near 870 GFLOP/s against ~200 for fp32 (one thread); on the 2-core Intel Xeon
above (AVX-512 with AVX512_BF16, no AMX) oneDNN's native bf16 kernel ran the 25M model's products at 170-180
GFLOP/s on two threads against MKL's fp32 at 285-320, so a ``--bf16`` PPO step was 1.6x slower than fp32.
``RLHF_CPU_BF16_GEMM=auto`` (the default) keeps bf16's own kernel with AMX, or on AMD with AVX512_BF16, and
elsewhere runs ``Fp32GemmLinear``: the bf16 operands converted to fp32 (exactly) and multiplied by the fp32
GEMM, which also accumulates in fp32 and rounds the result to bf16 once, as the bf16 kernel does; only the
summation order differs. ``bf16`` / ``fp32`` force either. The same choice goes to the torch paths of the
packed attention and of the LM head's fused log-probs (``kernels.set_cpu_bf16_in_fp32``): torch's bf16 SDPA,
forward + backward, was 4x slower than fp32's on that Xeon.

Weight gradients of trained layers (megatron's DDP gives each weight an fp32 ``main_grad``) go straight into
``main_grad`` by one ``addmm_`` in ``MainGradLinear`` (fp32 on torch's GEMM) and ``Fp32GemmLinear`` (bf16, then
unrounded), as megatron's ``gradient_accumulation_fusion`` does on CUDA, instead of a fresh gradient that DDP's
hook adds there: SmolLM2's actor update of one 683-token micro-batch went from 3.08-3.29 to 2.95-3.01 s.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

import rlhf.kernels as kernels
from rlhf.compat.main_grad import (COMM_ARGS, MainGradLinear, into_main_grad, main_grad, needs_no_comm,
                                   route_linears)

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


def _cpuinfo_field(name: str) -> str:
    """The first ``name : value`` line's value in /proc/cpuinfo, or "" (no such line, or no /proc)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...), or "" off Linux."""
    return _cpuinfo_field("vendor_id")


class Fp32GemmLinear(torch.autograd.Function):
    """``y = x @ w.T (+ b)`` for bf16 ``x``/``w``, multiplied by the fp32 GEMM: the bf16 operands convert to fp32
    exactly and the products accumulate in fp32, as a bf16 GEMM does too; outputs and grads round to bf16 once.
    A trained weight's gradient goes straight into its fp32 ``main_grad`` (``rlhf.compat.main_grad.into_main_grad``), unrounded."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, w)
        ctx.x_shape, ctx.has_bias = x.shape, b is not None
        y = x2.float() @ w.float().t()  # (N, out)
        if b is not None:
            y += b.float()
        return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x2, w = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1]).float()  # (N, out)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g2 @ w.float()).to(x2.dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            gw = into_main_grad(w, g2, x2.float())
            if gw is None:
                gw = (g2.t() @ x2.float()).to(w.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0).to(w.dtype)
        return gx, gw, gb


def _forward_impl(self, input, weight, *args, **kwargs):
    """A layer's ``_forward_impl``: ``OneDNNLinear`` (fp32) or ``Fp32GemmLinear`` (bf16) where chosen and the call
    needs no communication inside the layer, ``MainGradLinear`` for such an fp32 call on torch's GEMM whose weight
    has a ``main_grad``, else megatron's own, called exactly as given."""
    got = {**dict(zip(COMM_ARGS, args)), **kwargs}
    plain = needs_no_comm(got) and input.device.type == "cpu"
    if plain and input.dtype == weight.dtype == torch.float32 and _state.get("fp32") == "onednn":
        return OneDNNLinear.apply(input, weight, got.get("bias"))
    if plain and input.dtype == weight.dtype == torch.bfloat16 and _state.get("bf16") == "fp32":
        return Fp32GemmLinear.apply(input, weight, got.get("bias"))
    if plain and input.dtype == weight.dtype == torch.float32 and main_grad(weight) is not None:
        return MainGradLinear.apply(input, weight, got.get("bias"))
    return type(self)._forward_impl(self, input, weight, *args, **kwargs)


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``avx512_bf16``, ``amx_bf16``, ...), empty off Linux."""
    return set(_cpuinfo_field("flags").split())


def choose_cpu_gemms() -> tuple[str, str]:
    """``(fp32 GEMM, bf16 GEMM)`` for the CPU linear layers, by ``RLHF_CPU_LINEAR`` / ``RLHF_CPU_BF16_GEMM`` or,
    when ``auto``, by the CPU (see the module's docstring): fp32 in ``onednn`` or ``torch``; bf16 in ``bf16``
    (its own kernel) or ``fp32`` (bf16 operands multiplied by the fp32 kernel)."""
    fp32 = os.environ.get("RLHF_CPU_LINEAR", "auto")
    if fp32 not in ("auto", "onednn", "torch"):
        raise ValueError(f"RLHF_CPU_LINEAR must be 'auto', 'onednn' or 'torch', got {fp32!r}")
    bf16 = os.environ.get("RLHF_CPU_BF16_GEMM", "auto")
    if bf16 not in ("auto", "bf16", "fp32"):
        raise ValueError(f"RLHF_CPU_BF16_GEMM must be 'auto', 'bf16' or 'fp32', got {bf16!r}")
    vendor = cpu_vendor() if "auto" in (fp32, bf16) else ""
    if fp32 == "auto":
        fp32 = "torch" if vendor == "GenuineIntel" else "onednn"
    if bf16 == "auto":
        flags = cpu_flags()
        fast = "amx_bf16" in flags or (vendor == "AuthenticAMD" and "avx512_bf16" in flags)
        bf16 = "bf16" if fast else "fp32"
    return fp32, bf16


ONEDNN_CACHE_CAPACITY = 64
"""Entries kept by each of oneDNN's two shape-keyed caches (``bound_onednn_caches``)."""
_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches() -> dict[str, str]:
    """Bound the caches behind torch's oneDNN ops (our fp32 linears, torch's bf16 matmul, vLLM's CPU GEMMs) to
    ``ONEDNN_CACHE_CAPACITY`` entries each, unless the environment already sets them. oneDNN's primitive cache
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's computation cache (``LRU_CACHE_CAPACITY``) keep 1024 entries
    by default, one per GEMM *shape*, each with its JIT kernel and scratchpad (about 1 MB at the bench models'
    widths). Packed micro-batches give new token counts, so new shapes, every step: a 4M PPO run's resident memory
    grew by 25-30 MB a step (8 steps: 0.97 -> 1.17 GB; with torch's GEMM 0.97 -> 1.01 GB), and 1,000 distinct
    shapes of one GEMM held 1.1-1.7 GB against 0.24 GB for one shape. One pass over a micro-batch uses about a
    dozen shapes (4 linears, forward and two backward GEMMs), so 64 entries keep the reuse. Both are read at the
    first oneDNN call of the process: call this before any (the launchers' ``cli_main`` does). Returns what it set."""
    set_now = {}
    for var in _CACHE_VARS:
        if var not in os.environ:
            os.environ[var] = set_now[var] = str(ONEDNN_CACHE_CAPACITY)
    return set_now


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Route ``model``'s megatron linear layers through ``OneDNNLinear`` (fp32) and ``Fp32GemmLinear`` (bf16)
    where ``choose_cpu_gemms`` asks for them (see the module's docstring), and trained fp32 weights on torch's
    GEMM through ``MainGradLinear``. Returns how many layers were given the routing."""
    fp32, bf16 = choose_cpu_gemms()
    bound_onednn_caches()  # no effect where oneDNN already ran: cli_main calls it first
    if fp32 == "onednn" and not onednn_linear_works():
        fp32 = "torch"
    _state["fp32"], _state["bf16"] = fp32, bf16
    kernels.set_cpu_bf16_in_fp32(bf16 == "fp32")  # attention and the LM head's log-probs follow the linears
    if not _state.get("announced"):
        _state["announced"] = True
        log.info("linear layers on CPU: fp32 by %s, bf16 by %s (RLHF_CPU_LINEAR=onednn|torch, "
                 "RLHF_CPU_BF16_GEMM=bf16|fp32 to choose); oneDNN's shape caches hold %s / %s entries "
                 "(ONEDNN_PRIMITIVE_CACHE_CAPACITY / LRU_CACHE_CAPACITY)", "oneDNN's GEMM" if fp32 == "onednn" else
                 "torch's default GEMM (MKL)",
                 "its own bf16 GEMM" if bf16 == "bf16" else "the fp32 GEMM (attention and log-probs too)",
                 *(os.environ[v] for v in _CACHE_VARS))
    return route_linears(model, _forward_impl)
