"""Context parallelism (``--context_parallel_size``): one sequence's tokens split across the ranks of a CP group.

Layout: megatron's load-balanced one. A sequence is padded to a multiple of 2 x CP and cut into 2 x CP equal
chunks; CP rank r holds chunks r and 2CP-1-r, so every rank gets the same share of causal attention work. Padded
batches (B, S) split every row the same way; packed (THD) streams split every packed sequence (each padded on its
own), so a rank holds both ends of every sequence, as megatron/TE's THD layout does.

Where it happens: ``LlamaGPT.forward`` (rlhf.models.gpt) splits the input on the first pipeline stage, gives every
layer the rotary frequencies of its tokens' true positions, runs the decoder on the local tokens (the decoder sees a
plain (S_local, B) batch) and, on the last stage, the head on them too: the last stage returns this rank's tokens
only, (B, S_local, V_local) logits, (B, S_local, H) hidden states or (B, S_local) values. The readers then work on
the local chunks: log-probs and entropy through the fused vocab-parallel kernels on the local tokens
(``rlhf.algo.losses.next_token_logprobs``, ``rlhf.models.outputs``), values and rewards read where they lie; the
per-token results (one float a token) are all-gathered, or summed over the CP group where only one rank holds a
token (``cp_sum``), so every CP rank of a replica computes the same loss and metrics on whole sequences. Their
backward hands each rank the gradient of its own tokens; the loss's token count is counted once per CP group
(``rlhf.models.pipeline.once_per_cp_group``), so the DP x CP gradient reduction gives the plain gradient.

A loss or reader says it takes local outputs with ``reads_local_tokens``; any other gets the whole sequences
(``whole_sequences``: the output all-gathered, logged once), which is correct but keeps (B, S, V) logits on every
rank.

Attention (``cp_attention``): each rank all-gathers the keys and values of its CP group (K/V only: with GQA a
fraction of the hidden size) and attends its local queries to them under the causal mask of the true positions;
the backward all-reduces the K/V gradients and keeps its own slice (a reduce-scatter; gloo has no reduce-scatter).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CPLayout:
    """One micro-batch's split. ``local`` (n_local,) indexes this rank's tokens in the padded stream (rank 0's
    chunks first in the gather order: ``order`` maps the gathered, rank-major stream back to the padded one);
    ``keep`` (n,) indexes the caller's tokens in the padded stream; ``pos`` (n_local,) the local tokens' positions
    in their sequences; ``blocks``: (local start, length, padded-stream key start, key length, key offset of the
    first query) per local chunk, batched over B for padded batches."""
    cp: int
    rank: int
    group: object
    padded_len: int
    local: torch.Tensor
    order: torch.Tensor
    keep: torch.Tensor
    pos: torch.Tensor
    blocks: list


_CURRENT: contextvars.ContextVar[CPLayout | None] = contextvars.ContextVar("cp_layout", default=None)
_STREAM_LEN: contextvars.ContextVar[int | None] = contextvars.ContextVar("cp_stream_len", default=None)


def current_layout() -> CPLayout | None:
    return _CURRENT.get()


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value):
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def use_layout(layout: CPLayout | None):
    """``with use_layout(layout):`` the decoder's attention layers and the CP-aware readers read the split from
    here (None: no CP)."""
    return _setting(_CURRENT, layout)


def stream_length(n: int | None):
    """``with stream_length(n):`` a packed stream is split as if padded to ``n`` tokens (a multiple of 2 x CP, at
    least its sequences' padded lengths): with PP every micro-batch of a schedule call sends one shape between
    stages, and the packed streams' own padded lengths differ. None: each stream its own length."""
    return _setting(_STREAM_LEN, n)


def _packed_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    cu = cu_seqlens.tolist()
    return [b - a for a, b in zip(cu, cu[1:])]


def packed_stream_length(cu_seqlens: torch.Tensor, cp: int) -> int:
    """The length of a packed stream (``cu_seqlens`` [n + 1]) once each sequence is padded for the CP split."""
    return sum(padded_length(n, cp) for n in _packed_lengths(cu_seqlens))


def cp_group_of_job():
    """megatron's CP group when CP > 1 (``initialize_mesh(cp=...)``), else None."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
        return None
    return ps.get_context_parallel_group()


def layout_for_batch(input_ids: torch.Tensor | None, packed_seq_params=None) -> CPLayout | None:
    """The split of one micro-batch, or None without CP: padded (B, S) rows split alike; a packed (1, T) stream
    split per packed sequence (``packed_seq_params.cu_seqlens_q``)."""
    group = cp_group_of_job()
    if group is None:
        return None
    if input_ids is None:
        raise ValueError("context parallelism needs the micro-batch's input_ids on every pipeline stage")
    if packed_seq_params is None:
        lengths = [int(input_ids.shape[1])]
    else:
        lengths = _packed_lengths(packed_seq_params.cu_seqlens_q)
        if sum(lengths) != input_ids.shape[1]:
            raise ValueError(f"packed_seq_params.cu_seqlens_q covers {sum(lengths)} tokens, the stream has "
                             f"{input_ids.shape[1]}")
    total = _STREAM_LEN.get() if packed_seq_params is not None else None
    return _cached_layout(tuple(lengths), dist.get_world_size(group), dist.get_rank(group), group, total)


@functools.lru_cache(maxsize=64)
def _cached_layout(lengths: tuple, cp: int, rank: int, group, total: int | None = None) -> CPLayout:
    """``make_layout`` once per shape: every micro-batch of a padded run has the same one, and the split's index
    lists are built in Python (its tensors are only read)."""
    return make_layout(list(lengths), cp, rank, group, total)


def _chunks(seg_start: int, seg_len: int, cp: int, rank: int) -> list[tuple[int, int, int]]:
    """(padded-stream start, length, position in the sequence) of rank ``rank``'s two chunks of one sequence of
    padded length ``seg_len`` (a multiple of 2 x cp)."""
    c = seg_len // (2 * cp)
    return [(seg_start + a * c, c, a * c) for a in (rank, 2 * cp - 1 - rank)]


def make_layout(lengths: list[int], cp: int, rank: int, group, total: int | None = None) -> CPLayout:
    """The split of a stream of sequences of ``lengths`` (one entry: a padded batch's row length) over ``cp``
    ranks: each sequence padded to a multiple of 2 x cp, two chunks per rank and sequence. ``total``: the padded
    stream's length (``stream_length``); what the sequences leave of it is one more sequence of padding only."""
    keep, starts, pos = [], [], 0
    padded = [padded_length(n, cp) for n in lengths]
    if total is not None and total != sum(padded):
        if total < sum(padded) or total % (2 * cp):
            raise ValueError(f"a packed stream of padded length {sum(padded)} cannot be split as {total} tokens over "
                             f"{cp} CP ranks (a multiple of {2 * cp}, at least the stream's)")
        lengths, padded = list(lengths) + [0], padded + [total - sum(padded)]
    for n, p in zip(lengths, padded):
        keep.extend(range(pos, pos + n))
        starts.append(pos)
        pos += p
    per_rank, blocks = [], []
    for r in range(cp):
        idx, loc = [], 0
        for s, p in zip(starts, padded):
            for start, c, first in _chunks(s, p, cp, r):
                if r == rank:
                    blocks.append((loc, c, s, first + c, first))
                idx.extend(range(start, start + c))
                loc += c
        per_rank.append(idx)
    local = torch.tensor(per_rank[rank], dtype=torch.long)
    gathered = torch.tensor([i for idx in per_rank for i in idx], dtype=torch.long)
    order = torch.empty_like(gathered)
    order[gathered] = torch.arange(gathered.numel())
    positions = torch.cat([torch.arange(b[4], b[4] + b[1]) for b in blocks])
    return CPLayout(cp, rank, group, pos, local, order, torch.tensor(keep, dtype=torch.long), positions, blocks)


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (rank-major). Backward: ``reduce`` all-reduces the gradient first
    (the gathered tensor fed different computations on each rank: K/V), else each rank's gradient of the gathered
    tensor is already the whole one (every rank ran the same loss on it: the final hidden states)."""

    @staticmethod
    def forward(ctx, x, group, reduce: bool):
        ctx.group, ctx.reduce, ctx.n = group, reduce, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.reduce:
            dist.all_reduce(grad, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[r * ctx.n:(r + 1) * ctx.n], None, None


def gather_padded_stream(x: torch.Tensor, layout: CPLayout, reduce: bool) -> torch.Tensor:
    """x (n_local, ...) of this rank -> (padded_len, ...) in stream order, every rank's tokens."""
    return _GatherSeq.apply(x, layout.group, reduce).index_select(0, layout.order.to(x.device))


def split_input(x: torch.Tensor, layout: CPLayout, dim: int, pad_value=0) -> torch.Tensor:
    """The caller's (..., n, ...) tensor along ``dim`` -> this rank's tokens (..., n_local, ...)."""
    shape = list(x.shape)
    shape[dim] = layout.padded_len
    full = torch.full(shape, pad_value, dtype=x.dtype, device=x.device)
    full.index_copy_(dim, layout.keep.to(x.device), x)
    return full.index_select(dim, layout.local.to(x.device))


def gather_tokens(x: torch.Tensor, layout: CPLayout) -> torch.Tensor:
    """This rank's per-token output (B, n_local, ...) -> (B, n, ...): every rank's tokens in the caller's layout,
    padding dropped. Backward: each rank keeps the gradient of its own tokens (every rank of the group runs the
    same loss on the gathered tensor)."""
    full = gather_padded_stream(x.transpose(0, 1), layout, reduce=False)    # (padded_len, B, ...)
    return full.index_select(0, layout.keep.to(x.device)).transpose(0, 1)


class _SumOverCP(torch.autograd.Function):
    """All-reduce (sum) over the CP group. Backward: the identity, as every rank of the group runs the same loss on
    the sum, so each rank's gradient of it is already the whole one."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def cp_sum(x: torch.Tensor, layout: CPLayout) -> torch.Tensor:
    """Per-entry sum over the CP group of values each held by one rank (zeros elsewhere)."""
    return _SumOverCP.apply(x, layout.group)


def local_index(layout: CPLayout, positions: torch.Tensor) -> torch.Tensor:
    """positions (...) in the caller's row (a padded batch's columns, or a packed stream's tokens) -> the index of
    each among this rank's tokens, -1 where another rank holds it."""
    inv = torch.full((layout.padded_len,), -1, dtype=torch.long)
    inv[layout.local] = torch.arange(layout.local.numel())
    return inv[layout.keep][positions.cpu().long()].to(positions.device)


def reads_local_tokens(fn):
    """Mark a loss or reader that takes the last stage's local outputs under CP (it reads them only through
    CP-aware readers). Returns ``fn``."""
    fn.reads_local_tokens = True
    return fn


_FALLBACK_LOGGED: set = set()


def whole_sequences(output: torch.Tensor, layout: CPLayout, fn) -> torch.Tensor:
    """The named fallback for a loss or reader not marked ``reads_local_tokens``: its output all-gathered back
    into the caller's layout. Values (B, S) cost nothing; (B, S, V) logits or hidden states are logged once."""
    name = getattr(fn, "__qualname__", repr(fn))
    if output.dim() == 3 and fn is not None and name not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(name)
        import logging

        logging.getLogger("rlhf").info("context parallelism: %s reads whole sequences, so its (B, S, %d) output is "
                                       "all-gathered on every CP rank (readers marked reads_local_tokens keep "
                                       "their tokens local)", name, output.shape[-1])
    return gather_tokens(output, layout)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout, scale: float,
                 window_left: int | None = None) -> torch.Tensor:
    """Causal attention of the local queries to the CP group's keys and values. q (n_local, B, Hq, D), k/v
    (n_local, B, Hkv, D) in megatron's sbhd layout, RoPE applied; returns (n_local, B, Hq * D). Each local chunk
    attends to its sequence's keys up to its last position (the causal mask aligned at the bottom right), and to
    no key more than ``window_left`` positions back."""
    kf = gather_padded_stream(k, layout, reduce=True)                        # (padded_len, B, Hkv, D)
    vf = gather_padded_stream(v, layout, reduce=True)
    pieces = [_attend_block(q, kf, vf, block, scale, window_left) for block in layout.blocks]
    return torch.cat(pieces, dim=0)                                           # blocks are in local order


def _attend_block(q, kf, vf, block, scale: float, window_left: int | None) -> torch.Tensor:
    """One local chunk's attention -> (c, B, Hq * D). Its own function, so that a block's scores and probabilities
    die with it; the scores are scaled and masked in place (their producers' backwards do not read them), so a
    forward holds two (B, Hkv, g*c, k_len) blocks at its peak, and the backward keeps the probabilities only."""
    loc, c, k_start, k_len, first = block
    _, b, hq, d = q.shape
    hkv = kf.shape[2]
    g = hq // hkv  # megatron's query groups: heads g*j .. g*j+g-1 share KV head j
    # (B, Hkv, g*c, D): a KV head's g query heads stacked, so K and V are never expanded to Hq heads
    qb = q[loc:loc + c].reshape(c, b, hkv, g, d).permute(1, 2, 3, 0, 4).reshape(b, hkv, g * c, d)
    kb = kf[k_start:k_start + k_len].permute(1, 2, 0, 3)                      # (B, Hkv, k_len, D)
    vb = vf[k_start:k_start + k_len].permute(1, 2, 0, 3)
    qpos = torch.arange(first, first + c, device=q.device).repeat(g).unsqueeze(1)
    kpos = torch.arange(k_len, device=q.device).unsqueeze(0)
    mask = kpos <= qpos
    if window_left is not None:
        mask &= kpos >= qpos - window_left
    scores = torch.matmul(qb, kb.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    del scores
    o = torch.matmul(probs, vb).reshape(b, hkv, g, c, d)                      # (B, Hkv, g, c, D)
    return o.permute(3, 0, 1, 2, 4).reshape(c, b, hq * d)


def decoder_forward(model, input_ids, attention_mask, layout: CPLayout) -> torch.Tensor:
    """``LlamaGPT.forward`` under CP, up to the head: the decoder on this rank's tokens, which it sees as a plain
    (S_local, B) batch with the RoPE frequencies of their true positions. Returns (S_local, B, H)."""
    if model.pre_process:
        input_ids = split_input(input_ids, layout, dim=1)
        position_ids = layout.pos.to(input_ids.device).unsqueeze(0).expand_as(input_ids)
        decoder_input = model.embedding(input_ids=input_ids, position_ids=position_ids)
    else:
        decoder_input = None  # the previous stage's output, set by megatron's schedule
    rotary = rotary_for_layout(model.rotary_pos_emb, layout, next(model.parameters()).device)
    with use_layout(layout):
        hidden = model.decoder(hidden_states=decoder_input, attention_mask=attention_mask, rotary_pos_emb=rotary)
    return hidden


def rotary_for_layout(rotary_module, layout: CPLayout, device) -> torch.Tensor:
    """megatron's RoPE frequencies (n_local, 1, 1, D) at the local tokens' positions in their sequences."""
    longest = int(layout.pos.max()) + 1 if layout.pos.numel() else 1
    emb = rotary_module.get_emb(longest)                                      # (longest, 1, 1, D)
    return emb.index_select(0, layout.pos.to(emb.device)).to(device)


def padded_length(n: int, cp: int) -> int:
    return max(2 * cp, math.ceil(n / (2 * cp)) * 2 * cp)


def check_cp_flags(cp: int, spec, flag: str) -> None:
    """What context parallelism does not do, refused by name before any model loads (the layout's own limits:
    ``rlhf.distributed.mesh.validate_layout``)."""
    if cp == 1:
        return
    if spec.attention_dropout > 0:
        raise ValueError(f"--context_parallel_size {cp} with {flag}: attention_dropout={spec.attention_dropout} is not "
                         "supported with context parallelism while training")
