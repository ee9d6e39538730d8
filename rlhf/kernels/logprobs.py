"""Chunked, vocab-parallel token log-probs and entropy as custom autograd functions.

The math lives in per-chunk "ops" (torch in `kernels.reference`, Triton in `kernels.logprobs_triton`);
this module owns what they share: chunking, merging vocab shards across tensor-parallel ranks, and autograd.

Memory: the only full-size tensors are the inputs and the gradients autograd has to return. Everything
fp32 and `[*, V]`-shaped exists for one chunk of rows at a time, in the forward and in the backward
(which recomputes from the saved logits, or for the fused variant from hidden and weight). With
`inplace_backward` the gradient wrt the logits is written over the saved logits themselves, so
`token_logprobs` allocates no `[N, V]` tensor at all.

Tensor parallel: logits (or the output weight) are split over the vocab, rank r holding global ids
[r * V_local, (r + 1) * V_local). Per row, each rank computes (max m, sum e^(x-m), sum e^(x-m) (x-m), target x)
for its shard; one all-reduce MAX and one all-reduce SUM of a stacked [3, N] tensor merge them exactly,
as megatron's `vocab_parallel_cross_entropy` does. The backward needs no communication for the logits;
the fused variant all-reduces the gradient wrt the (replicated) hidden states, like ColumnParallelLinear.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from rlhf.kernels import reference
from rlhf.kernels.reference import RowStats

# fp32 elements of one chunk of logits for `token_logprobs` on CPU. Tuned with bench/fused_kernels.py
# (N=4096, V=32000, 1 thread; 8 to 128 rows all run within 10%): cache-sized, and large enough that the
# per-chunk Python overhead vanishes. On GPUs the Triton kernels stream rows with O(1) extra memory instead.
CPU_CHUNK_ELEMS = 1 << 20
# Logits per chunk for `fused_linear_logprobs`, and a floor on its rows: below ~256 rows the chunk matmuls
# lose efficiency (at V=32000 on CPU, 32-row chunks ran 1.6x slower than 256-row ones).
FUSED_CPU_CHUNK_ELEMS = 1 << 23
FUSED_CUDA_CHUNK_ELEMS = 1 << 25
FUSED_MIN_ROWS = 256
# Bytes of logits the CPU forward of `fused_linear_logprobs` may keep for its backward instead of recomputing them
# there (one `[N, H] x [H, V]` matmul less: 0.13 s per 683 x 49152 micro-batch, 2 threads). Above it, recompute.
FUSED_CPU_KEEP_BYTES = 1 << 28


@dataclass(frozen=True)
class LogprobOps:
    """One implementation of the per-chunk math; see `kernels.reference` for the contracts."""

    name: str
    stats: Callable[..., RowStats]
    grad: Callable[..., Tensor]
    # Chunk rows for `token_logprobs`; None processes all rows at once (a kernel that needs no workspace).
    chunk_elems: int | None


TORCH_OPS = LogprobOps("torch", reference.logprob_chunk_stats, reference.logprob_chunk_grad, CPU_CHUNK_ELEMS)


def default_chunk_rows(v_local: int, chunk_elems: int, min_rows: int = 1) -> int:
    """Rows per chunk so that one `[rows, V_local]` chunk holds about `chunk_elems` elements."""
    return max(min_rows, chunk_elems // max(1, v_local))


def fused_chunk_rows(v_local: int, device: torch.device) -> int:
    """Default rows per chunk of `fused_linear_logprobs`."""
    elems = FUSED_CUDA_CHUNK_ELEMS if device.type == "cuda" else FUSED_CPU_CHUNK_ELEMS
    return default_chunk_rows(v_local, elems, FUSED_MIN_ROWS)


def shard_bounds(v_local: int, tp_group: dist.ProcessGroup | None, vocab_size: int | None) -> tuple[int, int]:
    """(first global id of this rank's shard, number of its non-padding columns)."""
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    world = dist.get_world_size(tp_group) if tp_group is not None else 1
    if vocab_size is not None and not 0 < vocab_size <= v_local * world:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, V_local * tp_size = {v_local * world}]")
    start = rank * v_local
    n_valid = v_local if vocab_size is None else min(v_local, max(0, vocab_size - start))
    return start, n_valid


