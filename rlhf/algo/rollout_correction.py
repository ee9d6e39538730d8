"""Rollout corrections: the gap between the behaviour policy (the generator's per-token log-probs, which may come
from several weight versions) and the trainer's log-probs at this step's weights (the proximal policy of AReaL's
decoupled objective; PPO's ``old_logprobs``). Pure: tensors in, a per-token weight, a per-token keep-mask and
metrics out.

Two families, each written as its peer computes it (docs/ppo.md, "Rollout corrections"):

* OpenRLHF's importance weights (openrlhf/models/loss.py ``PolicyLoss.forward`` at 3c3be6234e0c;
  ``--algo.advantage.is_correction_type``), ``w = exp(old_logprobs - rollout_logprobs)`` per token, multiplied
  into the per-token PPO loss (detached): ``tis`` clamps w to [LOW, HIGH]; ``icepop`` zeroes w outside [LOW, HIGH];
  ``seq-mask-tis`` zeroes every w of a sequence whose geometric mean ``exp(mean_t log w)`` is outside [LOW, HIGH]
  and keeps the others unclamped. A zeroed token keeps its place in the loss's denominator, as in OpenRLHF.
* verl's rejection (verl/trainer/ppo/rollout_corr_helper.py ``compute_rollout_rejection_mask`` at b178a3cd;
  ``algorithm.rollout_correction.rollout_rs`` / ``rollout_rs_threshold``): with ``lr = clamp(old - rollout, -20,
  20)``, ``k1 = -lr``, ``k2 = lr^2 / 2``, ``k3 = exp(lr) - 1 - lr`` per token; ``token_k*`` tests each token,
  ``seq_sum_k*`` / ``seq_mean_k*`` / ``seq_max_k*`` the sum / mean / max over a sequence's response tokens (the
  whole sequence is kept or rejected). k1 options keep ``log(lower) <= stat <= log(upper)``, the others ``stat <=
  upper``. A rejected token leaves the response mask: it drops out of the loss and its denominator, as in verl.
  With the trainer's old log-probs (verl's decoupled mode) the rejection is applied when the experience is made, as
  verl writes it into ``response_mask`` before ``compute_advantage`` and the critic update
  (verl/trainer/ppo/ray_trainer.py ``fit`` at 1dda039b): rejected tokens leave GAE's recursion and the whitening
  statistics, their advantages are 0 and they leave the value loss; GRPO's group statistics keep every sample (verl's
  ``compute_grpo_outcome_advantage`` scores ``token_level_rewards.sum(-1)``, placed before the rejection).
* verl's importance weights (``rollout_is`` token | sequence, ``compute_rollout_correction_weights`` at 1dda039b):
  token ``w_t = min(exp(clamp(lr_t, -20, 20)), C)``, sequence ``w = min(exp(clamp(sum_t lr_t, -20, 20)), C)`` on
  every token of the row, ``C = rollout_is_threshold``, detached, zero on padding; ``rollout_is_batch_normalize``
  divides them by their mean over the global batch (over tokens; over sequences for ``sequence``), after the
  truncation. They multiply the per-token policy loss (``compute_policy_loss_vanilla``).
* verl's bypass mode (``--use_rollout_logprobs`` with a correction; ``apply_bypass_mode`` and
  ``compute_policy_loss_bypass_mode`` at 1dda039b): the old log-probs are the generator's, no old-log-prob forward;
  in the loss, per micro-batch, the weights and the rejection are computed against the current policy
  (``lr = logprobs.detach() - rollout_logprobs``); ``--rollout_correction_loss_type ppo_clip`` (verl's default) clips
  the ratio ``p / p_rollout`` and does not apply the weights (they would count the ratio twice), ``reinforce`` is
  ``-A * logprobs * w``, unclipped. The rejection masks the loss only there; advantages and the critic see the
  whole response.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from rlhf.config.part import Part, flag

IS_CORRECTION_TYPES = ("tis", "icepop", "seq-mask-tis")
ROLLOUT_IS_LEVELS = ("token", "sequence")
"""verl's ``rollout_is`` levels"""
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
"""verl's ``rollout_correction.loss_type`` in bypass mode"""
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                      "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
"""verl's ``SUPPORTED_ROLLOUT_RS_OPTIONS``"""
SAFETY_BOUND = 20.0
"""verl clamps the log ratio to [-20, 20] before its divergences"""
METRICS = ("rollout_corr_masked_frac", "rollout_corr_clipped_frac", "rollout_is_weight")
"""Per response token: the fraction zeroed or rejected by the correction, the fraction whose weight ``tis`` clamped,
and the mean importance weight over the tokens kept (1 without --use_tis)."""


