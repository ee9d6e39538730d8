"""Reward shaping by response length, before any baseline (OpenRLHF's ``length_penalty.py``), and the group filter
of dynamic sampling (DAPO). Pure functions of tensors; the flags come in ``ShapingConfig``.

* DAPO's overlong penalty (``--overlong_buffer_len L``, ``--overlong_penalty_factor f``): a response longer than
  ``generate_max_len - L`` tokens loses ``min(len - (generate_max_len - L), L) / L * f``.
* ProRL's stop-properly penalty (``--stop_properly_penalty_coef c``): a response cut at the length limit (no EOS)
  has its reward multiplied by ``c`` (0 <= c <= 1), or replaced by ``c`` when ``c < 0``. Applied after the overlong
  penalty, as OpenRLHF does.
* Dynamic filtering (``--dynamic_filtering``, ``--dynamic_filtering_range LO HI``): a prompt's group is kept when
  ``LO < mean score < HI`` and its scores are not all equal (an all-equal group has zero advantage under every
  group estimator: it costs a forward and a backward and teaches nothing).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShapingConfig:
    generate_max_len: int
    overlong_buffer_len: float | None = None
    overlong_penalty_factor: float = 1.0
    stop_properly_penalty_coef: float | None = None

    def __post_init__(self) -> None:
        if self.overlong_buffer_len is not None and not 0 < self.overlong_buffer_len <= self.generate_max_len:
            raise ValueError(f"--overlong_buffer_len {self.overlong_buffer_len} must be in (0, --generate_max_len "
                             f"{self.generate_max_len}]")
        if self.overlong_penalty_factor < 0:
            raise ValueError(f"--overlong_penalty_factor must be >= 0, got {self.overlong_penalty_factor}")
        c = self.stop_properly_penalty_coef
        if c is not None and c > 1:
            raise ValueError(f"--stop_properly_penalty_coef {c}: a scale in [0, 1], or a negative fixed reward")

    @property
    def active(self) -> bool:
        return self.overlong_buffer_len is not None or self.stop_properly_penalty_coef is not None

    @classmethod
    def from_parts(cls, generation, algo) -> "ShapingConfig":
        """From the PPO job's generation part (--generate_max_len) and algorithm part (the penalties' flags)."""
        return cls(generate_max_len=generation.generate_max_len, overlong_buffer_len=algo.overlong_buffer_len,
                   overlong_penalty_factor=algo.overlong_penalty_factor,
                   stop_properly_penalty_coef=algo.stop_properly_penalty_coef)

    @classmethod
    def from_args(cls, args) -> "ShapingConfig":
        """From a parsed command line (its flat Namespace)."""
        return cls.from_parts(args, args)


def overlong_penalty(lengths: torch.Tensor, generate_max_len: int, buffer_len: float,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: (B,) response lengths -> (B,) penalties (<= 0)."""
    exceed = (lengths.to(torch.float64) - (generate_max_len - buffer_len)).clamp(max=buffer_len)
    return torch.where(exceed > 0, -exceed / buffer_len * factor, torch.zeros_like(exceed))


def apply_length_penalties(rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor,
                           cfg: ShapingConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rewards, lengths (B,), truncated (B,) bool -> (shaped rewards, overlong-penalized (B,) bool, truncated (B,)
    bool that the stop-properly penalty touched)."""
    out = rewards.clone()
    penalized = torch.zeros_like(truncated, dtype=torch.bool)
    if cfg.overlong_buffer_len is not None:
        pen = overlong_penalty(lengths, cfg.generate_max_len, cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
        penalized = pen < 0
        out = out + pen.to(out.dtype)
    touched = torch.zeros_like(penalized)
    c = cfg.stop_properly_penalty_coef
    if c is not None:
        touched = truncated.bool()
        out = torch.where(touched, torch.full_like(out, c) if c < 0 else out * c, out)
    return out, penalized, touched


def keep_groups(scores: torch.Tensor, n: int, lo: float, hi: float) -> torch.Tensor:
    """Dynamic filtering: (N,) prompt-major scores of groups of ``n`` -> (N / n,) bool, True for a group whose mean
    lies strictly inside (lo, hi) (OpenRLHF's ``--algo.dynamic_filtering_range``) and whose scores are not all
    equal."""
    g = scores.reshape(-1, n).to(torch.float64)
    mean = g.mean(dim=1)
    return (mean > lo) & (mean < hi) & (g.max(dim=1).values > g.min(dim=1).values)