def local_targets(targets: Tensor, vocab_start: int, n_valid: int) -> Tensor:
    """`[N]` global ids -> `[N]` int64 column in this shard, or -1 where another shard owns the id."""
    t = targets.long() - vocab_start
    return torch.where((t >= 0) & (t < n_valid), t, torch.full_like(t, -1))


def combine_stats(
    stats: RowStats, tp_group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Merge per-shard row statistics into global (logz, logprobs, entropy), each fp32 `[N]`."""
    m, s, u, tgt = stats.m, stats.s, stats.u, stats.tgt
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        logs = torch.log(s)
        logz = m + logs
        entropy = logs - u / s if u is not None else None
        return logz, tgt - logz, entropy
    gmax = m.clone()
    dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=tp_group)
    scale = torch.exp(m - gmax)  # 0 for shards with no valid column (m = -inf)
    parts = [s * scale, tgt]
    if u is not None:
        # sum_v e^(x-M) (x-M) = e^(m-M) * (u + (m-M) s); guarded since (m-M) s is -inf * 0 on empty shards.
        parts.append(torch.where(s > 0, scale * (u + (m - gmax) * s), torch.zeros_like(s)))
    packed = torch.stack(parts)  # (2 or 3, N): one all-reduce for all sums
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
    logs = torch.log(packed[0])
    logz = gmax + logs
    entropy = logs - packed[2] / packed[0] if u is not None else None
    return logz, packed[1] - logz, entropy


def _cat_stats(chunks: list[RowStats]) -> RowStats:
    if len(chunks) == 1:
        return chunks[0]
    u = torch.cat([c.u for c in chunks]) if chunks[0].u is not None else None
    return RowStats(torch.cat([c.m for c in chunks]), torch.cat([c.s for c in chunks]), u,
                    torch.cat([c.tgt for c in chunks]))


def _block_rows(ops: LogprobOps, v_local: int, chunk_rows: int) -> int:
    """Rows of one cache-sized block of a fused chunk for `ops` (the whole chunk for kernels without a size)."""
    return chunk_rows if ops.chunk_elems is None else min(chunk_rows, default_chunk_rows(v_local, ops.chunk_elems))


def _slice(t: Tensor | None, i: int, j: int) -> Tensor | None:
    return None if t is None else t[i:j]


class TokenLogprobsFunction(torch.autograd.Function):
    """(logits `[N, V_local]`, targets `[N]`) -> (logprobs `[N]` fp32, entropy `[N]` fp32 or None).

    With `inplace_backward`, the backward writes the gradient chunk by chunk over the saved logits and returns
    that same storage as the gradient (Liger-Kernel's trick): no `[N, V_local]` tensor is allocated at all.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, inv_temp: float, tp_group, vocab_size: int | None,
                return_entropy: bool, ops: LogprobOps, chunk_rows: int, inplace_backward: bool = False):
        n, v_local = logits.shape
        vocab_start, n_valid = shard_bounds(v_local, tp_group, vocab_size)
        tloc = local_targets(targets, vocab_start, n_valid)
        chunks = [ops.stats(logits[i:i + chunk_rows], tloc[i:i + chunk_rows], n_valid, inv_temp, return_entropy)
                  for i in range(0, n, chunk_rows)]
        logz, logprobs, entropy = combine_stats(_cat_stats(chunks), tp_group)
        ctx.save_for_backward(logits, tloc, logz, entropy)
        ctx.set_materialize_grads(False)  # None grads tell the backward which terms to skip
        ctx.cfg = (inv_temp, n_valid, ops, chunk_rows, inplace_backward)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        logits, tloc, logz, entropy = ctx.saved_tensors
        inv_temp, n_valid, ops, chunk_rows, inplace = ctx.cfg
        if inplace:
            # Each chunk is read before it is overwritten (see the ops' `out` contract). The Triton kernel
            # writes through a raw pointer, so bump the version counter by hand: any other autograd node
            # that saved these logits then raises instead of silently reading gradients.
            torch.autograd.graph.increment_version(logits)
            grad = logits
        else:
            grad = torch.empty_like(logits)  # in logits' dtype: the only [N, V_local] tensor we allocate
        if grad_logprobs is None and grad_entropy is None:
            return grad.zero_(), *([None] * 8)
        for i in range(0, logits.shape[0], chunk_rows):
            j = i + chunk_rows
            ops.grad(logits[i:j], tloc[i:j], n_valid, inv_temp, logz[i:j], _slice(entropy, i, j),
                     _slice(grad_logprobs, i, j), _slice(grad_entropy, i, j), out=grad[i:j])
        return grad, *([None] * 8)


class FusedLinearLogprobsFunction(torch.autograd.Function):
    """(hidden `[N, H]`, weight `[V_local, H]`, targets `[N]`) -> (logprobs, entropy or None), fp32 `[N]`.

    Logits are made one `[chunk_rows, V_local]` chunk at a time, in hidden's dtype (one matmul per chunk). The
    torch ops (CPU) then work through each chunk in cache-sized blocks of rows (`ops.chunk_elems` logits): a
    chunk of 256 x 49152 fp32 logits is 50 MB, and each of their passes over it would stream it from memory.
    The backward overwrites each chunk in place with its gradient before the two matmuls. It recomputes the
    chunk, except on CPU where the forward kept all the logits (at most `FUSED_CPU_KEEP_BYTES`).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: float, tp_group,
                vocab_size: int | None, return_entropy: bool, ops: LogprobOps, chunk_rows: int):
        n = hidden.shape[0]
        vocab_start, n_valid = shard_bounds(weight.shape[0], tp_group, vocab_size)
        tloc = local_targets(targets, vocab_start, n_valid)
        wt = weight.t()
        keep = (hidden.device.type == "cpu" and ops.chunk_elems is not None and any(ctx.needs_input_grad[:2])
                and n * weight.shape[0] * hidden.element_size() <= FUSED_CPU_KEEP_BYTES)
        block = _block_rows(ops, weight.shape[0], chunk_rows)
        chunks, kept = [], []
        for i in range(0, n, chunk_rows):
            logits = torch.mm(hidden[i:i + chunk_rows], wt)  # (C, V_local)
            c = logits.shape[0]
            for a in range(0, c, block):
                chunks.append(ops.stats(logits[a:a + block], tloc[i + a:i + min(a + block, c)], n_valid, inv_temp,
                                        return_entropy, overwrite=not keep))
            if keep:
                kept.append(logits)
            del logits
        logz, logprobs, entropy = combine_stats(_cat_stats(chunks), tp_group)
        ctx.save_for_backward(hidden, weight, tloc, logz, entropy)
        ctx.set_materialize_grads(False)
        ctx.cfg = (inv_temp, n_valid, ops, chunk_rows, tp_group)
        ctx.kept = kept if keep else None
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, tloc, logz, entropy = ctx.saved_tensors
        inv_temp, n_valid, ops, chunk_rows, tp_group = ctx.cfg
        kept, ctx.kept = ctx.kept, None  # overwritten below: a second backward (retain_graph) recomputes
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # fp32 weight: accumulate in place with addmm_. Low precision: accumulate chunks in fp32.
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        if grad_logprobs is not None or grad_entropy is not None:
            wt = weight.t()
            block = _block_rows(ops, weight.shape[0], chunk_rows)
            for k, i in enumerate(range(0, hidden.shape[0], chunk_rows)):
                j = i + chunk_rows
                h = hidden[i:j]
                logits = kept[k] if kept is not None else torch.mm(h, wt)  # (C, V_local)
                for a in range(i, min(j, hidden.shape[0]), block):
                    b = min(a + block, j)
                    ops.grad(logits[a - i:b - i], tloc[a:b], n_valid, inv_temp, logz[a:b], _slice(entropy, a, b),
                             _slice(grad_logprobs, a, b), _slice(grad_entropy, a, b), out=logits[a - i:b - i])
                g = logits
                if need_h:
                    torch.mm(g, weight, out=grad_h[i:j])  # (C, H)
                if need_w:
                    if g.dtype == torch.float32:
                        grad_w.addmm_(g.t(), h)  # (V_local, H)
                    else:
                        grad_w.add_(torch.mm(g.t(), h))
                del logits, g
                if kept is not None:
                    kept[k] = None
        if need_h and tp_group is not None and dist.get_world_size(tp_group) > 1:
            # hidden is replicated over TP ranks; each rank only saw its vocab shard's contribution.
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=tp_group)
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, *([None] * 7)
