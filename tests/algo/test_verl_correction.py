"""verl's rollout correction where verl applies it (verl-project/verl at 1dda039b, written out below with the file):
the importance weights at token and sequence level with their batch normalisation
(``verl/trainer/ppo/rollout_corr_helper.py`` ``compute_rollout_correction_weights``); the rejection mask written into
the response mask before the advantages and the critic (``verl/trainer/ppo/ray_trainer.py`` ``fit``), so that GAE,
REINFORCE++ and their whitening skip the rejected tokens while GRPO's group statistics keep every sample
(``verl/trainer/ppo/core_algos.py``); bypass mode's loss (``compute_policy_loss_bypass_mode``) with ``ppo_clip`` and
``reinforce``. Pure tensors, fp64, one rank (the experience step and ``compute_advantages`` as the trainer calls
them). Each test has a control that the case can fail."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peer_math import SAFETY_BOUND, verl_is_weights, verl_masked_mean
from rlhf.algo.rollout_correction import RolloutCorrectionConfig, experience_correction

F64 = torch.float64


# ---- verl, written out -------------------------------------------------------------------------------------------
def verl_masked_whiten(values, mask):
    """verl/utils/torch_functional.py ``masked_whiten``: unbiased variance, ``rsqrt(var + 1e-8)``."""
    mean = verl_masked_mean(values, mask)
    var = verl_masked_mean((values - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """``compute_gae_advantage_return``, then ``masked_whiten`` as verl's compute_advantage does."""
    nextvalues, lastgaelam, rev = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        rev.append(lastgaelam)
    adv = torch.stack(rev[::-1], dim=1)
    returns = adv + values
    return verl_masked_whiten(adv, response_mask) * response_mask, returns


def verl_reinforce_pp(token_level_rewards, response_mask, gamma):
    """``compute_reinforce_plus_plus_outcome_advantage``."""
    returns = torch.zeros_like(token_level_rewards)
    running = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        new = token_level_rewards[:, t] + gamma * running
        returns[:, t] = new * response_mask[:, t]
        running = new * response_mask[:, t] + running * (1 - response_mask[:, t])
    return verl_masked_whiten(returns, response_mask) * response_mask, returns


def verl_grpo(token_level_rewards, response_mask, n, eps=1e-6):
    """``compute_grpo_outcome_advantage`` (groups of ``n`` consecutive rows)."""
    scores = token_level_rewards.sum(dim=-1).view(-1, n)
    scores = (scores - scores.mean(-1, keepdim=True)) / (scores.std(-1, keepdim=True) + eps)
    return scores.reshape(-1, 1) * response_mask


def verl_vanilla(old, lp, adv, mask, low=0.2, high=0.2, c=3.0, weights=None):
    """``compute_policy_loss_vanilla`` with ``token-mean`` aggregation."""
    ratio = torch.exp(torch.clamp(lp - old, min=-20.0, max=20.0))
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(l1, l2)
    losses = torch.where(adv < 0, torch.min(-adv * c, clip1), clip1)
    if weights is not None:
        losses = losses * weights
    return verl_masked_mean(losses, mask)


# ---- inputs --------------------------------------------------------------------------------------------------------
def batch(B=8, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([7, 3, 5, 1, 6, 7, 2, 4])[:B]
    mask = torch.arange(T).unsqueeze(0) < lens.unsqueeze(1)  # (B, T) right-padded
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    rollout = old + 0.6 * torch.randn(B, T, generator=g, dtype=F64)  # a generator some versions behind
    return mask, old, rollout, g


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_weights_equal_verls(level, normalize):
    mask, old, rollout, _ = batch()
    cfg = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=2.0, rollout_is_batch_normalize=normalize)
    _, got, metrics = experience_correction(old, rollout, mask, cfg)
    want = verl_is_weights(old, rollout, mask.to(F64), level, 2.0, normalize)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert 0 < (want == 2.0 / (metrics.get("rollout_is_batch_norm_factor", 1.0))).sum() < mask.sum()  # truncation bites
    other = verl_is_weights(old, rollout, mask.to(F64), "sequence" if level == "token" else "token", 2.0, normalize)
    assert (other - want).abs().max() > 0.1  # control: the other level is another weight


def _job(estimator, rs=None, rs_threshold=None, kl_coef_source="forward"):
    algo = SimpleNamespace(old_logprobs_source=kl_coef_source, kl_estimator="k1", use_kl_loss=None, gamma=0.9,
                           lambd=0.8, no_std_norm=False, reward_clip_range=None)
    return SimpleNamespace(algo=algo, batch=SimpleNamespace(n_samples_per_prompt=2), distill=None,
                           correction=RolloutCorrectionConfig(rollout_rs=rs, rollout_rs_threshold=rs_threshold))


