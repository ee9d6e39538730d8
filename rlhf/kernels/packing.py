"""Sequence packing (THD layout) and token-balanced micro-batching.

Packing concatenates variable-length sequences into one flat stream of T tokens with no padding, described
by `cu_seqlens` (`[B + 1]` int32, cu_seqlens[i] = start of sequence i, cu_seqlens[B] = T), the layout of
flash-attn's varlen functions and megatron's `PackedSeqParams(qkv_format="thd")`. Position ids restart at 0
for every sequence so rotary embeddings see each sequence as if it were alone.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass
class PackedBatch:
    """A packed batch.

    values: `[T, *F]` the packed per-token tensor (token ids, hidden states, ...).
    cu_seqlens: `[B + 1]` int32 on values' device.
    max_seqlen: longest sequence length (a Python int, as flash-attn wants).
    position_ids: `[T]` int64, 0..L_i-1 within each sequence.
    """

    values: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    position_ids: Tensor

    @property
    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


def cu_seqlens_from_lengths(lengths: Sequence[int] | Tensor, device: torch.device | str | None = None) -> Tensor:
    """`[B]` lengths -> `[B + 1]` int32 cumulative lengths starting at 0."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64, device=device)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu


def position_ids_from_cu_seqlens(cu_seqlens: Tensor, total: int | None = None) -> Tensor:
    """`[B + 1]` cu_seqlens -> `[T]` int64 position ids restarting at 0 at every sequence start."""
    cu = cu_seqlens.long()
    total = int(cu[-1]) if total is None else total
    lengths = cu[1:] - cu[:-1]
    # position = global index - start of the sequence the token belongs to
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu.device) - starts


def _packed(values: Tensor, lengths: Tensor) -> PackedBatch:
    cu = cu_seqlens_from_lengths(lengths, device=values.device)
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    return PackedBatch(values, cu, max_seqlen, position_ids_from_cu_seqlens(cu, values.shape[0]))


def pack_sequences(seqs: Sequence[Tensor]) -> PackedBatch:
    """Concatenate B tensors `[L_i, *F]` into one `[sum L_i, *F]` stream."""
    if not seqs:
        raise ValueError("pack_sequences needs at least one sequence")
    lengths = torch.tensor([s.shape[0] for s in seqs], dtype=torch.int64)
    return _packed(torch.cat(list(seqs), dim=0), lengths)


def _check_contiguous_mask(mask: Tensor) -> None:
    # Valid tokens of every row must form one run (right or left padding), or positions would be wrong.
    idx = torch.arange(mask.shape[1], device=mask.device)
    lengths = mask.sum(1)
    first = torch.where(mask, idx, mask.shape[1]).amin(1)
    last = torch.where(mask, idx, -1).amax(1)
    bad = (lengths > 0) & (last - first + 1 != lengths)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(f"attention_mask rows {rows} are not one contiguous run of ones (need right or left padding)")


def pack_padded(padded: Tensor, attention_mask: Tensor) -> PackedBatch:
    """Drop the padding of a `[B, L, *F]` batch (right- or left-padded) into a `[T, *F]` stream.

    attention_mask: `[B, L]`, 1 for real tokens. Rows with no real token become empty sequences.
    Inverse: `unpack_padded(packed.values, attention_mask)`.
    """
    if attention_mask.shape != padded.shape[:2]:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match the first two dims of "
                         f"padded {tuple(padded.shape)}")
    mask = attention_mask.bool()
    _check_contiguous_mask(mask)
    # Boolean indexing walks rows in order, so each sequence's tokens stay contiguous and in order.
    return _packed(padded[mask], mask.sum(1))


def unpack_padded(values: Tensor, attention_mask: Tensor, pad_value: float = 0) -> Tensor:
    """Scatter a packed `[T, *F]` stream back into `[B, L, *F]` at the ones of `attention_mask` `[B, L]`."""
    mask = attention_mask.bool()
    out = values.new_full((*mask.shape, *values.shape[1:]), pad_value)
    out[mask] = values
    return out


