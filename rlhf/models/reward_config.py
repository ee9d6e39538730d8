"""What a reward / critic model's ``config.json`` says about its scalar head: OpenRLHF's keys (``normalize_reward``,
``mean``, ``std``, ``value_head_prefix``) or ours (``rlhf.reward_mean/reward_std``). Plain dict reading, below both
``rlhf.models.spec`` (which accepts either config) and ``rlhf.models.reward_format`` (which converts the folders).
"""
from __future__ import annotations

from typing import Any

OPENRLHF_CONFIG_KEYS = ("normalize_reward", "mean", "std", "value_head_prefix")
OPENRLHF_ARCHS = ("RewardModel", "CriticModel")


def is_openrlhf_config(cfg: dict[str, Any]) -> bool:
    return any(k in cfg for k in ("normalize_reward", "value_head_prefix")) or \
        any(a in OPENRLHF_ARCHS for a in cfg.get("architectures") or [])


def head_prefix(cfg: dict[str, Any]) -> str:
    """The scalar head's tensor name without ``.weight`` in a folder with this config."""
    if is_openrlhf_config(cfg):
        return str(cfg.get("value_head_prefix") or "value_head")
    return "score"


def reward_stats(cfg: dict[str, Any]) -> tuple[float, float] | None:
    """(mean, std) a reward model's scores are normalized with: ours (``rlhf.reward_mean/reward_std``, written
    by launch/rm.py) or OpenRLHF's (``mean``/``std``); None when the config has neither."""
    ours = cfg.get("rlhf") or {}
    if "reward_mean" in ours and "reward_std" in ours:
        return float(ours["reward_mean"]), float(ours["reward_std"])
    if "mean" in cfg and "std" in cfg:
        return float(cfg["mean"]), float(cfg["std"])
    return None