def _experience(mask, old, rollout, g, critic):
    from rlhf.ppo.experience import Experience

    B, T = mask.shape
    S = T + 3  # 3 prompt tokens, then the response
    ids = torch.randint(3, 50, (B, S), generator=g)
    am = torch.cat([torch.ones(B, 3, dtype=torch.long), mask.long()], dim=1)
    b = {"input_ids": ids, "attention_mask": am, "response_ids": ids[:, 3:], "action_mask": mask.clone(),
         "resp_pos": torch.arange(2, 2 + T).expand(B, T).clone()}
    return Experience(samples=[], batch=b, old_logprobs=old, vllm_logprobs=rollout,
                      rewards=torch.randn(B, generator=g, dtype=F64), ref_logprobs=old - 0.05,
                      values=torch.randn(B, T, generator=g, dtype=F64) if critic else None)


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "grpo"])
def test_rejection_acts_before_the_advantages_as_in_verl(name):
    """--rollout_rs token_k1 (a token-level rejection, so rows keep holes): make_experience writes the
    rejection into the batch's action_mask (``correct_experience``), then ``compute_advantages`` equals verl's
    pipeline: rewards and KL penalty placed on the response as generated, the recursion and the whitening over the
    kept tokens, GRPO's group statistics over every sample. The critic's micro-batches carry the kept tokens only.
    Control: the same rejection left to the loss alone (the advantages over every token) gives the rejected tokens
    advantages, and with GAE or REINFORCE++ other advantages on the kept tokens too."""
    from rlhf.algo.advantages import get_estimator
    from rlhf.ppo.stages import compute_advantages, correct_experience

    mask, old, rollout, g = batch(seed=3)
    est = get_estimator(name)
    job = _job(name, rs="token_k1", rs_threshold="0.7_1.4")
    mesh = SimpleNamespace(dp=1, dp_rank=0, device=torch.device("cpu"))
    exp = _experience(mask, old, rollout, g, critic=est.needs_critic)
    metrics = correct_experience(exp, job, mesh)
    kept = exp.batch["action_mask"]
    assert 0 < metrics["rollout_rs_masked_frac"] < 1 and (mask & ~kept).any() and kept.sum() > 0
    kl_coef = 0.1
    compute_advantages(exp, exp.rewards, est, kl_coef, job, mesh)
    m0, m1 = mask.to(F64), kept.to(F64)
    last = mask.shape[1] - 1 - mask.long().fliplr().argmax(dim=1)
    scores = torch.zeros_like(old).scatter_(1, last.unsqueeze(1), exp.rewards.unsqueeze(1)) * m0
    kl = (old - (old - 0.05)) * m0  # k1 on the response as generated
    if name == "gae":
        want, _ = verl_gae(scores - kl_coef * kl, exp.values * m0, m1, 0.9, 0.8)
    elif name == "reinforce_plus_plus":
        want, _ = verl_reinforce_pp(scores - kl_coef * kl, m1, 0.9)
    else:  # GRPO: its KL goes to the loss (no KL in the rewards)
        want = verl_grpo(scores, m1, 2)
    got = torch.where(kept, exp.advantages, 0)
    torch.testing.assert_close(got, want * m1, rtol=1e-10, atol=1e-12)
    critic_mb = exp.select(range(mask.shape[0]))
    assert torch.equal(critic_mb["action_mask"], kept)  # the value loss counts the kept tokens
    # control: the rejection in the loss only (advantages over every token) is another advantage
    exp2 = _experience(mask, old, rollout, torch.Generator().manual_seed(7), critic=est.needs_critic)
    exp2.rewards, exp2.values = exp.rewards, exp.values
    compute_advantages(exp2, exp2.rewards, est, kl_coef, job, mesh)
    rejected = mask & ~kept
    assert exp.advantages[rejected].abs().max() == 0 and exp2.advantages[rejected].abs().max() > 1e-3
    if name != "grpo":  # GAE and REINFORCE++ also change on the kept tokens (GRPO's statistics keep every sample)
        assert (torch.where(kept, exp2.advantages, 0) - got).abs().max() > 1e-3


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_mode_equals_verls(loss_type):
    """--use_rollout_logprobs with --rollout_is token --rollout_rs token_k1 (verl's bypass mode): the old log-probs are
    the generator's, the weights and the rejection are computed against the current policy in the loss; ppo_clip is
    verl's vanilla PPO loss against the generator's log-probs without the weights, reinforce ``-A * logp * w``.
    Control: the decoupled loss (old log-probs the trainer's, the same options) is another loss."""
    from rlhf.algo.ppo_losses import ActorLossConfig, make_actor_loss

    mask, old, rollout, g = batch(seed=5)
    lp0 = old + 0.2 * torch.randn(old.shape, generator=g, dtype=F64)  # the current policy, moved by updates
    adv = torch.randn(old.shape, generator=g, dtype=F64)
    corr = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                                   rollout_rs_threshold="0.6_1.6", rollout_correction_loss_type=loss_type)
    cfg = ActorLossConfig(dual_clip=3.0, correction=corr, old_from_rollout=True)
    assert cfg.bypass
    batch_ = {"old_logprobs": rollout, "vllm_logprobs": rollout, "advantages": adv, "action_mask": mask}
    a, b = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
    s, n, _ = make_actor_loss(lambda bt, out: (out, torch.zeros_like(out)), cfg)(batch_, a)
    ours = s / n
    with torch.no_grad():  # verl: compute_rollout_correction_and_rejection_mask(old_log_prob=log_prob, ...)
        w = verl_is_weights(b.detach(), rollout, mask.to(F64), "token", 2.0, False)
        k1 = -torch.clamp(b.detach() - rollout, -SAFETY_BOUND, SAFETY_BOUND)
        import math
        keep = mask & (k1 >= math.log(0.6)) & (k1 <= math.log(1.6))
    assert 0 < keep.sum() < mask.sum()
    if loss_type == "reinforce":
        ref = verl_masked_mean(-adv * b * w, keep.to(F64))
    else:
        ref = verl_vanilla(rollout, b, adv, keep.to(F64))
    ours.backward(), ref.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(torch.where(mask, a.grad, 0), torch.where(mask, b.grad, 0), rtol=1e-10, atol=1e-14)
    decoupled = ActorLossConfig(dual_clip=3.0, correction=corr)  # control
    keep2, w2, _ = experience_correction(old, rollout, mask, corr)
    s2, n2, _ = make_actor_loss(lambda bt, out: (out, torch.zeros_like(out)), decoupled)(
        {"old_logprobs": old, "vllm_logprobs": rollout, "advantages": adv, "action_mask": mask & keep2,
         "rollout_is_weights": w2}, lp0)
    assert abs((s2 / n2).item() - ref.item()) > 1e-3
