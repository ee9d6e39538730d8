"""Collate: right padding for SFT/RM (chosen then rejected in one batch), left padding for prompts."""
from types import SimpleNamespace

import pytest
import torch

from rlhf.data import PromptSample, RMSample, SFTSample, collate_prompts, collate_rm, collate_sft, pad_token_id


def _sft(ids, plen):
    ids = torch.tensor(ids, dtype=torch.int32)
    mask = torch.arange(len(ids)) >= plen
    return SFTSample(ids, mask, plen, "t")


def test_sft_right_pads_and_keeps_masks_aligned():
    b = collate_sft([_sft([5, 6, 7, 2], 2), _sft([8, 9, 2], 1)], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 2], [8, 9, 2, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 0]]
    assert b["prompt_lens"].tolist() == [2, 1]
    assert (b["input_ids"].dtype, b["attention_mask"].dtype, b["loss_mask"].dtype) == (torch.long, torch.long,
                                                                                       torch.float32)


def test_pad_to_multiple_of():
    b = collate_sft([_sft([5, 6, 7, 2, 2], 2)], pad_id=0, pad_to_multiple_of=4)
    assert b["input_ids"].shape == (1, 8) and b["attention_mask"].sum() == 5 and b["loss_mask"].sum() == 3
    assert collate_sft([_sft([5, 6, 7, 2], 2)], pad_id=0, pad_to_multiple_of=4)["input_ids"].shape == (1, 4)


def test_rm_stacks_chosen_then_rejected():
    t = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    samples = [RMSample(t([1, 2, 3]), t([1, 4]), 0.5, "a"), RMSample(t([5, 2]), t([5, 6, 7, 8, 2]), None, "b")]
    b = collate_rm(samples, pad_id=0, pad_to_multiple_of=2)
    assert b["input_ids"].shape == (4, 6)  # (2B, S)
    assert b["input_ids"][:, :5].tolist() == [[1, 2, 3, 0, 0], [5, 2, 0, 0, 0], [1, 4, 0, 0, 0], [5, 6, 7, 8, 2]]
    assert (b["attention_mask"].sum(-1) - 1).tolist() == [2, 1, 1, 4]  # last real token of each row
    assert b["margin"].tolist() == [0.5, 0.0]


def test_prompts_are_left_padded():
    t = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    b = collate_prompts([PromptSample(t([3, 4, 5]), "", None, "a"), PromptSample(t([6]), "", None, "b")], pad_id=0)
    assert b["input_ids"].tolist() == [[3, 4, 5], [0, 0, 6]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_pad_id_falls_back_to_eos(tok):
    assert pad_token_id(tok) == tok.pad_token_id == 0
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=2, name_or_path="x")) == 2
    with pytest.raises(ValueError, match="neither a pad_token nor an eos_token"):
        pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None, name_or_path="x"))
