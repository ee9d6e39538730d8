"""Policy losses beside PPO's clip and GSPO, each as verl computes it (verl/trainer/ppo/core_algos.py at b178a3cd,
``compute_policy_loss_<name>``; ``actor.policy_loss.loss_mode`` there, ``--policy_loss_type`` here). Pure: (B, T)
response tensors in, the per-token loss (B, T), a per-token "clipped" indicator and the ratio out; the caller
(``rlhf.algo.ppo_losses.policy_loss``) masks, weights and aggregates as for PPO.

* ``cispo`` (MiniMax-M1; ``compute_policy_loss_cispo``): ``-sg(clip(r, 1 - low, 1 + high)) * A * logprobs``: the
  clipped ratio is a constant weight, every token keeps its gradient through ``logprobs``.
* ``sapo`` (Qwen's soft-gated policy optimisation; ``compute_policy_loss_sapo``): ``-f(r) * A`` with the gate
  ``f(r) = sigmoid(tau * (r - 1)) * 4 / tau``, ``tau = --tau_pos`` where ``A > 0``, else ``--tau_neg``; verl always
  aggregates it as ``seq-mean-token-mean`` (the default here too).
* ``clip_cov`` (Clip-Cov, "The Entropy Mechanism of RL for Reasoning LMs"; ``compute_policy_loss_clip_cov``): PPO's
  clipped loss (no ratio clamp, no dual clip), and of the tokens PPO's clip left alone whose centred covariance
  ``(A - mean A) * (logp - mean logp)`` over the micro-batch lies in (``--clip_cov_lb``, ``--clip_cov_ub``), a random
  ``max(1, int(--clip_cov_ratio * tokens))`` get no loss (no gradient).
* ``kl_cov`` (KL-Cov; ``compute_policy_loss_kl_cov``): the unclipped ``-A * r``, plus ``--ppo_kl_coef * |log r|``
  on the ``max(1, int(--kl_cov_ratio * tokens))`` tokens of largest covariance.

Both covariance methods take their means and their token counts over one micro-batch, as verl's loss functions do
(called per micro-batch there). Clip-Cov's random pick draws from a generator the caller seeds (``generator``):
verl's ``torch.randperm`` on the global generator, which the TP ranks of one micro-batch would not share here."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.config.part import Part, flag

POLICY_VARIANTS = ("cispo", "sapo", "clip_cov", "kl_cov")
LOG_RATIO_CLAMP = 20.0
"""verl clamps the log ratio to [-20, 20] before its exp in CISPO and SAPO (not in Clip-Cov and KL-Cov)"""


@dataclass(frozen=True)
class PolicyVariantConfig(Part):
    """The parameters of CISPO's, SAPO's, Clip-Cov's and KL-Cov's losses (verl's names and defaults: its
    ``ActorConfig`` and ``PolicyLossConfig``, verl/workers/config/actor.py at b178a3cd)."""

    tau_pos: float = flag(type=float, help="--policy_loss_type sapo: the gate's temperature where the advantage is "
                                           "positive (verl's actor.tau_pos)", default=1.0)
    """(--tau_pos) SAPO's temperature for A > 0"""
    tau_neg: float = flag(type=float, help="--policy_loss_type sapo: the gate's temperature where the advantage is "
                                           "not positive (verl's actor.tau_neg)", default=1.05)
    """(--tau_neg) SAPO's temperature for A <= 0"""
    clip_cov_ratio: float = flag(type=float, help="--policy_loss_type clip_cov: the fraction of a micro-batch's "
                                                  "tokens (at least one) whose loss is dropped, drawn among those "
                                                  "whose covariance lies within the bounds (verl's "
                                                  "policy_loss.clip_cov_ratio)", default=0.0002)
    """(--clip_cov_ratio)"""
    clip_cov_lb: float = flag(type=float, help="--policy_loss_type clip_cov: the covariance's lower bound",
                              default=1.0)
    """(--clip_cov_lb)"""
    clip_cov_ub: float = flag(type=float, help="--policy_loss_type clip_cov: the covariance's upper bound",
                              default=5.0)
    """(--clip_cov_ub)"""
    kl_cov_ratio: float = flag(type=float, help="--policy_loss_type kl_cov: the fraction of a micro-batch's tokens "
                                                "(at least one), those of largest covariance, that get the KL "
                                                "penalty (verl's policy_loss.kl_cov_ratio)", default=0.0002)
    """(--kl_cov_ratio)"""
    ppo_kl_coef: float = flag(type=float, help="--policy_loss_type kl_cov: the coefficient of |log ratio| on the "
                                               "selected tokens (verl's policy_loss.ppo_kl_coef)", default=0.1)
    """(--ppo_kl_coef)"""

    def check(self) -> None:
        for name in ("tau_pos", "tau_neg"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name} must be > 0 (SAPO's gate divides by it), got {getattr(self, name)}")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"--{name} must be in (0, 1] (a fraction of the tokens), got {v}")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"--clip_cov_lb {self.clip_cov_lb} must be below --clip_cov_ub {self.clip_cov_ub}")
        if self.ppo_kl_coef < 0:
            raise ValueError(f"--ppo_kl_coef must be >= 0, got {self.ppo_kl_coef}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype)).sum() / mask.sum().clamp(min=1)


def cispo(log_ratio: torch.Tensor, logprobs: torch.Tensor, adv: torch.Tensor, low: float, high: float):
    """CISPO's per-token loss ``-sg(clip(r, 1 - low, 1 + high)) * A * logprobs`` (B, T), clipped = ``r != clip(r)``,
    and the ratio. ``log_ratio``, ``logprobs`` zero on padding."""
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    clipped = ratio.clamp(1.0 - low, 1.0 + high)
    return -clipped.detach() * adv * logprobs, (ratio != clipped).float(), ratio


def sapo(log_ratio: torch.Tensor, adv: torch.Tensor, tau_pos: float, tau_neg: float):
    """SAPO's per-token loss ``-sigmoid(tau * (r - 1)) * 4 / tau * A`` (B, T), nothing clipped, and the ratio."""
    ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    tau = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=adv.dtype), torch.as_tensor(tau_neg, dtype=adv.dtype))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * adv, torch.zeros_like(ratio), ratio


