"""Pure-torch reference kernels: the source of truth for every optimized path in `kernels`.

Everything here is tensors in, tensors out: no process groups, no I/O, no Triton.

Log-prob math. With x = logits / T over the valid (non-padding) columns of one row:
    logZ    = logsumexp(x)
    logp_t  = x_t - logZ
    H       = -sum_v p_v log p_v = logZ - sum_v p_v x_v
    d logp_t / dx_v = 1[v == t] - p_v
    d H / dx_v      = -p_v (log p_v + H)

The row statistics below are computed per shard and per chunk of rows, relative to the shard's own
max, so that shards can be merged exactly afterwards (see `kernels.logprobs.combine_stats`), the
same recipe as megatron's `vocab_parallel_cross_entropy`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class RowStats:
    """Per-row statistics of one vocab shard, all fp32 `[C]`.

    `m`: max of x over the shard's valid columns (-inf when the shard has none).
    `s`: sum exp(x - m).
    `u`: sum exp(x - m) * (x - m); kept relative to m (not sum p*x) to avoid cancellation in H.
    `tgt`: x at the target column when this shard owns the target, else 0.
    """

    m: Tensor
    s: Tensor
    u: Tensor | None
    tgt: Tensor


def _scaled_fp32(logits: Tensor, inv_temp: float, shift: Tensor, inplace: bool = False) -> Tensor:
    """fp32 `logits * inv_temp - shift[:, None]`, in place on fp32 `logits` if `inplace`, else a fresh tensor.

    One pass in the common fp32, T=1 case; the chunk is cache-sized, so extra passes are cheap but not free.
    """
    if logits.dtype == torch.float32:
        if inplace:
            return (logits.mul_(inv_temp) if inv_temp != 1.0 else logits).sub_(shift.unsqueeze(1))
        if inv_temp == 1.0:
            return logits - shift.unsqueeze(1)
        return torch.sub(logits * inv_temp, shift.unsqueeze(1))
    x = logits.float()
    if inv_temp != 1.0:
        x.mul_(inv_temp)
    return x.sub_(shift.unsqueeze(1))


def logprob_chunk_stats(
    logits: Tensor, targets_local: Tensor, n_valid: int, inv_temp: float, need_entropy: bool,
    overwrite: bool = False,
) -> RowStats:
    """Row statistics of a chunk of one vocab shard.

    Args:
        logits: `[C, V_local]`, any float dtype. Columns >= n_valid are vocab padding and ignored.
        targets_local: `[C]` int64, the target's column in this shard, or -1 when another shard owns it.
        n_valid: number of valid (non-padding) columns in this shard, 0 <= n_valid <= V_local.
        inv_temp: 1 / temperature.
        need_entropy: compute `u` (needed for entropy) or leave it None.
        overwrite: `logits` is a scratch chunk the caller drops afterwards; fp32 ones are used as workspace.

    Memory: two fp32 `[C, n_valid]` temporaries (one when overwriting fp32 logits).
    """
    c = logits.shape[0]
    owned = targets_local >= 0
    if n_valid == 0:
        zeros = logits.new_zeros(c, dtype=torch.float32)
        return RowStats(torch.full_like(zeros, -math.inf), zeros, zeros if need_entropy else None, zeros)
    valid = logits[:, :n_valid]
    # Max and target logit straight from the input: max commutes with the positive scale 1/T.
    m = valid.amax(dim=1).float() * inv_temp  # (C,)
    tgt = valid.gather(1, targets_local.clamp(min=0).unsqueeze(1)).squeeze(1).float() * inv_temp
    tgt = torch.where(owned, tgt, torch.zeros_like(tgt))
    x = _scaled_fp32(valid, inv_temp, m, inplace=overwrite)  # (C, Vv) fp32, x - m <= 0
    e = x.exp()  # (C, Vv)
    s = e.sum(dim=1)
    u = None
    if need_entropy:
        u = torch.linalg.vecdot(e, x)  # row dot products; 2x faster than bmm on CPU
    return RowStats(m, s, u, tgt)


def logprob_chunk_grad(
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
    """Gradient wrt a chunk of one vocab shard's raw logits, written into `out`.

    Args:
        logits: `[C, V_local]`, the forward input (recomputed from, never modified unless `out` aliases it).
        targets_local: `[C]` int64, see `logprob_chunk_stats`.
        logz: `[C]` fp32 global log-partition of x = logits / T.
        entropy: `[C]` fp32 global entropy (needed only when grad_entropy is given).
        grad_logprobs, grad_entropy: `[C]` upstream grads, either may be None (no grad flows).
        out: `[C, V_local]` destination in any float dtype; may alias `logits` (x is read first).

    Returns `out`. Padding columns get 0.
    """
    c = logits.shape[0]
    gl = grad_logprobs.float() if grad_logprobs is not None else logits.new_zeros(c, dtype=torch.float32)
    if n_valid < out.shape[1]:
        out[:, n_valid:].zero_()
    if n_valid == 0:
        return out
    dst = out[:, :n_valid]
    # Work in `out` itself when it is fp32: in place when it aliases logits (the fused path's scratch chunk),
    # else as the destination of the last multiply; low-precision `out` gets one final cast-copy.
    aliased = out.data_ptr() == logits.data_ptr() and out.dtype == logits.dtype == torch.float32
    lp = _scaled_fp32(dst if aliased else logits[:, :n_valid], inv_temp, logz, inplace=aliased)  # (C, Vv) log p
    p = lp.exp()
    # grad_x = gl*(onehot - p) - ge*p*(log p + H); the 1/T of d x / d logits is folded into a and b.
    a = -gl * inv_temp  # (C,)
    into = dst if dst.dtype == torch.float32 else lp
    if grad_entropy is not None:
        ge = grad_entropy.float()
        a = a - ge * entropy * inv_temp
        lp.mul_((-ge * inv_temp).unsqueeze(1)).add_(a.unsqueeze(1))  # a + b log p
        g = torch.mul(lp, p, out=into)
    else:
        g = torch.mul(p, a.unsqueeze(1), out=into)
    owned = targets_local >= 0
    g.scatter_add_(1, targets_local.clamp(min=0).unsqueeze(1), torch.where(owned, gl * inv_temp, 0.0).unsqueeze(1))
    if into is not dst:
        dst.copy_(g)
    return out


def varlen_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: float | None = None
) -> Tensor:
    """Causal attention within each packed sequence, O(sum L_i^2).

    Args:
        q: `[T, Hq, D]`; k, v: `[T, Hkv, D]` with Hq a multiple of Hkv (GQA).
        cu_seqlens: `[B + 1]` int32 cumulative sequence lengths, cu_seqlens[0] == 0, cu_seqlens[-1] == T.
        max_seqlen: longest sequence (unused here; kept for signature parity with flash-attn).

    Returns `[T, Hq, D]` in q's dtype. Differentiable through torch's SDPA.
    """
    del max_seqlen
    hq, hkv = q.shape[1], k.shape[1]
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        # (L, H, D) -> (H, L, D): SDPA wants heads before the sequence.
        qi, ki, vi = (t[start:end].transpose(0, 1) for t in (q, k, v))
        oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=softmax_scale, enable_gqa=hq != hkv)
        outs.append(oi.transpose(0, 1))
    if not outs:
        return q.new_empty(q.shape)
    return torch.cat(outs, dim=0)
