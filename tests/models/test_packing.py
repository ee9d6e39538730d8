"""Padding-free packed sequences (THD) in the megatron model: packed == padded, forward and backward.

One 2-rank torchrun job (tests/models/_packing_worker.py, ~15 s) checks TP1 (causal LM with GQA, value head,
list input, the ValueErrors, the unpacked path unchanged bit for bit), TP2 and PP2 with ``pad_to``; the
batch helpers are tested here in-process.
"""
import json
import os

import pytest
import torch
from helpers import REPO, run_torchrun, tail

from rlhf.models.packing import DUMMY_CHUNK, make_packed_batch, packed_to_padded, split_packed

LAYOUTS = ["tp1", "tp2", "pp2"]


@pytest.fixture(scope="module")
def result(tiny_models):
    proc = run_torchrun(os.path.join(REPO, "tests/models/_packing_worker.py"), 2, [str(tiny_models)], timeout=300)
    assert proc.returncode == 0, tail(proc)
    with open(os.path.join(tiny_models, "packing_tp1_tp2_pp2.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("head", ["lm", "value"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_forward_backward_matches_padded(result, layout, head):
    r = {k.split("/")[-1]: v for k, v in result.items() if k.startswith(f"{layout}/{head}/")}
    assert r["num_params"] > 0 and r["grad_min_ref_norm"] > 0  # every parameter got a gradient
    assert r["out_max_abs_diff"] <= 1e-5  # per-token next-token log-probs (lm) or values, fp32
    assert r["loss_abs_diff"] <= 1e-4
    assert r["grad_max_rel_diff"] <= 1e-5


def test_list_input_and_unchanged_unpacked_path(result):
    assert result["tp1/misc/list_input_max_abs_diff"] <= 1e-5
    assert result["tp1/misc/unpacked_bit_identical"] is True


def test_packed_mode_value_errors(result):
    assert "sliding_window=8" in result["tp1/misc/sliding_window_error"]
    assert result["tp1/misc/short_window_max_abs_diff"] <= 1e-5  # windows longer than every sequence are fine
    assert "max_seqlen_q" in result["tp1/misc/max_seqlen_eq_T_error"]


def test_make_packed_batch_from_sequences_with_pad_to():
    seqs = [torch.tensor([5, 6, 7]), torch.tensor([], dtype=torch.long), torch.tensor([8, 9, 10, 11, 12])]
    b = make_packed_batch(seqs, pad_to=12, pad_token_id=1, per_token={"loss_mask": [torch.ones(3), torch.ones(0),
                                                                                     torch.ones(5)]})
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 1, 1, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]]
    p = b["packed_seq_params"]
    assert p.qkv_format == "thd" and p.cu_seqlens_q.tolist() == [0, 3, 3, 8, 12] and p.cu_seqlens_kv is p.cu_seqlens_q
    assert p.max_seqlen_q == p.max_seqlen_kv == 5 and p.cu_seqlens_q.dtype == torch.int32
    assert b["cu_seqlens"].tolist() == [0, 3, 3, 8] and b["num_tokens"] == 8
    assert b["loss_mask"].tolist() == [[1.0] * 8 + [0.0] * 4]
    assert "attention_mask" not in b
    parts = split_packed(b, torch.arange(12.0).view(1, 12, 1))
    assert [t.flatten().tolist() for t in parts] == [[0, 1, 2], [], [3, 4, 5, 6, 7]]


def test_pad_to_splits_long_padding_into_bounded_dummy_sequences():
    b = make_packed_batch([torch.arange(10), torch.arange(7)], pad_to=17 + 2 * DUMMY_CHUNK + 5)
    cu = b["packed_seq_params"].cu_seqlens_q.tolist()
    assert cu == [0, 10, 17, 17 + DUMMY_CHUNK, 17 + 2 * DUMMY_CHUNK, 17 + 2 * DUMMY_CHUNK + 5]
    assert b["packed_seq_params"].max_seqlen_q == DUMMY_CHUNK
    assert make_packed_batch([torch.arange(10)], pad_to=10)["packed_seq_params"].cu_seqlens_q.tolist() == [0, 10]
    with pytest.raises(ValueError, match="pad_to=9"):
        make_packed_batch([torch.arange(10)], pad_to=9)


def test_make_packed_batch_from_padded_round_trip():
    ids = torch.tensor([[4, 5, 6, 0], [0, 0, 7, 8], [9, 10, 11, 12]])  # right, left and no padding
    mask = ids != 0
    b = make_packed_batch(ids, mask, per_token={"w": ids.float() * 2})
    assert b["input_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11, 12]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert torch.equal(packed_to_padded(b, b["w"].unsqueeze(-1)).squeeze(-1), ids.float() * 2)
    assert torch.equal(packed_to_padded(b, b["input_ids"]), ids)
    with pytest.raises(ValueError, match="attention_mask"):
        make_packed_batch([torch.arange(3)], torch.ones(1, 3))
