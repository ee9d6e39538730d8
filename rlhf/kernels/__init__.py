"""Fused kernels for RLHF training: token log-probs / entropy, packing, varlen attention.

Layering (as in Liger-Kernel): `kernels.reference` is the pure-torch source of truth, `rlhf/kernels/*_triton.py`
hold the Triton kernels, and this module dispatches between them.

Dispatch, per call, from the first tensor argument:
  - `RLHF_KERNELS_FORCE_TORCH=1`: the torch path, always.
  - `RLHF_KERNELS_FORCE_TRITON=1`: the Triton path, even on CPU (run with `TRITON_INTERPRET=1` there).
  - otherwise Triton for CUDA tensors when triton is importable, torch on CPU.
  - `varlen_attention` on CUDA prefers flash-attn, then torch's own flash kernels (`kernels.attention_flash`),
    then transformer-engine, then Triton. Its torch path batches
    sequences of similar lengths into one padded SDPA call (`kernels.attention_torch`), else loops over them
    (`RLHF_VARLEN_ATTENTION_LOOP=1`: always loop).
  - `set_cpu_bf16_in_fp32(True)`: the torch paths of `varlen_attention` and `fused_linear_logprobs` compute
    bf16 CPU tensors in fp32 (inputs converted exactly, outputs rounded to bf16 once), for CPUs whose bf16
    products are slower than fp32's (`rlhf.compat.onednn` decides, with its linear layers).
Each (op, path) pair is logged once. Importing `kernels` never imports triton; the Triton modules are
imported on first use.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.kernels.logprobs import (
    TORCH_OPS,
    FusedLinearLogprobsFunction,
    LogprobOps,
    TokenLogprobsFunction,
    default_chunk_rows,
    fused_chunk_rows,
)
from rlhf.kernels.packing import (
    PackedBatch,
    balance_microbatches,
    cu_seqlens_from_lengths,
    pack_padded,
    pack_sequences,
    packed_next_tokens,
    position_ids_from_cu_seqlens,
    unpack_padded,
    unpack_sequences,
)
from rlhf.kernels.attention_torch import padding_pays, varlen_attention_padded
from rlhf.kernels.reference import varlen_attention_reference

__all__ = [
    "PackedBatch",
    "balance_microbatches",
    "cu_seqlens_from_lengths",
    "fused_linear_logprobs",
    "pack_padded",
    "pack_sequences",
    "packed_next_tokens",
    "position_ids_from_cu_seqlens",
    "set_cpu_bf16_in_fp32",
    "token_logprobs",
    "unpack_padded",
    "unpack_sequences",
    "varlen_attention",
]

logger = logging.getLogger(__name__)

FORCE_TORCH_ENV = "RLHF_KERNELS_FORCE_TORCH"
FORCE_TRITON_ENV = "RLHF_KERNELS_FORCE_TRITON"
VARLEN_LOOP_ENV = "RLHF_VARLEN_ATTENTION_LOOP"
"""``1``: the torch path of ``varlen_attention`` always loops over the sequences (no padded batch)."""
_logged: set[tuple[str, str]] = set()
_cpu_bf16_in_fp32 = {"on": False}


def set_cpu_bf16_in_fp32(on: bool) -> None:
    """Whether the torch paths of ``varlen_attention`` and ``fused_linear_logprobs`` compute bf16 CPU tensors in
    fp32. On a CPU without AMX, torch's bf16 kernels are the slow ones: measured on a 2-core Intel Xeon
    (AVX512_BF16, no AMX), SDPA forward + backward of 16 sequences of 35-50 tokens, 9 query / 3 KV heads of 64,
    took 17.7 ms in bf16 against 4.2 ms in fp32 (inputs converted, output rounded back)."""
    _cpu_bf16_in_fp32["on"] = bool(on)


def _in_fp32(*ts: Tensor) -> bool:
    return _cpu_bf16_in_fp32["on"] and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in ts)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def _importable(module: str) -> bool:
    # find_spec looks for the module without importing it (importing triton costs ~1 s and we promised not to).
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def _usable(module: str) -> bool:
    """A fast path's package imports (flash-attn, Transformer Engine): an installed but broken one (a wheel built for
    another torch or CUDA) is passed over with one warning instead of crashing the first attention call. Imported
    only when a CUDA tensor asks for it."""
    if not _importable(module):
        return False
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure to import means the fallback
        logger.warning("kernels: %s is installed but does not import (%s: %s); using the next path", module,
                       type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return False
    return True


def _torch_flash_usable(t: Tensor) -> bool:
    from rlhf.kernels.attention_flash import usable

    return usable(t.device.index if t.device.index is not None else torch.cuda.current_device())


def _log_path(op: str, path: str, why: str, level: int = logging.INFO) -> None:
    if (op, path) not in _logged:
        _logged.add((op, path))
        logger.log(level, "kernels.%s: using the %s path (%s)", op, path, why)


def _select(op: str, t: Tensor, fast_paths: tuple[str, ...] = ()) -> str:
    """Pick the implementation of `op` for tensors like `t`: 'torch', 'triton' or one of `fast_paths`."""
    level = logging.INFO
    if _env_flag(FORCE_TORCH_ENV):
        path, why = "torch", f"{FORCE_TORCH_ENV}=1"
    elif _env_flag(FORCE_TRITON_ENV):
        if not _importable("triton"):
            raise RuntimeError(f"{FORCE_TRITON_ENV}=1 but triton is not installed")
        if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"{FORCE_TRITON_ENV}=1 on {t.device.type} tensors needs TRITON_INTERPRET=1, "
                               "set before triton is first imported")
        path, why = "triton", f"{FORCE_TRITON_ENV}=1"
    elif t.is_cuda:
        available = [p for p in fast_paths if (_torch_flash_usable(t) if p == "torch_flash" else _usable(p))]
        if available:
            path, why = available[0], "CUDA tensors"
        elif _importable("triton"):
            path, why = "triton", "CUDA tensors"
        else:  # a slow path on a GPU deserves more than an info line
            path, why, level = "torch", "CUDA tensors but triton is not installed", logging.WARNING
    else:
        path, why = "torch", f"{t.device.type} tensors"
    _log_path(op, path, why, level)
    return path


def _logprob_ops(op: str, t: Tensor) -> LogprobOps:
    if _select(op, t) == "triton":
        from rlhf.kernels.logprobs_triton import TRITON_OPS

        return TRITON_OPS
    return TORCH_OPS


def _check_temperature(temperature: float) -> float:
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"--temperature must be a positive finite number, got {temperature}")
    return 1.0 / float(temperature)


def _check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    return_entropy: bool = False,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    inplace_backward: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probability of `targets` under softmax(logits / temperature), and optionally its entropy.

    Args:
        logits: `[N, V_local]` (or `[*, V_local]`), any float dtype. With `tp_group`, this rank's contiguous
            vocab shard: rank r holds global ids [r * V_local, (r + 1) * V_local). Otherwise the full vocab.
        targets: `[N]` (or `[*]`) global token ids.
        temperature: logits are divided by it before the softmax.
        tp_group: tensor-parallel group the vocab is split over, or None.
        return_entropy: also return the entropy of softmax(logits / temperature).
        vocab_size: global ids >= vocab_size are padding columns (megatron pads the vocab to a multiple of
            128) and are excluded from the softmax. None: every column is a real token.
        chunk_size: rows per chunk on the torch path (default: about 1M elements per chunk).
        inplace_backward: the backward overwrites `logits`, chunk by chunk, with the gradient wrt them and
            returns that storage as the gradient, so the backward allocates no `[N, V]` tensor either (by
            default it allocates exactly one, the gradient). The caller must not use `logits` after the
            backward, nor hand them to anything else whose backward reads them: autograd raises
            ("modified by an inplace operation") if another op saved them and runs its backward later, but a
            plain read of `logits` after the backward silently sees the gradient. A leaf that requires grad
            is refused (its `.grad` would alias its own data). Use it where the logits are a model output
            consumed only by this loss. Non-contiguous logits that `reshape` has to copy still work; only the
            copy is overwritten, and the memory saving is lost.

    Returns:
        logprobs `[N]` fp32, or (logprobs, entropy) both `[N]` fp32 when `return_entropy`.

    Differentiable wrt logits (the gradient comes back in logits' dtype), through both outputs. No fp32
    `[N, V]` tensor is allocated beyond one chunk; the backward recomputes the softmax per chunk.
    Logits must be finite (exclude columns with `vocab_size`, not with -inf: -inf * 0 is NaN in the entropy).
    Targets must be real ids (< vocab_size); they are not checked, since that would sync the GPU.
    """
    inv_temp = _check_temperature(temperature)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} "
                         "disagree on the leading dims")
    if inplace_backward and logits.requires_grad and logits.is_leaf:
        raise ValueError("inplace_backward=True needs logits computed by an op (e.g. a model output), not a leaf "
                         "tensor: the backward overwrites them with their own gradient")
    lead = targets.shape
    logits2d, targets1d = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    ops = _logprob_ops("token_logprobs", logits)
    _check_chunk_size(chunk_size)
    if chunk_size is not None:
        rows = chunk_size
    elif ops.chunk_elems is None:
        rows = max(1, logits2d.shape[0])
    else:
        rows = default_chunk_rows(logits2d.shape[1], ops.chunk_elems)
    logprobs, entropy = TokenLogprobsFunction.apply(
        logits2d, targets1d, inv_temp, tp_group, vocab_size, return_entropy, ops, rows, inplace_backward
    )
    if return_entropy:
        return logprobs.view(lead), entropy.view(lead)
    return logprobs.view(lead)


