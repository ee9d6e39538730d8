"""PPO losses in megatron's per-token contract: ``(loss_sum, n_tokens, {name: [sum, count]})``.

Every tensor is a right-padded response-token tensor of shape (B, T); ``action_mask`` is 1 on real response
tokens and 0 on the padding after EOS. The losses return the SUM over masked tokens and the token count, so the
trainer can divide by the count summed over all micro-batches and DP ranks (exact token-level mean, as in
megatron's ``calculate_per_token_loss``). Metrics are ``[detached sum, count]`` pairs reduced the same way.

Masked helpers follow TRL / OpenRLHF. Positions where ``action_mask == 0`` may hold anything (even inf/NaN from a
padded forward): they are excluded with ``torch.where`` rather than multiplied by 0, so they never leak into sums
or gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlhf.algo.policy_variants import POLICY_VARIANTS, PolicyVariantConfig, variant_loss
from rlhf.algo.rollout_correction import (RolloutCorrectionConfig, rejection_keep, rollout_correction,
                                          verl_is_weights)

KL_ESTIMATORS = ("k1", "k2", "k3")
KL_ESTIMATE_CLAMP = 10.0
"""Every per-token KL estimate is clamped to [-10, 10] (OpenRLHF's ``compute_approx_kl``)."""


def _bool_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def upcast(x: torch.Tensor) -> torch.Tensor:
    """Compute in at least fp32 (bf16/fp16 -> fp32; fp64 stays fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _count(mask: torch.Tensor) -> torch.Tensor:
    return _bool_mask(mask).sum().to(torch.int)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is set. x, mask (B, T) -> scalar, or reduced over ``dim``."""
    masked = torch.where(_bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the masked entries. x, mask (B, T) -> scalar, or reduced over ``dim``.

    An empty mask (or an empty row with ``dim``) gives 0 instead of NaN.
    """
    n = _bool_mask(mask).sum() if dim is None else _bool_mask(mask).sum(dim=dim)
    return masked_sum(x, mask, dim) / n.clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all masked entries. x, mask (B, T) -> scalar.

    ``unbiased`` applies Bessel's correction n / (n - 1). Unlike TRL this does not raise on n < 2 (that would need
    a host sync); it returns 0 there.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = _bool_mask(mask).sum().to(x.dtype)
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with mean/var over the masked entries. x, mask (B, T) -> (B, T).

    With ``shift_mean=False`` the mean is added back (scale only). Padding positions are set to 0 (not left
    untouched), so whitened advantages can be fed to the loss without re-masking.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(_bool_mask(mask), whitened, torch.zeros((), dtype=x.dtype, device=x.device))


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str,
                action_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3). (B, T) -> (B, T), at least fp32.

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1 with log r = logprobs - ref_logprobs. The estimate
    itself is clamped to [-10, 10], as OpenRLHF's ``compute_approx_kl`` does: where the policy's probability falls
    far below the reference's, k3 grows like 1/r (e^20 - 21 at log r = -20) and one token would swamp the batch.
    Zero where ``action_mask == 0``.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"--kl_estimator {estimator!r}: expected one of {', '.join(KL_ESTIMATORS)}")
    log_ratio = upcast(logprobs) - upcast(ref_logprobs)  # (B, T)
    if action_mask is not None:
        # Zero padding before exp so garbage there cannot make inf/NaN in values or gradients.
        log_ratio = torch.where(_bool_mask(action_mask), log_ratio, torch.zeros_like(log_ratio))
    if estimator == "k1":
        est = log_ratio
    elif estimator == "k2":
        est = 0.5 * log_ratio ** 2
    else:
        # exp is kept finite for the backward (0 * inf would be NaN); within [-20, 20] the estimate has already
        # passed the clamp below (k3 = 10 at log(ref / p) = 2.6 and -11), so this bound changes no value.
        neg = -log_ratio.clamp(-20.0, 20.0)  # log(ref / p)
        est = neg.exp() - neg - 1
    return est.clamp(-KL_ESTIMATE_CLAMP, KL_ESTIMATE_CLAMP)


LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
"""How a per-token loss becomes the step's loss (each a mean over the whole step, every micro-batch and DP rank):
``token_mean`` over all response tokens (today's default, DAPO's token-level loss), ``seq_mean_token_mean`` each
sequence's token mean averaged over sequences (GRPO's original form; GSPO), ``seq_mean_token_sum`` each
sequence's token sum averaged over sequences (verl's name)."""
POLICY_LOSS_TYPES = ("ppo", "gspo") + POLICY_VARIANTS
"""ppo, gspo and verl's ``rlhf.algo.policy_variants`` (cispo, sapo, clip_cov, kl_cov)"""


