"""Packing (THD), unpacking, position ids, next-token targets and the micro-batch balancer."""

from __future__ import annotations

import random

import pytest
import torch

import rlhf.kernels as kernels
from rlhf.kernels import (
    balance_microbatches,
    pack_padded,
    pack_sequences,
    packed_next_tokens,
    position_ids_from_cu_seqlens,
    unpack_padded,
    unpack_sequences,
)


def test_pack_sequences_round_trip():
    seqs = [torch.arange(5), torch.arange(10, 13), torch.arange(20, 21)]
    packed = pack_sequences(seqs)
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 5, 8, 9]
    assert packed.max_seqlen == 5 and packed.seq_lens == [5, 3, 1]
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0]
    for a, b in zip(unpack_sequences(packed.values, packed.cu_seqlens), seqs):
        assert torch.equal(a, b)


def test_pack_sequences_with_feature_dims():
    seqs = [torch.randn(4, 3), torch.randn(2, 3)]
    packed = pack_sequences(seqs)
    assert packed.values.shape == (6, 3)
    assert torch.equal(unpack_sequences(packed.values, packed.cu_seqlens)[1], seqs[1])


@pytest.mark.parametrize("side", ["right", "left"])
def test_pack_padded_round_trip(side):
    lengths = [3, 6, 1, 4]
    batch, mask = torch.zeros(4, 6, dtype=torch.long), torch.zeros(4, 6, dtype=torch.long)
    seqs = [torch.randint(1, 100, (n,)) for n in lengths]
    for i, s in enumerate(seqs):
        span = slice(0, len(s)) if side == "right" else slice(6 - len(s), 6)
        batch[i, span], mask[i, span] = s, 1
    packed = pack_padded(batch, mask)
    assert packed.cu_seqlens.tolist() == [0, 3, 9, 10, 14]
    assert torch.equal(packed.values, torch.cat(seqs))  # no pad token survives
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 0, 1, 2, 3]
    assert torch.equal(unpack_padded(packed.values, mask), batch)
    assert torch.equal(unpack_padded(packed.values.float(), mask, pad_value=-1.0)[mask == 0],
                       torch.full((int((mask == 0).sum()),), -1.0))


def test_pack_padded_rejects_holes():
    mask = torch.tensor([[1, 0, 1, 0]])
    with pytest.raises(ValueError, match="contiguous"):
        pack_padded(torch.zeros(1, 4), mask)


def test_position_ids_with_empty_sequence():
    cu = kernels.cu_seqlens_from_lengths([2, 0, 3])
    assert position_ids_from_cu_seqlens(cu).tolist() == [0, 1, 0, 1, 2]


def test_packed_next_tokens():
    packed = pack_sequences([torch.tensor([1, 2, 3]), torch.tensor([7]), torch.tensor([8, 9])])
    targets, valid = packed_next_tokens(packed.values, packed.cu_seqlens, fill_value=-1)
    assert targets.tolist() == [2, 3, -1, -1, 9, -1]
    assert valid.tolist() == [True, True, False, False, True, False]


def _check_balance(seq_lens, limit, dp, result):
    assert len(result) == dp
    n_mb = {len(r) for r in result}
    assert len(n_mb) == 1, "every DP rank must get the same number of micro-batches"
    seen = sorted(i for r in result for mb in r for i in mb)
    assert seen == list(range(len(seq_lens))), "each sequence exactly once"
    loads = [sum(seq_lens[i] for i in mb) for r in result for mb in r]
    assert max(loads) <= limit
    return loads


@pytest.mark.parametrize("method", ["karmarkar_karp", "lpt"])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_balance_microbatches_properties(dp, method, monkeypatch):
    if method == "lpt":
        monkeypatch.setattr(kernels.packing, "KK_MAX_WORK", 0)
    rng = random.Random(dp)
    seq_lens = [rng.randint(1, 512) for _ in range(64)]
    limit = 1024
    result = balance_microbatches(seq_lens, limit, dp_size=dp)
    loads = _check_balance(seq_lens, limit, dp, result)
    # At most one micro-batch per rank above the lower bound the token total sets, about equally full.
    lower = -(-sum(seq_lens) // (dp * limit))
    assert lower <= len(result[0]) <= lower + (method == "lpt")
    assert max(loads) - min(loads) <= (0.08 if method == "karmarkar_karp" else 0.25) * limit
    rank_loads = [sum(seq_lens[i] for mb in r for i in mb) for r in result]
    assert max(rank_loads) - min(rank_loads) <= 0.05 * sum(seq_lens) / dp
    assert balance_microbatches(seq_lens, limit, dp_size=dp) == result  # deterministic


def test_balance_microbatches_lockstep_with_few_sequences():
    result = balance_microbatches([10, 10, 10], 10, dp_size=2)
    _check_balance([10, 10, 10], 10, 2, result)
    assert sorted(len(mb) for r in result for mb in r) == [0, 1, 1, 1]  # one empty micro-batch keeps lockstep


def test_balance_microbatches_too_long_names_flag():
    with pytest.raises(ValueError, match=r"--max_tokens_per_microbatch=100\b"):
        balance_microbatches([50, 101], 100)
    with pytest.raises(ValueError, match="--max_tokens_per_microbatch"):
        balance_microbatches([5], 0)