def fused_linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """`token_logprobs(hidden @ weight.T, targets, ...)` without ever holding all the logits.

    Args:
        hidden: `[N, H]` (or `[*, H]`) final hidden states, replicated across `tp_group` (the input of
            megatron's vocab-parallel output layer). Its gradient is all-reduced over `tp_group`.
        weight: `[V_local, H]` this rank's shard of the output weight (the full `[V, H]` without TP).
        targets: `[N]` (or `[*]`) global token ids.
        chunk_size: rows per chunk (default: about 8M logits per chunk on CPU, 32M on CUDA, at least 256 rows).
        temperature, tp_group, return_entropy, vocab_size: as in `token_logprobs`.

    Returns logprobs `[N]` fp32, or (logprobs, entropy) when `return_entropy`. Differentiable wrt hidden and
    weight; the backward recomputes each chunk's logits (one extra matmul), except on CPU where the forward keeps
    them when they fit in ``logprobs.FUSED_CPU_KEEP_BYTES``.
    """
    inv_temp = _check_temperature(temperature)
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} "
                         "disagree on the leading dims")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [V_local, H] with H = {hidden.shape[-1]}")
    _check_chunk_size(chunk_size)
    lead = targets.shape
    ops = _logprob_ops("fused_linear_logprobs", hidden)
    rows = chunk_size or fused_chunk_rows(weight.shape[0], hidden.device)
    if ops is TORCH_OPS and _in_fp32(hidden, weight):
        hidden, weight = hidden.float(), weight.float()  # grads convert back to bf16 through autograd
    logprobs, entropy = FusedLinearLogprobsFunction.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), inv_temp, tp_group, vocab_size,
        return_entropy, ops, rows,
    )
    if return_entropy:
        return logprobs.view(lead), entropy.view(lead)
    return logprobs.view(lead)