def aggregate(loss: torch.Tensor, action_mask: torch.Tensor, mode: str = "token_mean"):
    """``(sum, count)`` of a per-token loss (B, T) in megatron's per-token contract for ``mode``
    (``LOSS_AGG_MODES``): the step divides the summed sums by the summed counts, so ``count`` is tokens for
    ``token_mean`` and sequences with at least one token otherwise."""
    mask = _bool_mask(action_mask)
    if mode == "token_mean":
        return masked_sum(loss, mask), _count(mask)
    per_seq = masked_sum(loss, mask, dim=-1)  # (B,)
    n_tok = mask.sum(dim=-1)  # (B,)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / n_tok.clamp(min=1).to(per_seq.dtype)
    elif mode != "seq_mean_token_sum":
        raise ValueError(f"--loss_agg_mode {mode!r}: expected one of {', '.join(LOSS_AGG_MODES)}")
    return per_seq.sum(), (n_tok > 0).sum().to(torch.int)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                action_mask: torch.Tensor, eps_clip: float = 0.2, eps_clip_high: float | None = None,
                rollout_is_weights: torch.Tensor | None = None, dual_clip: float | None = None,
                policy_loss_type: str = "ppo", loss_agg_mode: str = "token_mean",
                variant: PolicyVariantConfig | None = None, generator: torch.Generator | None = None):
    """PPO clipped surrogate: ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)`` per token.

    logprobs (B, T) with grad; old_logprobs, advantages, action_mask (B, T). ``eps_clip_high`` (DAPO clip-higher)
    defaults to ``eps_clip``. ``dual_clip`` C > 1 (dual-clip PPO): for A < 0 the loss is at most ``-C * A``.
    ``policy_loss_type`` "gspo" (GSPO): one ratio per sequence, ``exp(mean over its tokens of log ratio)``, clipped
    as a whole (the gradient reaches every token through the mean), as OpenRLHF computes it. ``rollout_is_weights``
    (B, T), optional, multiplies the per-token loss (truncated importance sampling for rollout/trainer mismatch);
    it is treated as a constant. ``loss_agg_mode``: see ``aggregate``. CISPO, SAPO, Clip-Cov and KL-Cov
    (``policy_loss_type`` in ``POLICY_VARIANTS``, their parameters in ``variant``, Clip-Cov's draw from
    ``generator``): ``rlhf.algo.policy_variants``, weighted and aggregated as PPO's.

    Returns ``(loss_sum, count, metrics)``: the aggregated loss sum and its count (``aggregate``), and
    ``{"policy_loss", "clip_frac", "approx_kl", "ratio"}`` as per-token ``[sum, n_tokens]``. A token counts as
    clipped when the clipped term is the active one (its gradient is 0). approx_kl is ``0.5 * (logprobs -
    old_logprobs)^2``.
    """
    mask = _bool_mask(action_mask)
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    log_ratio = torch.where(mask, upcast(logprobs) - upcast(old_logprobs), torch.zeros((), device=logprobs.device))
    adv = upcast(advantages)
    if policy_loss_type in POLICY_VARIANTS:
        lp = torch.where(mask, upcast(logprobs), torch.zeros((), device=logprobs.device))
        loss, clipped, ratio = variant_loss(policy_loss_type, log_ratio, lp, adv, mask, eps_clip, eps_high,
                                            variant or PolicyVariantConfig(), generator)
    elif policy_loss_type == "gspo":
        seq = log_ratio.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1)  # (B, 1)
        ratio = seq.exp().expand_as(log_ratio)
    elif policy_loss_type == "ppo":
        ratio = log_ratio.exp()  # (B, T)
    else:
        raise ValueError(f"--policy_loss_type {policy_loss_type!r}: expected one of {', '.join(POLICY_LOSS_TYPES)}")
    if policy_loss_type not in POLICY_VARIANTS:
        surr1, surr2 = ratio * adv, ratio.clamp(1.0 - eps_clip, 1.0 + eps_high) * adv
        clip1 = torch.min(surr1, surr2)
        if dual_clip is not None:
            clip1 = torch.where(adv < 0, torch.max(clip1, dual_clip * adv), clip1)
        loss, clipped = -clip1, (surr2 < surr1).float()  # (B, T); clipped: the clipped term is the active one
    if rollout_is_weights is not None:
        loss = loss * upcast(rollout_is_weights.detach())
    loss_agg, count = aggregate(loss, mask, loss_agg_mode)
    n = _count(mask)
    with torch.no_grad():
        metrics = {
            "policy_loss": [masked_sum(loss.detach(), mask), n],
            "clip_frac": [masked_sum(clipped, mask), n],
            "approx_kl": [masked_sum(0.5 * log_ratio ** 2, mask), n],
            "ratio": [masked_sum(ratio, mask), n],
        }
    return loss_agg, count, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor,
               value_clip: float | None = None):
    """Critic loss ``0.5 * max((v - R)^2, (clip(v, old - c, old + c) - R)^2)``, or ``0.5 * (v - R)^2`` when
    ``value_clip`` is None. values (B, T) with grad; old_values, returns, action_mask (B, T).

    Returns ``(loss_sum, n_tokens, metrics)`` with ``{"value_loss", "vf_clip_frac", "values"}`` as ``[sum, n]``;
    vf_clip_frac counts tokens where the clipped term is the larger (active) one.
    """
    mask = _bool_mask(action_mask)
    v, r = upcast(values), upcast(returns)
    unclipped = (v - r) ** 2  # (B, T)
    if value_clip is not None:
        old = upcast(old_values)
        v_clipped = old + (v - old).clamp(-value_clip, value_clip)
        clipped = (v_clipped - r) ** 2
        loss = 0.5 * torch.max(unclipped, clipped)
        clip_ind = (clipped > unclipped).float()
    else:
        loss = 0.5 * unclipped
        clip_ind = torch.zeros_like(unclipped)
    loss_sum = masked_sum(loss, mask)
    n = _count(mask)
    with torch.no_grad():
        metrics = {
            "value_loss": [loss_sum.detach(), n],
            "vf_clip_frac": [masked_sum(clip_ind, mask), n],
            "values": [masked_sum(v.detach(), mask), n],
        }
    return loss_sum, n, metrics


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor, estimator: str = "k3"):
    """KL to the reference policy as a loss term (GRPO's ``use_kl_loss`` recipe), not a reward penalty.

    logprobs (B, T) with grad; ref_logprobs, action_mask (B, T). Returns ``(kl_sum, n_tokens, {"kl_loss": [...]})``;
    the caller scales it by the KL coefficient and adds it to the policy loss sum.
    """
    kl = kl_estimate(logprobs, ref_logprobs, estimator, action_mask)
    kl_sum = masked_sum(kl, action_mask)
    n = _count(action_mask)
    return kl_sum, n, {"kl_loss": [kl_sum.detach(), n]}