@dataclass(frozen=True)
class RolloutCorrectionConfig(Part):
    """The rollout corrections, from --use_tis, --tis_cap, --tis_floor, --is_correction_type, --rollout_rs and
    --rollout_rs_threshold."""

    use_tis: bool = flag(action="store_true", help="truncated importance sampling: weight the policy loss by "
                                                   "min(p_trainer/p_vllm, --tis_cap)", default=False)
    """--use_tis: the per-token loss weighted by w = p_trainer / p_rollout as --is_correction_type says"""
    tis_cap: float = flag(type=float, default=2.0)
    """--tis_cap: HIGH of OpenRLHF's --algo.advantage.is_correction_threshold LOW HIGH"""
    tis_floor: float | None = flag(type=float, help="--use_tis: the weight is at least this too (OpenRLHF's "
                                                    "--algo.advantage.is_correction_threshold LOW HIGH is "
                                                    "--tis_floor LOW --tis_cap HIGH; default: no lower bound)",
                                   default=None)
    """--tis_floor: LOW (None: no lower bound, i.e. 0)"""
    is_correction_type: str = flag(choices=IS_CORRECTION_TYPES, help="--use_tis, OpenRLHF's "
                                                                     "--algo.advantage.is_correction_type: tis "
                                                                     "clamps w = p_trainer/p_vllm to [--tis_floor, "
                                                                     "--tis_cap]; icepop zeroes the tokens whose w "
                                                                     "is outside; seq-mask-tis zeroes the sequences "
                                                                     "whose geometric mean of w is outside (w "
                                                                     "unclamped)", default="tis")
    """--is_correction_type tis | icepop | seq-mask-tis (OpenRLHF's --algo.advantage.is_correction_type)"""
    rollout_rs: str | None = flag(help="verl's rollout rejection (algorithm.rollout_correction.rollout_rs): comma-separated "
                            f"options from {', '.join(ROLLOUT_RS_OPTIONS)}; a token or sequence failing one leaves "
                            "the loss",
                                  default=None)
    """--rollout_rs: verl's rejection options, comma separated (all must pass)"""
    rollout_rs_threshold: str | None = flag(help="--rollout_rs's thresholds (verl's rollout_rs_threshold): one, or "
                                                 "one per option, comma-separated; k1 options take LOWER_UPPER ratio "
                                                 "bounds (or UPPER, LOWER = 1/UPPER), the others an upper bound on "
                                                 "the divergence", default=None)
    """--rollout_rs_threshold: verl's spec, one entry or one per option; k1: LOWER_UPPER or UPPER (LOWER = 1/UPPER)"""
    rollout_is: str | None = flag(choices=ROLLOUT_IS_LEVELS, help="verl's importance weights "
                                                                  "(algorithm.rollout_correction.rollout_is): token, "
                                                                  "min(p_trainer/p_vllm, C) per token, or sequence, "
                                                                  "min(prod_t p_trainer/p_vllm, C) on every token of "
                                                                  "the row; they multiply the policy loss",
                                  default=None)
    """--rollout_is: verl's importance weights, token | sequence"""
    rollout_is_threshold: float = flag(type=float, help="--rollout_is's truncation C (verl's rollout_is_threshold)",
                                       default=2.0)
    """--rollout_is_threshold: verl's truncation C (weights above it become C)"""
    rollout_is_batch_normalize: bool = flag(action="store_true", help="--rollout_is: divide the weights by their "
                                                                      "mean over the batch (verl's "
                                                                      "rollout_is_batch_normalize: over tokens, over "
                                                                      "sequences for sequence)", default=False)
    """--rollout_is_batch_normalize: verl's division of the weights by their mean over the batch"""
    rollout_correction_loss_type: str = flag(choices=BYPASS_LOSS_TYPES,
                                             help="verl's bypass mode (--use_rollout_logprobs with --rollout_is / "
                                                  "--rollout_rs): ppo_clip clips the ratio against the generator's "
                                                  "log-probs (the weights are not applied), reinforce is -A * logp * "
                                                  "w, unclipped", default="ppo_clip")
    """--rollout_correction_loss_type: verl's bypass-mode loss (with --use_rollout_logprobs): ppo_clip | reinforce"""


    def check(self) -> None:
        if self.tis_floor is not None and not 0 <= self.tis_floor < self.tis_cap:
            raise ValueError(f"--tis_floor {self.tis_floor:g}: must be in [0, --tis_cap {self.tis_cap:g})")
        if self.tis_cap <= 0:
            raise ValueError(f"--tis_cap {self.tis_cap:g}: must be > 0")
        if self.is_correction_type not in IS_CORRECTION_TYPES:
            raise ValueError(f"--is_correction_type {self.is_correction_type!r}: expected one of "
                             f"{', '.join(IS_CORRECTION_TYPES)}")
        if self.rollout_rs is None and self.rollout_rs_threshold is not None:
            raise ValueError(f"--rollout_rs_threshold {self.rollout_rs_threshold}: without --rollout_rs")
        if self.rollout_is is not None and self.rollout_is not in ROLLOUT_IS_LEVELS:
            raise ValueError(f"--rollout_is {self.rollout_is!r}: expected one of {', '.join(ROLLOUT_IS_LEVELS)}")
        if self.rollout_is is not None and self.use_tis:
            raise ValueError(f"--rollout_is {self.rollout_is} with --use_tis: two importance weights (verl's and "
                             "OpenRLHF's) on the same loss; use one")
        if self.rollout_is_batch_normalize and self.rollout_is is None:
            raise ValueError("--rollout_is_batch_normalize without --rollout_is: there are no weights to normalise")
        if not self.rollout_is_threshold > 0:
            raise ValueError(f"--rollout_is_threshold must be > 0, got {self.rollout_is_threshold:g}")
        if self.rollout_correction_loss_type not in BYPASS_LOSS_TYPES:
            raise ValueError(f"--rollout_correction_loss_type {self.rollout_correction_loss_type!r}: expected one "
                             f"of {', '.join(BYPASS_LOSS_TYPES)}")
        self.rs_bounds()

    @property
    def enabled(self) -> bool:
        return self.use_tis or self.rollout_rs is not None or self.rollout_is is not None

    def rs_bounds(self) -> tuple[tuple[str, float | None, float], ...]:
        """``(option, lower, upper)`` per --rollout_rs option, as verl's ``_parse_rollout_rs_thresholds`` reads
        them (lower only for k1). ValueError naming the flag."""
        if self.rollout_rs is None:
            return ()
        opts = list(dict.fromkeys(o.strip() for o in self.rollout_rs.split(",") if o.strip()))
        bad = [o for o in opts if o not in ROLLOUT_RS_OPTIONS]
        if not opts or bad:
            raise ValueError(f"--rollout_rs {self.rollout_rs}: expected options from {', '.join(ROLLOUT_RS_OPTIONS)}")
        if self.rollout_rs_threshold is None:
            raise ValueError(f"--rollout_rs {self.rollout_rs} needs --rollout_rs_threshold")
        specs = [s.strip() for s in str(self.rollout_rs_threshold).split(",") if s.strip()]
        if len(specs) not in (1, len(opts)):
            raise ValueError(f"--rollout_rs_threshold {self.rollout_rs_threshold}: one threshold, or one per "
                             f"--rollout_rs option ({len(opts)})")
        out = []
        for opt, spec in zip(opts, specs * len(opts) if len(specs) == 1 else specs):
            try:
                if opt.endswith("k1"):
                    lo, hi = (float(v) for v in spec.split("_", 1)) if "_" in spec else (1 / float(spec), float(spec))
                elif "_" in spec:  # float() reads "0.5_2" as 0.52
                    raise ValueError(spec)
                else:
                    lo, hi = None, float(spec)
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"--rollout_rs_threshold {self.rollout_rs_threshold}: {spec!r} for {opt} is not "
                                 + ("LOWER_UPPER or UPPER" if opt.endswith("k1") else "one number")) from None
            if hi <= 0 or (lo is not None and (lo <= 0 or lo > hi)):
                raise ValueError(f"--rollout_rs_threshold {self.rollout_rs_threshold}: {spec!r} for {opt} must be "
                                 "positive" + (", LOWER <= UPPER" if lo is not None else ""))
            out.append((opt, lo, hi))
        return tuple(out)

    def metric_keys(self) -> tuple[str, ...]:
        return METRICS if self.enabled else ()

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "RolloutCorrectionConfig":
        """``from_args``, where a flag missing from ``ns`` (a Namespace built by hand) takes its default."""
        return cls.from_args(ns, **{f.name: f.default for f in fields(cls) if not hasattr(ns, f.name)})


