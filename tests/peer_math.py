"""The peers' formulas, written out from their source (not from ours) for the tests that check a real job's dumped
tensors against them (tests/ppo/test_job_formulas.py, tests/dpo/test_dpo_formulas.py). Plain tensor code, no
process groups; inputs (B, T) response tensors with a 0/1 ``mask``.

* OpenRLHF at 3c3be6234e0c (2026-08-13), Apache-2.0: ``openrlhf/models/utils.py`` (``compute_approx_kl``,
  ``compute_reward``), ``openrlhf/trainer/ppo_utils/experience_maker.py`` (``get_advantages_and_returns``,
  ``get_cumulative_returns``), ``openrlhf/models/loss.py`` (``PolicyLoss``, ``ValueLoss``, ``DPOLoss``,
  ``aggregate_loss``), ``openrlhf/trainer/ray/ppo_actor.py`` (``training_step``: the KL and entropy terms).
* verl, Apache-2.0: ``verl/trainer/ppo/rollout_corr_helper.py`` at b178a3cd (2026-01-29:
  ``compute_rollout_rejection_mask``) and 1dda039b (``compute_rollout_correction_weights`` with its batch
  normalisation, ``compute_policy_loss_bypass_mode``), ``verl/trainer/ppo/core_algos.py`` at 1dda039b
  (``compute_policy_loss_vanilla``); ``verl/trainer/ppo/core_algos.py`` at b178a3cd (2026-01-29:
  ``compute_policy_loss_cispo``, ``compute_policy_loss_sapo``, ``compute_policy_loss_clip_cov``,
  ``compute_policy_loss_kl_cov``, ``agg_loss``) with ``verl/utils/torch_functional.py`` ``masked_mean`` at the same
  commit (its ``+ 1e-8``). verl's own module cannot be imported here (it needs omegaconf, its configs and ray)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SAFETY_BOUND = 20.0  # verl's rollout_corr_helper


# ------------------------------------------------------------------------------------------------------ OpenRLHF
def openrlhf_approx_kl(lp, base, estimator):
    """``compute_approx_kl``: k1 / k2 / k3, clamped to [-10, 10]."""
    log_ratio = lp.double() - base.double()
    if estimator == "k2":
        log_ratio = log_ratio ** 2 / 2.0
    elif estimator == "k3":
        log_ratio = (-log_ratio).exp() - 1 + log_ratio
    return log_ratio.clamp(min=-10, max=10)


def openrlhf_compute_reward(r, kl_coef, kl, mask):
    """``compute_reward``: ``-kl_coef * kl`` per token, the sequence's reward on its last response token."""
    eos = mask.size(1) - 1 - mask.long().fliplr().argmax(dim=1, keepdim=True)
    return torch.zeros_like(kl).scatter_(1, eos, r.unsqueeze(1).to(kl.dtype)) - kl_coef * kl


def openrlhf_gae(values, rewards, mask, gamma, lambd):
    """``get_advantages_and_returns`` (before the batch whitening): (advantages, returns)."""
    values, rewards = mask * values, mask * rewards
    last, out, T = 0, [], rewards.size(1)
    for t in reversed(range(T)):
        nv = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * nv - values[:, t]
        last = delta + gamma * lambd * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def openrlhf_cumulative_returns(rewards, mask, gamma):
    """``get_cumulative_returns``."""
    returns, run = torch.zeros_like(rewards), torch.zeros(rewards.size(0), dtype=rewards.dtype)
    for t in reversed(range(rewards.size(1))):
        run = (mask * rewards)[:, t] + gamma * run
        returns[:, t] = run
    return returns


