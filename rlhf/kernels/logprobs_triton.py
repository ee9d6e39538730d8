"""Triton kernels for the per-row log-prob statistics and their gradient.

One program per row streams over the row's vocab shard in BLOCK_V slices with an online max / sum-exp,
so no `[N, V]` workspace exists at all: `token_logprobs` runs every row in one launch. The contracts are
those of `kernels.reference.logprob_chunk_stats` / `logprob_chunk_grad`, which these must match.

Imported lazily by `kernels` (importing triton is slow and it is absent on some CPU installs). Runs on CPU
only under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlhf.kernels.logprobs import LogprobOps
from rlhf.kernels.reference import RowStats

# Below -1e30 acts as -inf but keeps (m_old - m_new) * s finite (0 * -inf would be NaN).
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _logprob_stats_kernel(
    logits_ptr, stride_row, targets_ptr, m_ptr, s_ptr, u_ptr, tgt_ptr,
    n_valid, inv_temp,
    NEED_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    m = tl.zeros([], dtype=tl.float32) + _NEG_BIG
    s = tl.zeros([], dtype=tl.float32)
    u = tl.zeros([], dtype=tl.float32)
    for start in range(0, n_valid, BLOCK_V):
        mask = start + cols < n_valid
        x = tl.load(base + start + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(x, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(x - m_new)  # 0 on masked columns
        if NEED_ENTROPY:
            # u = sum e (x - m): rescale the running sum to the new max, then add this block.
            u = alpha * (u + (m - m_new) * s) + tl.sum(e * tl.where(mask, x - m_new, 0.0), axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new
    target = tl.load(targets_ptr + row)
    owned = target >= 0
    tgt = tl.load(base + tl.maximum(target, 0), mask=owned, other=0.0).to(tl.float32) * inv_temp
    tl.store(m_ptr + row, tl.where(n_valid > 0, m, -float("inf")))
    tl.store(s_ptr + row, s)
    tl.store(tgt_ptr + row, tl.where(owned, tgt, 0.0))
    if NEED_ENTROPY:
        tl.store(u_ptr + row, u)


@triton.jit
def _logprob_grad_kernel(
    logits_ptr, stride_row, grad_ptr, stride_grad_row, targets_ptr, logz_ptr, ent_ptr, glp_ptr, gent_ptr,
    n_valid, n_cols, inv_temp,
    HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    gbase = grad_ptr + row * stride_grad_row
    cols = tl.arange(0, BLOCK_V)
    target = tl.load(targets_ptr + row)
    logz = tl.load(logz_ptr + row)
    gl = tl.zeros([], dtype=tl.float32)
    if HAS_GLP:
        gl = tl.load(glp_ptr + row).to(tl.float32)
    # grad = p * (a + b * log p) + 1[v == target] * gl / T, see kernels.reference.logprob_chunk_grad.
    a = -gl * inv_temp
    b = tl.zeros([], dtype=tl.float32)
    if HAS_GENT:
        ge = tl.load(gent_ptr + row).to(tl.float32)
        a = a - ge * tl.load(ent_ptr + row) * inv_temp
        b = -ge * inv_temp
    for start in range(0, n_cols, BLOCK_V):
        c = start + cols
        valid = c < n_valid
        # Each element is read before this same program overwrites it, so grad_ptr may alias logits_ptr.
        x = tl.load(base + c, mask=valid, other=0.0).to(tl.float32) * inv_temp
        lp = x - logz
        p = tl.where(valid, tl.exp(lp), 0.0)
        g = p * (a + b * lp)
        g = g + tl.where(c == target, gl * inv_temp, 0.0)
        tl.store(gbase + c, g.to(grad_ptr.dtype.element_ty), mask=c < n_cols)


def _block_v(n: int, on_cpu: bool) -> int:
    # The interpreter pays per loop iteration, so it gets the widest block; GPUs want a register-sized one.
    cap = 8192 if on_cpu else 4096
    return max(16, min(cap, triton.next_power_of_2(max(1, n))))


def _rows_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def logprob_chunk_stats_triton(
    logits: Tensor, targets_local: Tensor, n_valid: int, inv_temp: float, need_entropy: bool,
    overwrite: bool = False,
) -> RowStats:
    """Triton version of `kernels.reference.logprob_chunk_stats` (same arguments and result).

    `overwrite` is accepted for interface parity; the kernel needs no workspace.
    """
    logits = _rows_contiguous(logits)
    c = logits.shape[0]
    m, s, tgt = (torch.empty(c, dtype=torch.float32, device=logits.device) for _ in range(3))
    u = torch.empty_like(s) if need_entropy else s  # s as a dummy pointer; never written when not needed
    if c > 0:
        _logprob_stats_kernel[(c,)](
            logits, logits.stride(0), targets_local.contiguous(), m, s, u, tgt,
            n_valid, float(inv_temp),
            NEED_ENTROPY=need_entropy, BLOCK_V=_block_v(n_valid, logits.device.type == "cpu"),
        )
    return RowStats(m, s, u if need_entropy else None, tgt)


def logprob_chunk_grad_triton(
    logits: Tensor,
    targets_local: Tensor,
    n_valid: int,
    inv_temp: float,
    logz: Tensor,
    entropy: Tensor | None,
    grad_logprobs: Tensor | None,
    grad_entropy: Tensor | None,
    out: Tensor,
) -> Tensor:
    """Triton version of `kernels.reference.logprob_chunk_grad` (same arguments and result)."""
    logits = _rows_contiguous(logits)
    assert out.stride(-1) == 1, "out must have unit stride along the vocab"
    c, n_cols = out.shape
    dummy = logz  # pointer for absent optional inputs; the constexpr flags keep it unread
    if c > 0:
        _logprob_grad_kernel[(c,)](
            logits, logits.stride(0), out, out.stride(0), targets_local.contiguous(), logz.contiguous(),
            entropy.contiguous() if entropy is not None else dummy,
            grad_logprobs.contiguous() if grad_logprobs is not None else dummy,
            grad_entropy.contiguous() if grad_entropy is not None else dummy,
            n_valid, n_cols, float(inv_temp),
            HAS_GLP=grad_logprobs is not None, HAS_GENT=grad_entropy is not None,
            BLOCK_V=_block_v(n_cols, logits.device.type == "cpu"),
        )
    return out


TRITON_OPS = LogprobOps("triton", logprob_chunk_stats_triton, logprob_chunk_grad_triton, chunk_elems=None)

# Kernel name -> dict(fn, signature, constexprs, num_warps) of a bf16 GPU launch; tests/kernels compiles
# each ahead of time for sm_90.
AOT_SPECS = {
    "logprob_stats": dict(
        fn=_logprob_stats_kernel,
        signature={"logits_ptr": "*bf16", "stride_row": "i64", "targets_ptr": "*i64", "m_ptr": "*fp32",
                   "s_ptr": "*fp32", "u_ptr": "*fp32", "tgt_ptr": "*fp32", "n_valid": "i32", "inv_temp": "fp32",
                   "NEED_ENTROPY": "constexpr", "BLOCK_V": "constexpr"},
        constexprs={"NEED_ENTROPY": True, "BLOCK_V": 4096},
        num_warps=4,
    ),
    "logprob_grad": dict(
        fn=_logprob_grad_kernel,
        signature={"logits_ptr": "*bf16", "stride_row": "i64", "grad_ptr": "*bf16", "stride_grad_row": "i64",
                   "targets_ptr": "*i64", "logz_ptr": "*fp32", "ent_ptr": "*fp32", "glp_ptr": "*fp32",
                   "gent_ptr": "*fp32", "n_valid": "i32", "n_cols": "i32", "inv_temp": "fp32",
                   "HAS_GLP": "constexpr", "HAS_GENT": "constexpr", "BLOCK_V": "constexpr"},
        constexprs={"HAS_GLP": True, "HAS_GENT": True, "BLOCK_V": 4096},
        num_warps=4,
    ),
}