class Correction(NamedTuple):
    weights: torch.Tensor | None
    """(B, T) detached factor of each token's loss (None without --use_tis)"""
    keep: torch.Tensor | None
    """(B, T) bool, False where --rollout_rs rejects (None without it): those tokens leave the response mask"""
    metrics: dict
    """``METRICS`` as per-token ``[sum, count]``"""


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, kind: str, low: float | None, high: float):
    """OpenRLHF's weights from ``log_ratio = old_logprobs - rollout_logprobs`` (B, T), zero on padding. Returns
    ``(weights, zeroed, clipped)``, each (B, T): the weight, and where it was zeroed or clamped."""
    w = torch.exp(log_ratio)
    lo = 0.0 if low is None else low
    if kind == "tis":
        clipped = (w > high) | (w < lo)
        return w.clamp(min=low, max=high), torch.zeros_like(clipped), clipped
    if kind == "icepop":
        inside = (w >= lo) & (w <= high)
    elif kind == "seq-mask-tis":
        n = mask.sum(dim=-1).clamp(min=1)
        seq = torch.exp(torch.where(mask, log_ratio, 0).sum(dim=-1) / n)  # (B,) geometric mean of w
        inside = ((seq >= lo) & (seq <= high)).unsqueeze(-1).expand_as(w)
    else:
        raise ValueError(f"--is_correction_type {kind!r}: expected one of {', '.join(IS_CORRECTION_TYPES)}")
    return w * inside, ~inside, torch.zeros_like(inside)