def openrlhf_policy_loss_per_token(lp, old, adv, mask, *, eps_low=0.2, eps_high=0.2, dual_clip=None,
                                   policy_loss_type="ppo", rollout_lp=None, is_correction=None):
    """``PolicyLoss.forward`` before ``aggregate_loss``: the per-token loss (B, T); ``is_correction`` =
    (type, low, high) for ``enable_vllm_is_correction`` (tis | icepop | seq-mask-tis)."""
    lp, old, adv, mask = lp.double(), old.double(), adv.double(), mask.double()
    raw = lp - old
    if policy_loss_type == "ppo":
        ratio = raw.clamp(min=-20.0, max=20.0).exp()
    else:  # gspo
        log_ratio = lp - rollout_lp.double() if is_correction else raw
        ratio = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
        ratio = ratio.exp().unsqueeze(-1) * mask
    surr1, surr2 = ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    if dual_clip is None:
        loss = -torch.min(surr1, surr2)
    else:
        clip1 = torch.min(surr1, surr2)
        loss = -torch.where(adv < 0, torch.max(clip1, dual_clip * adv), clip1)
    if is_correction and policy_loss_type == "ppo":
        kind, low, high = is_correction
        rlr = old - rollout_lp.double()
        if kind == "icepop":
            w = rlr.exp()
            loss = w * ((w >= low) & (w <= high)) * loss
        elif kind == "seq-mask-tis":
            seq = ((rlr * mask).sum(-1) / mask.sum(-1).clamp(min=1)).exp()
            loss = ((seq >= low) & (seq <= high)).unsqueeze(-1) * rlr.exp() * loss
        else:
            loss = rlr.exp().clamp(min=low, max=high) * loss
    return loss


def openrlhf_value_loss_per_token(values, old_values, returns, clip_eps):
    """``ValueLoss.forward`` before ``aggregate_loss`` (its 0.5 included)."""
    values, old_values, returns = values.double(), old_values.double(), returns.double()
    if clip_eps is None:
        return 0.5 * (values - returns) ** 2
    clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    return 0.5 * torch.max((clipped - returns) ** 2, (values - returns) ** 2)


def openrlhf_dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing=0.0, ipo=False):
    """``DPOLoss.forward``: (mean loss, chosen rewards, rejected rewards)."""
    chosen, rejected, ref_chosen, ref_rejected = (x.double() for x in (chosen, rejected, ref_chosen, ref_rejected))
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    if ipo:
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    return losses.mean(), beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)


# --------------------------------------------------------------------------------------------------------- verl
def verl_masked_mean(x, mask, axis=None):
    return (x * mask).sum() / mask.sum() if axis is None else (x * mask).sum(axis) / mask.sum(axis)


