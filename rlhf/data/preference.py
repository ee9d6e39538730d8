"""Datasets for offline preference training: DPO pairs with response masks, and KTO's unpaired samples.

    pairs, stats = build_dpo_dataset(cfg, tokenizer)            # the RM pipeline (same flags), + prompt lengths
    batch = collate_dpo(pairs, pad_id)                          # (2B, S): chosen rows, then rejected rows
    samples, stats = build_kto_dataset(cfg, tokenizer, "label") # SFT-style records + a boolean label
    batch = collate_kto(samples, pad_id, max_len)               # (2B, S): samples, then mismatched KL rows

Every row is ``prompt + response + eos`` (tokenized as in rlhf/data/formatting.py) and ``loss_mask`` is 1 on the
response tokens, so a sequence log-prob is ``(next_token_logprobs * loss_mask[:, 1:]).sum(-1)``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from numbers import Real
from typing import TYPE_CHECKING, Sequence

import torch

from rlhf.data.build import (DataStats, _check_tokenizer, _finish, count_untrainable, load_records, response_tokenized,
                             truncated_pair)
from rlhf.data.collate import padded_length, pad_sequences
from rlhf.data.config import DataConfig
from rlhf.data.formatting import sft_sample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass
class PairSample:
    """``chosen_ids`` / ``rejected_ids`` (S,) int32, each prompt + response + eos, and their prompt lengths."""

    chosen_ids: torch.Tensor
    rejected_ids: torch.Tensor
    chosen_prompt_len: int
    rejected_prompt_len: int
    origin: str


@dataclass
class KTOSample:
    """``input_ids`` (S,) int32 = prompt + completion + eos; ``prompt_len``; ``label`` True when desirable."""

    input_ids: torch.Tensor
    prompt_len: int
    label: bool
    origin: str


def build_dpo_dataset(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[list[PairSample], DataStats]:
    """Preference pairs as for the reward model (``--prompt_key``/``--chosen_key``/``--rejected_key``,
    ``--apply_chat_template``), keeping where each response starts. Truncation as in ``build_rm_dataset``."""
    _check_tokenizer(tokenizer)
    records, stats = load_records(cfg, "rm")
    out = []
    for r in records:
        sides = truncated_pair(r, cfg, tokenizer, stats)
        if sides is None:
            continue
        (c, c_plen), (j, j_plen) = sides
        out.append(PairSample(torch.tensor(c, dtype=torch.int32), torch.tensor(j, dtype=torch.int32), c_plen, j_plen,
                              r.where))
    return _finish(out, stats, cfg, "max_len")


def label_problem(data: dict, label_key: str) -> str | None:
    """Why ``data[label_key]`` is not a KTO label (a boolean, or the number 0 or 1), or None."""
    if label_key not in data:
        return f"missing key {label_key!r} (--label_key)"
    v = data[label_key]
    if isinstance(v, bool) or (isinstance(v, Real) and v in (0, 1)):
        return None
    return f"key {label_key!r} (--label_key) must be true/false or 0/1, got {v!r}"


def build_kto_dataset(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase,
                      label_key: str) -> tuple[list[KTOSample], DataStats]:
    """Unpaired samples: ``--input_key`` (prompt), ``--output_key`` (completion) and ``--label_key`` (desirable
    or not). Truncation as for SFT: the first ``max_len`` tokens; a sample with no completion token left is
    dropped. A bad label fails naming file, line and key, unless ``skip_bad_samples``."""
    _check_tokenizer(tokenizer)
    records, stats = load_records(cfg, "sft")
    out = []
    for r in records:
        problem = label_problem(r.data, label_key)
        if problem:
            if not cfg.skip_bad_samples:
                raise ValueError(f"{r.where}: {problem} (pass --skip_bad_samples to skip and count such records)")
            stats.num_bad_skipped += 1
            continue
        s, too_long = sft_sample(r, cfg, tokenizer)
        ids = s.input_ids
        if not response_tokenized(ids.numel(), s.prompt_len):
            count_untrainable(stats, r.where)
            continue
        if too_long:
            stats.num_truncated += 1
            if s.prompt_len >= cfg.max_len:
                stats.num_dropped += 1
                continue
            ids = ids[: cfg.max_len]
        out.append(KTOSample(ids, s.prompt_len, bool(r.data[label_key]), r.where))
    if out and (all(s.label for s in out) or not any(s.label for s in out)):
        log.warning("KTO data has only %s samples", "desirable" if out[0].label else "undesirable")
    return _finish(out, stats, cfg, "max_len")


def _rows(seqs: Sequence[torch.Tensor], prompt_lens: Sequence[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded rows with a response mask: input_ids, attention_mask (B, S) long, loss_mask (B, S) float32."""
    length = padded_length([s.numel() for s in seqs])
    input_ids = pad_sequences(seqs, pad_id, length, dtype=torch.long)
    attention_mask = pad_sequences([torch.ones(s.numel(), dtype=torch.long) for s in seqs], 0, length)
    masks = []
    for s, p in zip(seqs, prompt_lens):
        m = torch.zeros(s.numel(), dtype=torch.float32)
        m[p:] = 1.0
        masks.append(m)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "loss_mask": pad_sequences(masks, 0.0, length)}


def collate_dpo(samples: Sequence[PairSample], pad_id: int) -> dict[str, torch.Tensor]:
    """Chosen and rejected in one batch, one forward: rows ``[:B]`` chosen, ``[B:]`` rejected (pair ``b`` at rows
    ``b`` and ``B + b``). ``input_ids``/``attention_mask`` (2B, S) long, ``loss_mask`` (2B, S) float32."""
    seqs = [s.chosen_ids for s in samples] + [s.rejected_ids for s in samples]
    plens = [s.chosen_prompt_len for s in samples] + [s.rejected_prompt_len for s in samples]
    return _rows(seqs, plens, pad_id)


def collate_kto(samples: Sequence[KTOSample], pad_id: int, max_len: int) -> dict[str, torch.Tensor]:
    """Rows ``[:B]`` are the samples; rows ``[B:]`` are KTO's mismatched pairs for the KL reference point: prompt
    ``b`` with the completion of sample ``(b + 1) % B`` (the micro-batch shifted by one, as TRL/OpenRLHF do),
    cut to ``max_len``. ``labels`` (B,) bool. Needs B >= 2 for the pairs to be mismatched."""
    b = len(samples)
    kl_seqs, kl_plens = [], []
    for i, s in enumerate(samples):
        other = samples[(i + 1) % b]
        kl_seqs.append(torch.cat([s.input_ids[: s.prompt_len], other.input_ids[other.prompt_len:]])[:max_len])
        kl_plens.append(s.prompt_len)
    out = _rows([s.input_ids for s in samples] + kl_seqs, [s.prompt_len for s in samples] + kl_plens, pad_id)
    out["labels"] = torch.tensor([s.label for s in samples], dtype=torch.bool)
    return out
