"""From ``DataConfig`` to a list of tokenized samples: read -> check -> mix -> tokenize -> truncate.

    samples, stats = build_sft_dataset(cfg, tokenizer)     # list[SFTSample]
    samples, stats = build_rm_dataset(cfg, tokenizer)      # list[RMSample]
    samples, stats = build_prompt_dataset(cfg, tokenizer)  # list[PromptSample]
    log.info("data: %s", stats.as_metrics())

Every file is checked to exist before any is read, and every record of every file is checked (keys present,
fields non-blank, types right) before any is tokenized, so bad data fails in seconds, not after an hour of
tokenizing. A bad record raises ``ValueError`` naming file, line/row and key, unless ``skip_bad_samples``.

Truncation (SFT and RM) keeps the first ``max_len`` tokens. A sample with no response token left after that
(the prompt alone fills ``max_len``) teaches nothing and is dropped; for RM the pair is dropped when either side
has no response token left. ``num_truncated`` counts every sample longer than ``max_len``, ``num_dropped`` the
subset that was dropped. PPO prompts are left-truncated to ``prompt_max_len`` and never dropped.

A sample whose (non-blank) response tokenizes to no token, or a prompt that tokenizes to nothing, is refused with
a count (``ValueError`` naming the first): with a working tokenizer that cannot happen, so the tokenizer of
``--pretrain`` is broken (transformers builds an empty one from a folder without tokenizer files for some families).
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from rlhf.data.config import DataConfig
from rlhf.data.formatting import (PromptSample, RMSample, SFTSample, prompt_sample, record_problem, rm_sides,
                                  sft_sample)
from rlhf.data import presets
from rlhf.data.mixing import mix
from rlhf.data.sources import Record, check_sources_exist, read_source

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
_KEY_FLAGS = {"sft": "--input_key/--output_key (--apply_chat_template for message lists)",
              "rm": "--prompt_key/--chosen_key/--rejected_key (--apply_chat_template for message lists)",
              "prompt": "--input_key (PPO: the prompt field)"}
_SKIP_HINT = "(pass --skip_bad_samples to skip and count such records)"
_LOGGED_BAD = 5  # with skip_bad_samples, how many bad records are named in the log


@dataclass
class DataStats:
    """Counts for logging. ``num_samples`` is what the trainer gets."""

    num_records: int = 0      # records read from all files
    num_bad_skipped: int = 0  # bad records skipped (only with skip_bad_samples)
    num_mixed: int = 0        # records chosen by mixing (min(valid, max_samples), with repeats if upsampled)
    num_truncated: int = 0    # samples longer than max_len (SFT/RM) or prompt_max_len (PPO)
    num_dropped: int = 0      # of those, dropped because no response token was left
    num_untrainable: int = 0  # samples whose response (PPO: prompt) tokenized to no token: refused
    first_untrainable: str = ""  # where the first of them is
    num_samples: int = 0
    per_dataset: dict[str, int] = field(default_factory=dict)  # spec -> records it contributed to the mix

    def as_metrics(self, prefix: str = "data/") -> dict[str, float]:
        out = {f"{prefix}{k}": float(v) for k, v in asdict(self).items()
               if k not in ("per_dataset", "first_untrainable")}
        out.update({f"{prefix}mixed/{k}": float(v) for k, v in self.per_dataset.items()})
        return out


def load_records(cfg: DataConfig, task: str) -> tuple[list[Record], DataStats]:
    """Read every dataset, check every record for ``task``, mix and shuffle (see ``rlhf.data.mixing``)."""
    check_sources_exist(cfg.specs)
    stats = DataStats()
    per_source: list[list[Record]] = []
    for spec in cfg.specs:
        records = presets.apply(cfg.dataset_format, spec.path, read_source(spec), cfg)
        stats.num_records += len(records)
        good = []
        for r in records:
            problem = record_problem(r, task, cfg)
            if problem is None:
                good.append(r)
                continue
            if not cfg.skip_bad_samples:
                raise ValueError(f"{r.where}: {problem}{_key_hint(r, problem, task)} {_SKIP_HINT}")
            if stats.num_bad_skipped < _LOGGED_BAD:
                log.warning("skipping bad record %s: %s", r.where, problem)
            stats.num_bad_skipped += 1
        if not good:
            first = record_problem(records[0], task, cfg)
            raise ValueError(f"--dataset entry {spec}: all {len(records)} records are bad (first: "
                             f"{records[0].where}: {first}{_key_hint(records[0], first, task)})")
        per_source.append(good)
    if stats.num_bad_skipped:
        log.warning("--skip_bad_samples: skipped %d bad records of %d", stats.num_bad_skipped, stats.num_records)
    order = mix([len(s) for s in per_source], cfg.probs, cfg.max_samples, cfg.seed)
    stats.num_mixed = len(order)
    for i, spec in enumerate(cfg.specs):
        stats.per_dataset[str(spec)] = sum(1 for s, _ in order if s == i)
    return [per_source[s][j] for s, j in order], stats


def _key_hint(record: Record, problem: str, task: str) -> str:
    """For a missing key: the keys the record has, and the flags that map them."""
    if record.data is None or not problem.startswith("missing key"):
        return ""
    return (f"; its records have keys {sorted(record.data)[:12]}: map them with {_KEY_FLAGS[task]}, or pick a "
            f"layout with --dataset_format ({', '.join(presets.FORMATS[2:])})")


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no eos_token; set one in its tokenizer_config")


def build_sft_dataset(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase,
                      preloaded: tuple[list[Record], DataStats] | None = None) -> tuple[list[SFTSample], DataStats]:
    """SFT samples: ``input_ids`` (S<=max_len,) and a ``loss_mask`` that is True on response tokens (+ eos).
    ``preloaded``: checked records (and their counts) from ``load_records``, e.g. rewritten by conditional SFT."""
    if not cfg.output_key and not cfg.apply_chat_template and not cfg.pretrain_mode:
        raise ValueError("--output_key is required unless --apply_chat_template is set (then --input_key may hold "
                         "a whole conversation whose last, assistant message is the response)")
    _check_tokenizer(tokenizer)
    records, stats = preloaded if preloaded is not None else load_records(cfg, "sft")
    out = []
    for r in records:
        s, too_long = sft_sample(r, cfg, tokenizer)
        if not response_tokenized(s.input_ids.numel(), s.prompt_len) or not bool(s.loss_mask[1:].any()):
            count_untrainable(stats, r.where)
            continue
        if too_long:
            stats.num_truncated += 1
            s.input_ids, s.loss_mask = s.input_ids[: cfg.max_len], s.loss_mask[: cfg.max_len]
            s.prompt_len = min(s.prompt_len, cfg.max_len)
            if not bool(s.loss_mask[1:].any()):  # the first token is never predicted
                stats.num_dropped += 1
                continue
        out.append(s)
    return _finish(out, stats, cfg, "max_len")


def response_tokenized(num_ids: int, prompt_len: int) -> bool:
    """A (checked, non-blank) response became at least one token besides the eos that ``tokenize_pair`` adds."""
    return num_ids - prompt_len > 1


def count_untrainable(stats: DataStats, where: str) -> None:
    stats.num_untrainable += 1
    stats.first_untrainable = stats.first_untrainable or where


def truncated_pair(r, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, stats: DataStats):
    """``((chosen_ids, chosen_prompt_len), (rejected_ids, rejected_prompt_len))`` of a preference record, each
    cut to ``max_len`` (counted in ``stats``); None (counted as dropped) when a prompt leaves no response token."""
    (c, c_plen), (j, j_plen) = rm_sides(r, cfg, tokenizer)
    if not response_tokenized(len(c), c_plen) or not response_tokenized(len(j), j_plen):
        count_untrainable(stats, r.where)
        return None
    if len(c) > cfg.max_len or len(j) > cfg.max_len:
        stats.num_truncated += 1
        if c_plen >= cfg.max_len or j_plen >= cfg.max_len:
            stats.num_dropped += 1
            return None
        c, j = c[: cfg.max_len], j[: cfg.max_len]
    return (c, c_plen), (j, j_plen)


def build_rm_dataset(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[list[RMSample], DataStats]:
    """RM pairs: ``chosen_ids`` and ``rejected_ids``, each prompt + response + eos, at most ``max_len`` long."""
    _check_tokenizer(tokenizer)
    records, stats = load_records(cfg, "rm")
    out = []
    for r in records:
        sides = truncated_pair(r, cfg, tokenizer, stats)
        if sides is None:
            continue
        (c, _), (j, _) = sides
        margin = float(r.data[cfg.margin_key]) if cfg.margin_key else None
        out.append(RMSample(torch.tensor(c, dtype=torch.int32), torch.tensor(j, dtype=torch.int32), margin, r.where))
    return _finish(out, stats, cfg, "max_len")


def build_prompt_dataset(cfg: DataConfig,
                         tokenizer: PreTrainedTokenizerBase) -> tuple[list[PromptSample], DataStats]:
    """PPO prompts: ``prompt_ids`` left-truncated to ``prompt_max_len`` (the count is ``num_truncated``)."""
    records, stats = load_records(cfg, "prompt")
    out = []
    for r in records:
        s, truncated = prompt_sample(r, cfg, tokenizer)
        if s.prompt_ids.numel() == 0:
            count_untrainable(stats, r.where)
            continue
        stats.num_truncated += int(truncated)
        out.append(s)
    return _finish(out, stats, cfg, "prompt_max_len")


def _finish(samples: list, stats: DataStats, cfg: DataConfig, len_flag: str) -> tuple[list, DataStats]:
    if stats.num_untrainable:  # a non-blank text that became no token: the tokenizer is broken, not the data
        what = "prompts" if len_flag == "prompt_max_len" else "samples"
        raise ValueError(f"--dataset: {stats.num_untrainable} of {stats.num_mixed} {what} tokenize to no trainable "
                         f"token (first: {stats.first_untrainable}); their text is not blank, so the tokenizer of "
                         "--pretrain turns text into nothing: is it complete?")
    stats.num_samples = len(samples)
    if stats.num_truncated:
        log.warning("%d of %d samples are longer than --%s %d and were truncated%s", stats.num_truncated,
                    stats.num_mixed, len_flag, getattr(cfg, len_flag),
                    f"; {stats.num_dropped} had no response token left and were dropped" if stats.num_dropped else "")
    if not samples:
        raise ValueError(f"no samples left: all {stats.num_mixed} were dropped because the prompt alone fills "
                         f"--{len_flag} {getattr(cfg, len_flag)}")
    return samples, stats


def load_prompts_with_raw(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[list, list[PromptSample]]:
    """(raw prompt field values, PromptSamples) in data order (mixing and shuffling apply), for jobs that write the
    prompt back out as they read it (rejection sampling, batch inference)."""
    records, _ = load_records(cfg, "prompt")
    return [r.data[cfg.input_key] for r in records], [prompt_sample(r, cfg, tokenizer)[0] for r in records]
