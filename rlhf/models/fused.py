"""Fused kernels in megatron's local layer path (``--use_liger_kernel``): what Transformer Engine would otherwise fuse.

Without Transformer Engine, megatron's local spec runs RMSNorm, SwiGLU and RoPE as separate torch ops and SFT's loss
reads the whole ``[tokens, vocab]`` logits. With the fused path on, on CUDA:

* RMSNorm (opt-in, ``DEFAULT_PARTS``): Liger-Kernel's ``LigerRMSNormFunction`` (``liger_kernel/ops/rms_norm.py``;
  casting mode ``llama``, as HF's ``LlamaRMSNorm``), swapped in for every ``torch.nn.RMSNorm`` of the model
  (``fuse_norms``: the module's class changes, its weights and state-dict keys do not); by default torch's own
  fused RMSNorm kernel runs;
* SwiGLU: ``kernels.swiglu_triton`` on megatron's ``[N, 2F]`` fc1 output (``rlhf.compat.megatron.swiglu_function``);
* RoPE: ``kernels.rope_triton``, cos and sin computed in the kernel from megatron's angles, and the packed (THD)
  path's angles gathered by position once per micro-batch instead of per sequence and layer
  (``rlhf.compat.megatron.rotary_half_rope``);
* SFT's LM head fused with its loss (``head_nll_sum``): Liger's ``LigerFusedLinearCrossEntropyFunction``
  (``liger_kernel/ops/fused_linear_cross_entropy.py``, reduction ``sum``, fp32 weight-gradient accumulation) over
  the scored tokens only, at TP 1; ``kernels.fused_linear_logprobs`` (vocab-parallel) at TP > 1. DPO and the RL
  losses already read the hidden states through ``kernels.fused_linear_logprobs``;
* weight gradients (opt-in, ``wgrad``): accumulated into megatron's fp32 ``main_grad`` inside the GEMM
  (``rlhf.compat.main_grad``), instead of written in bf16 and then added by DDP's hook.

On CPU the torch twins run (``kernels.swiglu``, ``kernels.rope``, ``torch.nn.RMSNorm``) and SFT's fused head is
``kernels.fused_linear_logprobs``' torch path. ``--use_liger_kernel`` (OpenRLHF's ``--ds.use_liger_kernel``) turns it
on; by default (``None``) it is on for CUDA without Transformer Engine where liger-kernel imports, off elsewhere;
``--no-use_liger_kernel`` turns it off. The choice is process-wide (every role of a job shares it) and logged once.
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("rlhf")

LIGER_INSTALL = "pip install liger-kernel==0.8.5"
PARTS_ENV = "RLHF_FUSED_PARTS"
"""Which of the fused kernels run when the path is on, comma-separated (default ``DEFAULT_PARTS``); for measuring
each one's share (tests/gpu/gpu_speed.py), the others then run their torch twins."""
PARTS = ("norm", "swiglu", "rope", "head", "wgrad")
DEFAULT_PARTS = ("swiglu", "rope", "head")
"""``wgrad`` is opt-in until a GPU has measured it (``RLHF_FUSED_PARTS=swiglu,rope,head,wgrad``). Liger's RMSNorm is
opt-in (``RLHF_FUSED_PARTS=norm,swiglu,rope,head``): on an H200 (bench/results/gpu_speed_*,
docs/gpus.md) the step with it was slower than with torch's own fused RMSNorm kernel (``torch.nn.RMSNorm``, one
kernel each way) at both shapes measured: 89,969 against 122,890 tokens/s at SmolLM2-135M's (its Python wrapper
costs about 0.4 ms of host time per backward call, and that step is bound by the host), 58,794 against 60,014 at
Llama-3.2-1B's."""


def part_on(name: str) -> bool:
    import os

    return name in _chosen_parts(os.environ.get(PARTS_ENV))


@functools.cache
def _chosen_parts(spec: str | None) -> frozenset:
    """``RLHF_FUSED_PARTS`` parsed once per value (``part_on`` runs at every layer's SwiGLU and RoPE)."""
    if spec is None:
        return frozenset(DEFAULT_PARTS)
    chosen = frozenset(p.strip() for p in spec.split(",") if p.strip())
    if not chosen <= set(PARTS):
        raise ValueError(f"{PARTS_ENV}={spec!r}: expected a comma-separated subset of {', '.join(PARTS)}")
    return chosen
