"""``DataConfig``: the dataset flags of SFT, RM and PPO (OpenRLHF names), validated when constructed.

    cfg = DataConfig.from_args(args)   # or DataConfig(dataset="a.jsonl,b.parquet", dataset_probs="0.7,0.3", ...)
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any

from rlhf.data.mixing import parse_probs
from rlhf.data.sources import DatasetSpec, parse_dataset_flag


@dataclass
class DataConfig:
    """Where the records come from, how they are mixed, and how they become token ids."""

    dataset: str
    """--dataset: comma-separated ``.jsonl`` / ``.json`` / ``.parquet`` files or HF save_to_disk folders
    (``folder@split`` picks a split)."""
    dataset_probs: str | None = None
    """--dataset_probs: one probability per dataset, summing to 1; default: proportional to dataset sizes."""
    max_samples: int | None = None
    """--max_samples: cap on the number of mixed records (None: no cap)."""
    seed: int = 42
    """--seed: seeds the mixing and the shuffle (see ``rlhf.data.mixing``)."""
    input_key: str = "input"
    """--input_key: the prompt of SFT and PPO records."""
    output_key: str | None = "output"
    """--output_key: the SFT response. None: ``input_key`` holds a whole conversation (needs --apply_chat_template)
    whose last message, from the assistant, is the response."""
    prompt_key: str | None = None
    """--prompt_key: the RM prompt. None: ``chosen_key``/``rejected_key`` hold the full texts (or conversations)."""
    chosen_key: str = "chosen"
    """--chosen_key: the preferred RM response."""
    rejected_key: str = "rejected"
    """--rejected_key: the other RM response."""
    margin_key: str | None = None
    """--margin_key: optional numeric RM margin per pair."""
    label_key: str | None = None
    """--label_key: optional PPO field passed through untouched (e.g. a reference answer for a rule reward)."""
    apply_chat_template: bool = False
    """--apply_chat_template: render strings / message lists with ``tokenizer.apply_chat_template``."""
    input_template: str | None = None
    """--input_template: e.g. ``"User: {}\\nAssistant: "``, applied to prompts without a chat template."""
    max_len: int = 2048
    """--max_len: SFT / RM sequences longer than this keep their first ``max_len`` tokens."""
    prompt_max_len: int = 1024
    """--prompt_max_len: PPO prompts longer than this keep their last tokens (and a leading BOS)."""
    skip_bad_samples: bool = False
    """--skip_bad_samples: skip and count records with a missing key or an empty field instead of failing."""
    pretrain_mode: bool = False
    """--pretrain_mode (SFT): continued pretraining, the loss on every token of ``input_key``'s text (no prompt,
    no template)."""
    dataset_format: str = "auto"
    """--dataset_format: auto | plain | webgpt | hh | chat (``rlhf.data.presets``): the seed datasets' layouts."""
    vision: Any = None
    """images in prompts (``rlhf.data.vision.VisionData``) for a vision-language model; None: text only. Set by the
    job from the model, not a flag."""
    specs: list[DatasetSpec] = field(init=False, repr=False)
    probs: list[float] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.specs = parse_dataset_flag(self.dataset)
        self.probs = parse_probs(self.dataset_probs, len(self.specs))
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"--max_samples must be >= 1, got {self.max_samples}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        for name in ("max_len", "prompt_max_len"):
            if getattr(self, name) < 2:
                raise ValueError(f"--{name} must be >= 2, got {getattr(self, name)}")
        if self.input_template is not None:
            if self.apply_chat_template:
                raise ValueError(f"--input_template {self.input_template!r} and --apply_chat_template are exclusive: "
                                 f"the chat template already formats the prompt")
            if self.input_template.count("{}") != 1:
                raise ValueError(f"--input_template must contain exactly one '{{}}' where the prompt goes, "
                                 f"got {self.input_template!r}")
        for name in ("input_key", "chosen_key", "rejected_key"):
            if not getattr(self, name):
                raise ValueError(f"--{name} must not be empty")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> "DataConfig":
        """Build from parsed flags: every field whose name is an attribute of ``args`` is taken from it, except a
        None for a field that cannot be None (e.g. an SFT parser's unused ``--chosen_key``), which keeps the default.
        """
        kw = {}
        for f in fields(cls):
            value = getattr(args, f.name, None)
            if f.init and hasattr(args, f.name) and (value is not None or "None" in str(f.type)):
                kw[f.name] = value
        kw.update(overrides)
        return cls(**kw)