def unpack_sequences(values: Tensor, cu_seqlens: Tensor) -> list[Tensor]:
    """Split a packed `[T, *F]` stream into B views `[L_i, *F]`."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return list(torch.split(values, lengths, dim=0))


def packed_next_tokens(tokens: Tensor, cu_seqlens: Tensor, fill_value: int = 0) -> tuple[Tensor, Tensor]:
    """Next-token targets in a packed stream, never crossing a sequence boundary.

    Returns (targets `[T]`, valid `[T]` bool): targets[t] = tokens[t + 1] within the sequence; the last token
    of each sequence has no target (valid False, target `fill_value`).
    """
    targets = torch.full_like(tokens, fill_value)
    targets[:-1] = tokens[1:]
    valid = torch.ones_like(tokens, dtype=torch.bool)
    ends = cu_seqlens[1:].long() - 1
    ends = ends[ends >= cu_seqlens[:-1].long()]  # skip empty sequences
    valid[ends] = False
    targets[ends] = fill_value
    return targets, valid


def balance_microbatches(
    seq_lens: Sequence[int], max_tokens_per_microbatch: int, dp_size: int = 1
) -> list[list[list[int]]]:
    """Split sequences into token-balanced micro-batches (dynamic batch size), per data-parallel rank.

    Args:
        seq_lens: length of each sequence.
        max_tokens_per_microbatch: token budget of one micro-batch (the `--max_tokens_per_microbatch` flag).
        dp_size: number of data-parallel ranks.

    Returns:
        `result[rank][mb]` = sorted indices into `seq_lens`. Every rank gets the same number of micro-batches
        so that ranks stay in lockstep; micro-batch token counts are about equal and never exceed the budget.
        A micro-batch is empty only when there are fewer sequences than dp_size * micro-batches per rank;
        callers must still step through it (e.g. with a zero-weight dummy) to stay in lockstep.

    Method: k = the fewest micro-batches per rank the token total allows; partition all sequences into
    dp_size * k bins (Karmarkar-Karp largest differencing, or greedy LPT for very large inputs); while a bin
    exceeds the budget, k += 1. Bins are then dealt to ranks heaviest first, each to the lightest rank
    with room, which balances tokens per rank too.
    """
    if max_tokens_per_microbatch <= 0:
        raise ValueError(f"--max_tokens_per_microbatch must be positive, got {max_tokens_per_microbatch}")
    if dp_size <= 0:
        raise ValueError(f"dp_size must be positive, got {dp_size}")
    lens = [int(n) for n in seq_lens]
    too_long = [n for n in lens if n > max_tokens_per_microbatch]
    if too_long:
        raise ValueError(
            f"a sequence of {max(too_long)} tokens exceeds --max_tokens_per_microbatch={max_tokens_per_microbatch}; "
            "raise the flag or truncate the sequences"
        )
    if not lens:
        return [[] for _ in range(dp_size)]
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    k = max(1, math.ceil(sum(lens) / (dp_size * max_tokens_per_microbatch)))
    while True:
        bins = _partition(order, lens, dp_size * k)
        if max(load for load, _ in bins) <= max_tokens_per_microbatch:
            break
        k += 1
    # Deal bins to ranks: heaviest bin to the lightest rank that still has fewer than k bins.
    bins.sort(key=lambda b: (-b[0], b[1]))
    rank_load = [0] * dp_size
    result: list[list[list[int]]] = [[] for _ in range(dp_size)]
    for load, members in bins:
        rank = min((r for r in range(dp_size) if len(result[r]) < k), key=lambda r: (rank_load[r], r))
        rank_load[rank] += load
        result[rank].append(sorted(members))
    return result


# Karmarkar-Karp costs O(n_seqs * n_bins) Python work (about 1 s at 2M); above that, greedy LPT.
KK_MAX_WORK = 1 << 21


def _partition(order: list[int], lens: list[int], n_bins: int) -> list[tuple[int, list[int]]]:
    """Split sequences (indices, longest first) into n_bins sets of about equal total length: (load, members)."""
    if len(order) * n_bins <= KK_MAX_WORK:
        return _karmarkar_karp(order, lens, n_bins)
    return _lpt(order, lens, n_bins)


def _karmarkar_karp(order: list[int], lens: list[int], n_bins: int) -> list[tuple[int, list[int]]]:
    """Largest differencing method for multiway partitioning.

    Each sequence starts as a partial partition (its length in one bin, the others empty). Repeatedly the
    two partials with the largest spread (max bin - min bin) are merged, heaviest bin of one with the
    lightest of the other, which cancels their imbalance. Members are kept as nested pairs so a merge
    costs O(n_bins), not a list copy.
    """
    empty = [(0, None)] * (n_bins - 1)
    heap = [(-lens[i], c, [(lens[i], i), *empty]) for c, i in enumerate(order)]
    heapq.heapify(heap)  # (-spread, tie-breaker, bins sorted heaviest first)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(la + lb, (ma, mb)) for (la, ma), (lb, mb) in zip(a, reversed(b))]
        merged.sort(key=lambda t: -t[0])
        counter += 1
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], counter, merged))
    out = []
    for load, tree in heap[0][2]:
        members, stack = [], [tree]
        while stack:
            node = stack.pop()
            if isinstance(node, tuple):
                stack.extend(node)
            elif node is not None:
                members.append(node)
        out.append((load, members))
    return out


def _lpt(order: list[int], lens: list[int], n_bins: int) -> list[tuple[int, list[int]]]:
    """Longest-processing-time greedy: each sequence (longest first) into the least-loaded bin."""
    heap = [(0, b) for b in range(n_bins)]  # (load, bin id); ties go to the lower id, deterministic
    members: list[list[int]] = [[] for _ in range(n_bins)]
    for i in order:
        load, b = heapq.heappop(heap)
        members[b].append(i)
        heapq.heappush(heap, (load + lens[i], b))
    loads = dict((b, load) for load, b in heap)
    return [(loads[b], members[b]) for b in range(n_bins)]