def verl_is_weights(old, rollout, mask, level, threshold, normalize):
    """``compute_rollout_correction_weights`` (TIS, one threshold), then its batch normalisation."""
    log_ratio = old.double() - rollout.double()
    mask = mask.double()
    if level == "token":
        raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        s = (log_ratio * mask).sum(-1, keepdim=True)
        raw = torch.exp(torch.clamp(s, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    w = raw.clamp(max=threshold)
    if normalize:
        if level == "token":
            mean = verl_masked_mean(w, mask)
        else:
            seq_w = verl_masked_mean(w, mask, axis=-1)
            seq_mask = (mask.sum(-1) > 0).to(w.dtype)
            mean = (seq_w * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
    return w


def verl_token_k1_keep(old, rollout, mask, lower, upper):
    """``compute_rollout_rejection_mask`` with ``token_k1`` (``log_ratio = old - rollout``, ``k1 = -log_ratio``,
    kept where ``log(lower) <= k1 <= log(upper)``), as a bool (B, T)."""
    k1 = -torch.clamp(old.double() - rollout.double(), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    return mask.bool() & (k1 >= math.log(lower)) & (k1 <= math.log(upper))


def verl_vanilla_per_token(old, lp, adv, low=0.2, high=0.2, c=3.0):
    """``compute_policy_loss_vanilla`` before its aggregation: the per-token loss, dual-clipped at ``c``."""
    ratio = torch.exp(torch.clamp(lp.double() - old.double(), min=-20.0, max=20.0))
    adv = adv.double()
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(l1, l2)
    return torch.where(adv < 0, torch.min(-adv * c, clip1), clip1)


def verl_agg_loss(loss_mat, loss_mask, mode):
    """``agg_loss`` (dp_size 1, the micro-batch's own counts): ``token-mean``, ``seq-mean-token-mean``."""
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    seq_mask = loss_mask.sum(-1)
    seq_losses = (loss_mat * loss_mask).sum(-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).double()
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


def verl_masked_mean_eps(x, mask):
    """verl_F.masked_mean: ``sum(x * mask) / (sum(mask) + 1e-8)``."""
    return (x * mask).sum() / (mask.sum() + 1e-8)


def verl_cispo(old, lp, adv, mask, low=0.2, high=0.2):
    """``compute_policy_loss_cispo``: (per-token loss, aggregated token-mean loss, clip fraction)."""
    negative_approx_kl = torch.clamp(lp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio_sg = torch.clamp(ratio, 1 - low, 1 + high).detach()
    pg_losses = -clipped_ratio_sg * adv * lp
    clipfrac = verl_masked_mean_eps((ratio != torch.clamp(ratio, 1 - low, 1 + high)).double(), mask)
    return pg_losses, verl_agg_loss(pg_losses, mask, "token-mean"), clipfrac


def verl_sapo(old, lp, adv, mask, tau_pos=1.0, tau_neg=1.05):
    """``compute_policy_loss_sapo``: (per-token loss, seq-mean-token-mean loss, which verl always takes)."""
    tau_pos = torch.as_tensor(tau_pos, dtype=adv.dtype)
    tau_neg = torch.as_tensor(tau_neg, dtype=adv.dtype)
    ratio = torch.exp(torch.clamp(lp - old, min=-20.0, max=20.0))
    taus = torch.where(adv > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = -gates * adv
    return pg_losses, verl_agg_loss(pg_losses, mask, "seq-mean-token-mean")


def verl_clip_cov(old, lp, adv, mask, low=0.2, high=0.2, clip_cov_ratio=0.0002, lb=1.0, ub=5.0):
    """``compute_policy_loss_clip_cov`` (its ``torch.randperm`` on the global generator): (per-token loss,
    token-mean loss, corr)."""
    ratio = torch.exp(lp - old)
    pg_losses1 = -adv * ratio
    corr = torch.ones_like(adv)
    pg_losses2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (mask > 0)
    cov_all = (adv - verl_masked_mean_eps(adv, mask)) * (lp - verl_masked_mean_eps(lp.detach(), mask))
    cov_all[mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < ub) & (cov_all > lb) & (mask > 0))
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    else:
        top_k_idx = torch.empty((0, 2), dtype=torch.long)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    return pg_losses, verl_agg_loss(pg_losses, mask, "token-mean"), corr


def verl_kl_cov(old, lp, adv, mask, kl_cov_ratio=0.0002, ppo_kl_coef=0.1):
    """``compute_policy_loss_kl_cov``: (per-token loss, token-mean loss)."""
    negative_approx_kl = lp - old
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -adv * ratio
    pg_losses_kl = -adv * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1
    all_valid = mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = adv[all_valid].detach().reshape(-1).cpu()
    all_valid_logp = lp[all_valid].detach().reshape(-1).cpu()
    k = min(kl_cov_ratio, len(all_valid_adv))
    if k != 0:
        cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
        k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
        large_cov_idxs = torch.topk(cov_lst_all, k_percent_nums, largest=True).indices
        if len(large_cov_idxs) != 0:
            large_cov_idxs = all_valid_idx[large_cov_idxs]
            w = adv.shape[1]
            pg_losses[large_cov_idxs // w, large_cov_idxs % w] = pg_losses_kl[large_cov_idxs // w,
                                                                              large_cov_idxs % w]
    return pg_losses, verl_agg_loss(pg_losses, mask, "token-mean")


# ----------------------------------------------------------------------------------------------- OpenAI HumanEval
def humaneval_pass_at_k(n: int, c: int, k: int) -> float:
    """``estimate_pass_at_k``'s estimator (openai/human-eval, human_eval/evaluation.py at 6d43fb98, MIT):
    ``1 - prod(1 - k / arange(n - c + 1, n + 1))``, 1 when ``n - c < k``."""
    import numpy as np

    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
