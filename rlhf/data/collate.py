"""Collate samples into padded tensors. SFT and RM pad on the right; PPO prompts on the left (for generation).

    pad_id = pad_token_id(tokenizer)
    batch = collate_sft([samples[i] for i in micro_batch], pad_id, pad_to_multiple_of=8)

Masks follow the sequence positions: ``loss_mask[b, t] == 1`` means token ``input_ids[b, t]`` is a target, so a
next-token loss on ``logits[:, :-1]`` against ``input_ids[:, 1:]`` uses ``loss_mask[:, 1:]``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from rlhf.data.formatting import PromptSample, RMSample, SFTSample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokenizer's pad id, falling back to its eos id (padding is masked out either way)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has neither a pad_token nor an eos_token")
    return int(pad)


def padded_length(lengths: Sequence[int], pad_to_multiple_of: int | None = None) -> int:
    """The longest length, rounded up to a multiple of ``pad_to_multiple_of`` when given."""
    n = max(lengths)
    if pad_to_multiple_of:
        n = -(-n // pad_to_multiple_of) * pad_to_multiple_of
    return n


def pad_sequences(seqs: Sequence[torch.Tensor], value: int | float | bool, length: int,
                  side: str = "right", dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stack 1-D tensors of lengths <= ``length`` into (B, length), filling with ``value`` on ``side``."""
    out = torch.full((len(seqs), length), value, dtype=dtype or seqs[0].dtype)
    for b, s in enumerate(seqs):
        n = s.numel()
        if side == "right":
            out[b, :n] = s
        elif side == "left":
            out[b, length - n:] = s
        else:
            raise AssertionError(f"side must be 'right' or 'left', got {side!r}")
    return out


def _ids_and_attention(seqs: Sequence[torch.Tensor], pad_id: int, length: int,
                       side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    ids = pad_sequences(seqs, pad_id, length, side, dtype=torch.long)  # (B, S)
    ones = [torch.ones(s.numel(), dtype=torch.long) for s in seqs]
    return ids, pad_sequences(ones, 0, length, side)  # (B, S), (B, S)


def collate_sft(samples: Sequence[SFTSample], pad_id: int,
                pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded SFT batch.

    Returns ``input_ids`` (B, S) long, ``attention_mask`` (B, S) long, ``loss_mask`` (B, S) float32 (1 on
    response tokens), ``prompt_lens`` (B,) long.
    """
    seqs = [s.input_ids for s in samples]
    length = padded_length([s.numel() for s in seqs], pad_to_multiple_of)
    input_ids, attention_mask = _ids_and_attention(seqs, pad_id, length)
    loss_mask = pad_sequences([s.loss_mask for s in samples], False, length).float()  # (B, S)
    prompt_lens = torch.tensor([s.prompt_len for s in samples], dtype=torch.long)
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
           "prompt_lens": prompt_lens}
    out.update(vision_entries([s.mm for s in samples], input_ids))
    return out


def vision_entries(mms: Sequence[dict | None], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A vision-language batch's images and 3-D positions (``rlhf.models.vlm.vision_batch``) when any row has
    images; nothing otherwise."""
    first = next((m for m in mms if m), None)
    if first is None:
        return {}
    from rlhf.models.vlm import vision_batch

    return vision_batch(mms, input_ids, first["image_token_id"], first["merge"])


def collate_rm(samples: Sequence[RMSample], pad_id: int,
               pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Chosen and rejected stacked into one right-padded batch so the reward model runs one forward.

    Returns ``input_ids`` (2B, S) long (rows ``[:B]`` chosen, ``[B:]`` rejected, pair ``b`` at rows ``b`` and
    ``B + b``), ``attention_mask`` (2B, S) long, ``margin`` (B,) float32 (0 where the data gives none, which makes
    the margin loss the plain one). The reward of a row is read at its last real token,
    ``attention_mask.sum(-1) - 1``.
    """
    seqs = [s.chosen_ids for s in samples] + [s.rejected_ids for s in samples]
    length = padded_length([s.numel() for s in seqs], pad_to_multiple_of)
    input_ids, attention_mask = _ids_and_attention(seqs, pad_id, length)
    margin = torch.tensor([0.0 if s.margin is None else s.margin for s in samples], dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "margin": margin}


def collate_prompts(samples: Sequence[PromptSample], pad_id: int,
                    pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Left-padded prompts (generation appends on the right): ``input_ids`` (B, S), ``attention_mask`` (B, S)."""
    seqs = [s.prompt_ids for s in samples]
    length = padded_length([s.numel() for s in seqs], pad_to_multiple_of)
    input_ids, attention_mask = _ids_and_attention(seqs, pad_id, length, side="left")
    return {"input_ids": input_ids, "attention_mask": attention_mask}