@functools.cache
def _te_attention(hq: int, hkv: int, d: int, softmax_scale: float):
    # transformer-engine's attention is a module; one instance per head layout, cached.
    from transformer_engine.pytorch import DotProductAttention

    return DotProductAttention(hq, d, num_gqa_groups=hkv, attention_dropout=0.0, qkv_format="thd",
                               attn_mask_type="padding_causal", softmax_scale=softmax_scale)


def varlen_fast_paths(dtype: torch.dtype) -> tuple[str, ...]:
    """flash-attn, torch's own flash kernels (``kernels.attention_flash``) and transformer-engine run fp16/bf16
    only (they reject fp32): fp32 goes to Triton or torch."""
    if dtype in (torch.float16, torch.bfloat16):
        return ("flash_attn", "torch_flash", "transformer_engine")
    return ()


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, *, softmax_scale: float | None = None
) -> Tensor:
    """Causal self-attention over packed sequences (THD layout), each sequence attending only to itself.

    Args:
        q: `[T, Hq, D]`; k, v: `[T, Hkv, D]`, Hq a multiple of Hkv (GQA).
        cu_seqlens: `[B + 1]` int32 cumulative lengths (see `kernels.packing`); max_seqlen: max length.
        softmax_scale: defaults to 1 / sqrt(D).

    Returns `[T, Hq, D]` in q's dtype. Differentiable wrt q, k and v.
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"expected q [T, Hq, D] and k, v [T, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"Hq={q.shape[1]} must be a multiple of Hkv={k.shape[1]}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    path = _select("varlen_attention", q, fast_paths=varlen_fast_paths(q.dtype))
    if path == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        return flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale, causal=True)
    if path == "torch_flash":
        from rlhf.kernels.attention_flash import flash_varlen_attention

        return flash_varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)
    if path == "transformer_engine":
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        attn = _te_attention(q.shape[1], k.shape[1], q.shape[2], scale)
        out = attn(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
        return out.view(q.shape)  # TE returns [T, Hq * D]
    if path == "triton":
        from rlhf.kernels.attention_triton import varlen_attention_triton

        return varlen_attention_triton(q, k, v, cu_seqlens, max_seqlen, scale)
    if _in_fp32(q, k, v):
        return _varlen_attention_torch(q.float(), k.float(), v.float(), cu_seqlens, max_seqlen, scale).to(q.dtype)
    return _varlen_attention_torch(q, k, v, cu_seqlens, max_seqlen, scale)


def _varlen_attention_torch(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                            scale: float) -> Tensor:
    if _env_flag(VARLEN_LOOP_ENV) or not padding_pays((cu_seqlens[1:] - cu_seqlens[:-1]).tolist()):
        return varlen_attention_reference(q, k, v, cu_seqlens, max_seqlen, scale)
    return varlen_attention_padded(q, k, v, cu_seqlens, scale)