# ------------------------------------------------------------------------------ the PPO step's loss closures
ACTOR_METRICS = ("policy_loss", "clip_frac", "approx_kl", "ratio", "entropy")
CRITIC_METRICS = ("value_loss", "vf_clip_frac", "values")


@dataclass(frozen=True)
class ActorLossConfig:
    """The actor's loss, from the PPO flags (``from_args``): checked once, before any model."""

    eps_clip_low: float = 0.2
    """--eps_clip, or the first of --eps_clip_low_high: ratios below 1 - this are clipped"""
    eps_clip_high: float = 0.2
    """the second of --eps_clip_low_high (DAPO's clip-higher), else --eps_clip"""
    dual_clip: float | None = None
    """--dual_clip C > 1: for negative advantages the loss is at most -C * A (dual-clip PPO)"""
    policy_loss_type: str = "ppo"
    """--policy_loss_type (``POLICY_LOSS_TYPES``)"""
    variant: PolicyVariantConfig = field(default_factory=PolicyVariantConfig)
    """SAPO's temperatures, Clip-Cov's and KL-Cov's ratios, bounds and coefficient (--tau_pos, --clip_cov_ratio, ...)"""
    loss_agg_mode: str = "token_mean"
    """--loss_agg_mode (``LOSS_AGG_MODES``); GSPO and SAPO without the flag: seq_mean_token_mean, as OpenRLHF forces
    it for GSPO and verl for SAPO"""
    entropy_coef: float = 0.0
    """--entropy_coef: ``- entropy_coef * entropy`` joins the loss, aggregated as the policy loss"""
    kl_in_loss: bool = False
    """``kl_coef * KL`` joins the loss, aggregated as the policy loss (``rlhf.algo.kl.kl_in_loss``: the
    estimator's place, or --use_kl_loss / --no-use_kl_loss)"""
    kl_estimator: str = "k3"
    correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """the rollout corrections (``rlhf.algo.rollout_correction``): --use_tis with --is_correction_type, --tis_cap,
    --tis_floor; --rollout_rs with --rollout_rs_threshold"""
    old_from_update: bool = False
    """one on-policy update per batch: the old log-probs are this forward's, detached (ratio 1), and the
    generator-vs-trainer drift is measured here (``rollout_logprob_drift``, ``rollout_logprob_drift_max``)"""
    old_from_rollout: bool = False
    """--use_rollout_logprobs: the old log-probs are the generator's; with a correction, verl's bypass mode"""
    corrected_in_experience: bool = False
    """verl's decoupled mode (the trainer's old log-probs come from make_experience): --rollout_rs already took
    its tokens out of the batch's action_mask and --rollout_is's weights are in the batch (``rollout_is_weights``);
    the loss applies them and does not reject again"""

    @property
    def bypass(self) -> bool:
        """verl's bypass mode: the generator's log-probs as the old ones, the correction computed in the loss
        against the current policy (``rlhf.algo.rollout_correction``)."""
        return self.old_from_rollout and (self.correction.rollout_rs is not None or self.correction.rollout_is
                                          is not None)

    @property
    def gspo_against_rollout(self) -> bool:
        """GSPO with --use_tis, as OpenRLHF computes it (openrlhf/models/loss.py ``PolicyLoss.forward`` at
        3c3be6234e0c: with ``enable_vllm_is_correction`` GSPO's ``log_ratio = log_probs - rollout_log_probs``, and the
        IS block runs for ``policy_loss_type == "ppo"`` only): the sequence ratio against the generator's log-probs,
        no per-token weight, --is_correction_type and the bounds unused."""
        return self.policy_loss_type == "gspo" and self.correction.use_tis

    def __post_init__(self) -> None:
        if not (0 <= self.eps_clip_low < 1 and self.eps_clip_high >= 0):
            raise ValueError(f"--eps_clip_low_high {self.eps_clip_low} {self.eps_clip_high}: LOW must be in [0, 1) "
                             "and HIGH >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"--dual_clip must be > 1 (dual-clip PPO's lower bound -C * A), got {self.dual_clip}")
        if self.policy_loss_type not in POLICY_LOSS_TYPES:
            raise ValueError(f"--policy_loss_type {self.policy_loss_type!r}: expected one of "
                             f"{', '.join(POLICY_LOSS_TYPES)}")
        if self.policy_loss_type in POLICY_VARIANTS and (self.dual_clip is not None or self.bypass):
            raise ValueError(f"--policy_loss_type {self.policy_loss_type} with "
                             f"{'--dual_clip' if self.dual_clip is not None else 'verl bypass mode'}: not in its "
                             "loss (verl's has neither)")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"--loss_agg_mode {self.loss_agg_mode!r}: expected one of {', '.join(LOSS_AGG_MODES)}")
        if self.entropy_coef < 0:
            raise ValueError(f"--entropy_coef must be >= 0 (an entropy bonus), got {self.entropy_coef}")

    @classmethod
    def from_parts(cls, algo, correction: RolloutCorrectionConfig, estimator,
                   variant: PolicyVariantConfig | None = None) -> "ActorLossConfig":
        """From the PPO job's algorithm part (the clip, loss and KL flags), its rollout correction part and its
        policy-variant part."""
        from rlhf.algo.kl import kl_in_loss

        low, high = algo.eps_clip_low_high if algo.eps_clip_low_high is not None else (algo.eps_clip, algo.eps_clip)
        mode = algo.loss_agg_mode or ("seq_mean_token_mean" if algo.policy_loss_type in ("gspo", "sapo")
                                      else "token_mean")
        return cls(eps_clip_low=low, eps_clip_high=high, dual_clip=algo.dual_clip,
                   policy_loss_type=algo.policy_loss_type, variant=variant or PolicyVariantConfig(),
                   loss_agg_mode=mode, entropy_coef=algo.entropy_coef or 0.0,
                   kl_in_loss=kl_in_loss(estimator, getattr(algo, "use_kl_loss", None)),
                   kl_estimator=algo.kl_estimator, correction=correction,
                   old_from_update=getattr(algo, "old_logprobs_source", "forward") == "update",
                   old_from_rollout=getattr(algo, "old_logprobs_source", "forward") == "rollout",
                   corrected_in_experience=getattr(algo, "old_logprobs_source", "forward") == "forward"
                   and (correction.rollout_rs is not None or correction.rollout_is is not None))

    def correction_metric_keys(self) -> tuple[str, ...]:
        """The correction's ``METRICS`` the loss reports: verl's decoupled mode counted its rejection with the
        experience, the loss reports the IS weight (all of them if --use_tis corrects in the loss besides)."""
        if not self.corrected_in_experience or self.correction.use_tis:
            return self.correction.metric_keys()
        return ("rollout_is_weight",) if self.correction.rollout_is is not None else ()

    @classmethod
    def from_args(cls, args, estimator) -> "ActorLossConfig":
        """From a parsed command line (its flat Namespace; a flag missing from a hand-built one takes its default)."""
        return cls.from_parts(args, RolloutCorrectionConfig.from_namespace(args), estimator)


def make_actor_loss(logprobs_fn, cfg: ActorLossConfig, kl_coef: float = 0.0, seed: int = 0):
    """The actor's loss over one training micro-batch, in megatron's per-token contract.

    ``logprobs_fn(batch, output) -> (logprobs, entropy)``, each (B, T), from the model's output. The batch holds
    ``old_logprobs``, ``advantages``, ``action_mask`` (B, T), plus ``ref_logprobs`` when ``cfg.kl_in_loss`` (GRPO:
    ``kl_coef * kl`` is added to the loss) and ``vllm_logprobs`` with a rollout correction (``cfg.correction``: its
    weights multiply the policy loss; a token its rejection drops leaves the mask of every term and of the count).
    The KL and entropy terms are aggregated as the policy loss (``cfg.loss_agg_mode``). Metrics: ``ACTOR_METRICS``
    (+ ``kl_loss``, + ``cfg.correction.metric_keys()``), per token. ``seed`` starts Clip-Cov's generator (the same
    draws on every TP rank of a micro-batch)."""
    gen = torch.Generator().manual_seed(seed) if cfg.policy_loss_type == "clip_cov" else None
    in_loss = cfg.correction
    if cfg.corrected_in_experience:  # the rejection is in the batch's mask, verl's weights in the batch
        from dataclasses import replace

        in_loss = replace(cfg.correction, rollout_rs=None, rollout_rs_threshold=None, rollout_is=None,
                          rollout_is_batch_normalize=False)

    def loss_fn(batch: dict, output: torch.Tensor):
        lp, ent = logprobs_fn(batch, output)
        mask = resp = batch["action_mask"]
        old = lp.detach() if cfg.old_from_update else batch["old_logprobs"]
        if cfg.bypass:
            loss, count, metrics, mask = _bypass_loss(lp, batch, cfg)
        else:
            corr = None
            if in_loss.enabled:
                corr = rollout_correction(old, batch["vllm_logprobs"], mask, in_loss)
                if corr.keep is not None:  # verl's rejection: the token leaves the response mask
                    mask = _bool_mask(resp) & corr.keep
            weights, base = (None if corr is None else corr.weights), old
            if "rollout_is_weights" in batch:  # verl's, computed when the experience was made
                weights = batch["rollout_is_weights"]
            if cfg.gspo_against_rollout:  # OpenRLHF's GSPO with its IS correction: the sequence ratio against
                weights, base = None, batch["vllm_logprobs"]  # the generator's log-probs, no per-token weight
            loss, count, metrics = policy_loss(lp, base, batch["advantages"], mask,
                                               eps_clip=cfg.eps_clip_low, eps_clip_high=cfg.eps_clip_high,
                                               rollout_is_weights=weights,
                                               dual_clip=cfg.dual_clip, policy_loss_type=cfg.policy_loss_type,
                                               loss_agg_mode=cfg.loss_agg_mode, variant=cfg.variant, generator=gen)
            if corr is not None:
                metrics.update(corr.metrics)
            if "rollout_is_weights" in batch and cfg.correction.enabled:
                kept = _bool_mask(mask)
                metrics["rollout_is_weight"] = [masked_sum(upcast(weights), kept), _count(kept)]
        n = _count(mask)
        metrics["entropy"] = [masked_sum(ent.detach(), mask), n]
        if cfg.old_from_update:
            drift = (upcast(lp.detach()) - upcast(batch["vllm_logprobs"])).abs()
            metrics["rollout_logprob_drift"] = [masked_sum(drift, resp), _count(resp)]
            # a "*_max" metric: reduced by its maximum (rlhf.runtime.role.ModelRole.reduce_metrics)
            metrics["rollout_logprob_drift_max"] = [torch.where(_bool_mask(resp), drift, 0).max(), _count(resp)]
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * aggregate(upcast(ent), mask, cfg.loss_agg_mode)[0]
        if cfg.kl_in_loss and "ref_logprobs" in batch:
            kl = kl_estimate(lp, batch["ref_logprobs"], cfg.kl_estimator, mask)
            loss = loss + kl_coef * aggregate(kl, mask, cfg.loss_agg_mode)[0]
            metrics["kl_loss"] = [masked_sum(kl.detach(), mask), n]
        elif cfg.kl_in_loss:
            metrics["kl_loss"] = [torch.zeros(()), n]
        return loss, count, metrics

    return loss_fn


def _bypass_loss(lp: torch.Tensor, batch: dict, cfg: ActorLossConfig):
    """verl's ``compute_policy_loss_bypass_mode`` (verl/trainer/ppo/core_algos.py at 1dda039b): the old log-probs are
    the generator's; --rollout_is's weights and --rollout_rs's rejection are computed here against the current
    policy (``lr = logprobs.detach() - rollout_logprobs``, per micro-batch). ``ppo_clip``: the clipped ratio
    ``p / p_rollout`` on the kept tokens, weights not applied (verl: "would be double-counting"); ``reinforce``:
    ``-A * logprobs * w`` (w = 1 without --rollout_is), unclipped. Returns the policy loss, its count, metrics and
    the mask used."""
    c = cfg.correction
    resp = _bool_mask(batch["action_mask"])
    rollout = batch["vllm_logprobs"]
    with torch.no_grad():
        lr = torch.where(resp, upcast(lp.detach()) - upcast(rollout), torch.zeros((), device=lp.device))
        keep = rejection_keep(lr, resp, c.rs_bounds()) if c.rollout_rs is not None else None
        w = verl_is_weights(lr, resp, c.rollout_is, c.rollout_is_threshold) if c.rollout_is is not None else None
    mask = resp & keep if keep is not None else resp
    if c.rollout_correction_loss_type == "reinforce":
        w_ = w if w is not None else torch.ones_like(lr)
        per_token = -upcast(batch["advantages"]) * upcast(lp) * w_
        loss, count = aggregate(per_token, mask, cfg.loss_agg_mode)
        n = _count(mask)
        metrics = {"policy_loss": [masked_sum(per_token.detach(), mask), n], "clip_frac": [torch.zeros(()), n],
                   "approx_kl": [masked_sum(0.5 * lr ** 2, mask), n], "ratio": [masked_sum(lr.exp(), mask), n]}
    else:
        loss, count, metrics = policy_loss(lp, rollout, batch["advantages"], mask, eps_clip=cfg.eps_clip_low,
                                           eps_clip_high=cfg.eps_clip_high, dual_clip=cfg.dual_clip,
                                           policy_loss_type=cfg.policy_loss_type, loss_agg_mode=cfg.loss_agg_mode)
    n_resp = _count(resp)
    zero = torch.zeros((), device=lp.device)
    metrics["rollout_corr_masked_frac"] = [torch.where(resp & ~mask, 1.0, zero).sum(), n_resp]
    metrics["rollout_corr_clipped_frac"] = [torch.where(resp & (lr.exp() > c.rollout_is_threshold), 1.0, zero).sum()
                                            if w is not None else zero, n_resp]
    metrics["rollout_is_weight"] = [torch.where(mask, w if w is not None else torch.ones_like(lr), zero).sum(),
                                    _count(mask)]
    return loss, count, metrics, mask


def make_critic_loss(values_fn, *, value_clip: float):
    """The critic's clipped value loss over one training micro-batch. ``values_fn(output, batch)`` -> (B, T)
    values from the model's output; the batch holds the rollout's ``values``, ``returns``, ``action_mask``.
    Metrics: ``CRITIC_METRICS``."""
    def loss_fn(batch: dict, output: torch.Tensor):
        return value_loss(values_fn(output, batch), batch["values"], batch["returns"], batch["action_mask"],
                          value_clip=value_clip)

    return loss_fn
