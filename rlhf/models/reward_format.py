"""OpenRLHF's reward / critic model folders, read and written.

OpenRLHF saves a reward model as the base model's keys (``model.*``) plus a scalar head ``<value_head_prefix>.weight``
(``value_head`` by default, ``score`` with ``--value_head_prefix score``) of shape (1, hidden), and a config.json
that keeps the causal LM's ``architectures`` and adds ``normalize_reward``, ``mean``, ``std`` (the reward
statistics its ``--normalize_reward`` divides by) and ``value_head_prefix``. Our HF format is
``*ForSequenceClassification`` with ``score.weight`` and the statistics under ``rlhf.reward_mean/reward_std``.
Both load as ``--reward_pretrain`` / ``--critic_pretrain``; ``to_openrlhf`` / ``from_openrlhf`` convert a folder.
What a config says (``is_openrlhf_config``, ``head_prefix``, ``reward_stats``) is ``rlhf.models.reward_config``.
"""
from __future__ import annotations

import json
import os
from typing import Any

from rlhf.models.reward_config import OPENRLHF_CONFIG_KEYS, head_prefix, is_openrlhf_config, reward_stats
from rlhf.models.spec import CAUSAL_LM_ARCHS, SEQ_CLS_ARCHS, load_hf_config


def _rewrite(folder: str, out: str, rename: dict[str, str], cfg: dict[str, Any]) -> None:
    from safetensors.torch import load_file, save_file

    from rlhf.models.hf_io import copy_tokenizer_files

    os.makedirs(out, exist_ok=True)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{folder}: no .safetensors weights")
    index = {}
    for f in files:
        tensors = {rename.get(k, k): v for k, v in load_file(os.path.join(folder, f)).items()}
        save_file(tensors, os.path.join(out, f + ".tmp"), metadata={"format": "pt"})
        os.replace(os.path.join(out, f + ".tmp"), os.path.join(out, f))
        index.update({k: f for k in tensors})
    if len(files) > 1 or os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": index}, fh, indent=2)
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    if os.path.abspath(out) != os.path.abspath(folder):
        copy_tokenizer_files(folder, out)


def to_openrlhf(folder: str, out: str | None = None, prefix: str = "value_head") -> str:
    """Our HF reward model folder -> OpenRLHF's format (in place when ``out`` is None)."""
    cfg = load_hf_config(folder)
    if is_openrlhf_config(cfg):
        raise ValueError(f"{folder}: already in OpenRLHF's reward-model format")
    stats = reward_stats(cfg)
    new = {k: v for k, v in cfg.items() if k not in ("rlhf", "id2label", "label2id", "num_labels")}
    new["architectures"] = [CAUSAL_LM_ARCHS[cfg["model_type"]]]
    new.update(value_head_prefix=prefix, normalize_reward=False)
    if stats is not None:
        new["mean"], new["std"] = stats
    if cfg.get("rlhf"):
        new["rlhf"] = {k: v for k, v in cfg["rlhf"].items() if k not in ("reward_mean", "reward_std")} or None
        if new["rlhf"] is None:
            new.pop("rlhf")
    _rewrite(folder, out or folder, {"score.weight": f"{prefix}.weight"}, new)
    return out or folder


def from_openrlhf(folder: str, out: str | None = None) -> str:
    """OpenRLHF's reward model folder -> our HF ``*ForSequenceClassification`` format."""
    cfg = load_hf_config(folder)
    if not is_openrlhf_config(cfg):
        raise ValueError(f"{folder}: not an OpenRLHF reward model (no normalize_reward/value_head_prefix in "
                         f"config.json)")
    prefix, stats = head_prefix(cfg), reward_stats(cfg)
    new = {k: v for k, v in cfg.items() if k not in OPENRLHF_CONFIG_KEYS}
    new["architectures"] = [SEQ_CLS_ARCHS[cfg["model_type"]]]
    new["num_labels"] = 1
    new.setdefault("pad_token_id", cfg.get("eos_token_id"))
    if stats is not None:
        new["rlhf"] = {**(cfg.get("rlhf") or {}), "reward_mean": stats[0], "reward_std": stats[1]}
    _rewrite(folder, out or folder, {f"{prefix}.weight": "score.weight"}, new)
    return out or folder