_request: bool | None = None
_resolved: dict[tuple, bool] = {}


def request(value: bool | None) -> None:
    """The job's ``--use_liger_kernel`` (None: the default rule); resolved when a model is built."""
    global _request
    _request = value
    _resolved.clear()


def liger_import_error() -> str | None:
    try:
        import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
        import liger_kernel.ops.rms_norm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import means the kernels are not there
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None


def enabled(device: torch.device | str, use_te: bool = False) -> bool:
    """Whether the fused path runs for models on ``device``. ``--use_liger_kernel`` on CUDA without liger-kernel is a
    ValueError naming the flag; on CPU it selects the torch twins (and SFT's fused head)."""
    device = torch.device(device)
    key = (_request, device.type, use_te)
    if key in _resolved:
        return _resolved[key]
    if device.type != "cuda":
        on, why = bool(_request), "--use_liger_kernel on CPU: the torch twins, SFT's head fused with its loss" \
            if _request else "not CUDA"
    elif use_te:
        on, why = False, "Transformer Engine's layers fuse these"
        if _request:
            log.warning("--use_liger_kernel with Transformer Engine's layer spec: TE's fused layers run, the flag "
                        "changes nothing")
    else:
        err = liger_import_error()
        if _request and err is not None:
            raise ValueError(f"--use_liger_kernel: liger-kernel does not import ({err}). Fix: {LIGER_INSTALL}, or "
                             "--no-use_liger_kernel")
        on = _request is not False and err is None
        why = ("--use_liger_kernel" if _request else "the default on CUDA without Transformer Engine") if on else \
            ("--no-use_liger_kernel" if _request is False else f"liger-kernel does not import ({err})")
    _resolved[key] = on
    log.info("fused kernels on %s: %s (%s)%s", device.type, "on" if on else "off", why,
             f"; {', '.join(p for p in PARTS if part_on(p))} (RLHF_FUSED_PARTS)" if on else "")
    return on


def active_for(t: torch.Tensor, part: str | None = None) -> bool:
    """The CUDA kernels (``part``: one of ``PARTS``) run for this tensor: the fused path is on for its device and it
    is a CUDA tensor."""
    return t.is_cuda and any(on for (_, dev, _), on in _resolved.items() if dev == "cuda") and \
        (part is None or part_on(part))


# ------------------------------------------------------------------------------------------------------ RMSNorm
class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (megatron's ``WrappedTorchNorm``) whose CUDA forward is Liger's RMSNorm kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.is_cuda and self.weight is not None):
            return super().forward(x)
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        shape = x.shape
        y = LigerRMSNormFunction.apply(x.reshape(-1, shape[-1]), self.weight, eps, 0.0, "llama", False)
        return y.view(shape)


def fuse_norms(model: torch.nn.Module) -> int:
    """Every ``torch.nn.RMSNorm`` of ``model`` becomes a ``FusedRMSNorm`` (same parameters); returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.RMSNorm:
            m.__class__ = FusedRMSNorm
            n += 1
    return n


# ------------------------------------------------------------------------------------------------ SFT's head
def head_nll_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, tp_group=None,
                 vocab_size: int | None = None) -> torch.Tensor:
    """``-sum log p(targets)`` of the rows ``hidden`` ``[N, H]`` under the LM head ``weight`` ``[V_local, H]``,
    without the ``[N, V]`` logits in memory; fp32 scalar, differentiable wrt hidden and weight."""
    if hidden.shape[0] == 0:
        return hidden.sum(dtype=torch.float32) * 0.0 + weight.sum(dtype=torch.float32) * 0.0
    if hidden.is_cuda and tp_group is None and active_for(hidden, "head"):
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        # megatron pads the vocabulary: the padded rows are no classes (the logits path masks them)
        w = weight if vocab_size is None else weight[:vocab_size]
        loss = LigerFusedLinearCrossEntropyFunction.apply(
            hidden, w, targets, None, None, -100, 0.0, 0.0, "sum", None, False, torch.float32)
        return (loss[0] if isinstance(loss, tuple) else loss).float()
    import rlhf.kernels as kernels

    return -kernels.fused_linear_logprobs(hidden, weight, targets, tp_group=tp_group, vocab_size=vocab_size).sum()