def verl_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float) -> torch.Tensor:
    """verl's ``compute_rollout_correction_weights`` (TIS form) from ``log_ratio = log p_train - log p_rollout`` (B, T):
    token ``min(exp(clamp(lr, -20, 20)), C)``, sequence ``min(exp(clamp(sum_t lr, -20, 20)), C)`` broadcast over the
    row; zero outside ``mask``; detached. (B, T)."""
    with torch.no_grad():
        lr = torch.where(mask, log_ratio, 0)
        if level == "token":
            raw = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        elif level == "sequence":
            raw = torch.exp(lr.sum(dim=-1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(lr)
        else:
            raise ValueError(f"--rollout_is {level!r}: expected one of {', '.join(ROLLOUT_IS_LEVELS)}")
        return torch.where(mask, raw.clamp(max=threshold), 0)


def is_normalizer(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The sum and count (2,) float64 whose quotient verl's ``rollout_is_batch_normalize`` divides by: the weights
    over the tokens (token), or each row's mean weight over the rows with tokens (sequence). Summed over ranks by
    the caller for the batch's mean."""
    w = weights.double()
    if level == "token":
        return torch.stack([torch.where(mask, w, 0).sum(), mask.sum().double()])
    n = mask.sum(dim=-1)
    per_row = torch.where(mask, w, 0).sum(dim=-1) / n.clamp(min=1)
    return torch.stack([torch.where(n > 0, per_row, 0).sum(), (n > 0).sum().double()])


def rejection_keep(log_ratio: torch.Tensor, mask: torch.Tensor, bounds) -> torch.Tensor:
    """verl's keep-mask (B, T) bool for ``bounds`` (``RolloutCorrectionConfig.rs_bounds``); every option must pass."""
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    div = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1 - lr}  # (B, T) each
    keep = torch.ones_like(mask)
    for opt, lo, hi in bounds:
        level, k = opt.rsplit("_", 1)
        d = torch.where(mask, div[k], 0)
        if level == "token":
            stat = d
        elif level == "seq_sum":
            stat = d.sum(dim=-1, keepdim=True)
        elif level == "seq_mean":
            stat = d.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1)
        else:  # seq_max; a sequence without tokens: 0, as verl
            m = torch.where(mask, div[k], float("-inf")).max(dim=-1, keepdim=True).values
            stat = torch.where(torch.isinf(m), 0, m)
        ok = stat <= (math.log(hi) if lo is not None else hi)
        if lo is not None:
            ok = ok & (stat >= math.log(lo))
        keep = keep & ok.expand_as(mask)
    return keep


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, action_mask: torch.Tensor,
                       cfg: RolloutCorrectionConfig) -> Correction:
    """The weights, the keep-mask and ``METRICS`` for one micro-batch. old_logprobs (the trainer's at this step's
    weights), rollout_logprobs (the generator's), action_mask: (B, T). Padding may hold anything."""
    mask = action_mask if action_mask.dtype == torch.bool else action_mask != 0
    with torch.no_grad():
        log_ratio = torch.where(mask, old_logprobs - rollout_logprobs, 0)  # (B, T) log p_trainer / p_rollout
        n = mask.sum().to(torch.int)
        weights, dropped, clipped = None, torch.zeros_like(mask), torch.zeros_like(mask)
        if cfg.use_tis:
            weights, dropped, clipped = is_weights(log_ratio, mask, cfg.is_correction_type, cfg.tis_floor,
                                                   cfg.tis_cap)
        keep = rejection_keep(log_ratio, mask, cfg.rs_bounds()) if cfg.rollout_rs is not None else None
        if keep is not None:
            dropped = dropped | ~keep
        kept = mask & ~dropped
        w = weights if weights is not None else torch.ones_like(log_ratio)
        zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
        metrics = {"rollout_corr_masked_frac": [torch.where(mask & dropped, 1.0, zero).sum(), n],
                   "rollout_corr_clipped_frac": [torch.where(mask & clipped, 1.0, zero).sum(), n],
                   "rollout_is_weight": [torch.where(kept, w, zero).sum(), kept.sum().to(torch.int)]}
    return Correction(weights=weights, keep=keep, metrics=metrics)