def _covariance(adv: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(A - mean A) * (logp - mean logp)`` per token, the means over the masked tokens (B, T), detached."""
    lp = logprobs.detach()
    return (adv - _masked_mean(adv, mask)) * (lp - _masked_mean(lp, mask))


def clip_cov(log_ratio: torch.Tensor, logprobs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, low: float,
             high: float, cfg: PolicyVariantConfig, generator: torch.Generator | None = None):
    """Clip-Cov's per-token loss ``max(-A r, -A clip(r)) * corr`` (B, T), the dropped tokens (``corr == 0``) and the
    ratio. ``corr`` is 0 on ``min(n, max(1, int(ratio * tokens)))`` of the ``n`` tokens whose covariance is in
    ``(lb, ub)`` and whose ratio PPO's clip does not clip, drawn by ``torch.randperm(n, generator=generator)``."""
    ratio = log_ratio.exp()
    surr1, surr2 = -adv * ratio, -adv * ratio.clamp(1.0 - low, 1.0 + high)
    with torch.no_grad():
        cov = _covariance(adv, logprobs, mask)
        cand = (cov < cfg.clip_cov_ub) & (cov > cfg.clip_cov_lb) & mask & ~((surr2 > surr1) & mask)
        idx = torch.nonzero(cand)  # (n, 2), row-major as verl's
        n_clip = max(int(cfg.clip_cov_ratio * int(mask.sum())), 1)
        corr = torch.ones_like(adv)
        if len(idx):
            idx = idx[torch.randperm(len(idx), generator=generator)[:min(n_clip, len(idx))]]
            corr[idx[:, 0], idx[:, 1]] = 0
    return torch.maximum(surr1, surr2) * corr, (corr == 0).float(), ratio


def kl_cov(log_ratio: torch.Tensor, logprobs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
           cfg: PolicyVariantConfig):
    """KL-Cov's per-token loss (B, T): ``-A r``, plus ``ppo_kl_coef * |log r|`` on the ``max(1, int(kl_cov_ratio *
    tokens))`` masked tokens of largest covariance (marked in the second tensor), and the ratio."""
    ratio = log_ratio.exp()
    loss = -adv * ratio
    picked = torch.zeros_like(ratio)
    with torch.no_grad():
        flat = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
        if len(flat):
            cov = _covariance(adv, logprobs, mask).reshape(-1)[flat]
            k = max(1, int(len(flat) * cfg.kl_cov_ratio))
            picked.view(-1)[flat[torch.topk(cov, k, largest=True).indices]] = 1.0
    return loss + picked * cfg.ppo_kl_coef * log_ratio.abs(), picked, ratio


def variant_loss(kind: str, log_ratio: torch.Tensor, logprobs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                 low: float, high: float, cfg: PolicyVariantConfig, generator: torch.Generator | None = None):
    """``kind``'s per-token loss (B, T), its per-token clip indicator (B, T; KL-Cov: the penalised tokens) and the
    ratio (B, T). ``log_ratio`` and ``logprobs`` are zero on padding (``mask`` False)."""
    if kind == "cispo":
        return cispo(log_ratio, logprobs, adv, low, high)
    if kind == "sapo":
        return sapo(log_ratio, adv, cfg.tau_pos, cfg.tau_neg)
    if kind == "clip_cov":
        return clip_cov(log_ratio, logprobs, adv, mask, low, high, cfg, generator)
    if kind == "kl_cov":
        return kl_cov(log_ratio, logprobs, adv, mask, cfg)
    raise ValueError(f"--policy_loss_type {kind!r}: expected one of {', '.join(POLICY_VARIANTS)}")