def experience_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, action_mask: torch.Tensor,
                          cfg: RolloutCorrectionConfig, total=lambda t: t):
    """verl's decoupled mode, when the experience is made (the trainer's old log-probs known): --rollout_is's
    weights (normalised over the batch with --rollout_is_batch_normalize) and --rollout_rs's keep-mask, both from
    the response as generated (``action_mask``). ``total(t)``: ``t`` summed over the batch's ranks (identity for one
    rank). Returns ``(keep (B, T) bool or None, weights (B, T) or None, metrics)``; metrics are global means."""
    mask = action_mask if action_mask.dtype == torch.bool else action_mask != 0
    with torch.no_grad():
        lr = torch.where(mask, old_logprobs - rollout_logprobs, 0)
        metrics: dict[str, float] = {}
        weights = None
        if cfg.rollout_is is not None:
            weights = verl_is_weights(lr, mask, cfg.rollout_is, cfg.rollout_is_threshold)
            if cfg.rollout_is_batch_normalize:
                s, n = total(is_normalizer(weights, mask, cfg.rollout_is)).tolist()
                mean = s / max(n, 1.0)
                if mean > 1e-8:  # verl: "if weights_mean > 1e-8"
                    weights = weights / mean
                metrics["rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
        keep = rejection_keep(lr, mask, cfg.rs_bounds()) if cfg.rollout_rs is not None else None
        counts = torch.stack([mask.sum().double(), (mask & ~keep).sum().double() if keep is not None else
                              torch.zeros((), dtype=torch.float64)])
        n_tok, n_rej = total(counts).tolist()
        if keep is not None:
            metrics["rollout_rs_masked_frac"] = n_rej / max(n_tok, 1.0)
    return keep, weights, metrics
