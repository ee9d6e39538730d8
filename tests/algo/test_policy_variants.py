"""CISPO, SAPO, Clip-Cov and KL-Cov (``--policy_loss_type``, rlhf/algo/policy_variants.py) against verl's own
functions, transcribed in tests/peer_math.py from verl/trainer/ppo/core_algos.py at b178a3cd: the per-token loss,
the aggregated loss and its gradient with respect to the log-probs, in fp64 on random (B, T) tensors with ragged
masks (an empty row, a one-token row). Clip-Cov's random pick is verl's ``torch.randperm`` on an equally seeded
generator. Each check has a control that the check can fail: the neighbouring loss or parameter gives another
value. The losses in a real job: tests/ppo/test_policy_variants_job.py."""
from __future__ import annotations

import pytest
import torch

from peer_math import verl_cispo, verl_clip_cov, verl_kl_cov, verl_sapo
from rlhf.algo.policy_variants import PolicyVariantConfig
from rlhf.algo.ppo_losses import ActorLossConfig, make_actor_loss, policy_loss

F64 = torch.float64


def _inputs(seed=0, b=6, t=9, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(b, t, generator=g, dtype=F64) * spread - 1.0
    old = lp + torch.randn(b, t, generator=g, dtype=F64) * 0.3  # ratios on both sides of both clip bounds
    adv = torch.randn(b, t, generator=g, dtype=F64) * 2.0
    lens = torch.tensor([9, 5, 1, 3, 0, 7])[:b]
    mask = (torch.arange(t)[None] < lens[:, None]).to(F64)
    return lp, old, adv, mask


def _ours(kind, lp, old, adv, mask, mode="token_mean", **kw):
    """(loss as the step divides it: sum / count, metrics, d loss / d lp)."""
    lp = lp.clone().requires_grad_(True)
    s, n, metrics = policy_loss(lp, old, adv, mask, policy_loss_type=kind, loss_agg_mode=mode, **kw)
    loss = s / n
    grad, = torch.autograd.grad(loss, lp)
    return loss.detach(), metrics, grad


def _verl(fn, lp, old, adv, mask, **kw):
    lp = lp.clone().requires_grad_(True)
    per, loss, *rest = fn(old, lp, adv, mask, **kw)
    grad, = torch.autograd.grad(loss, lp)
    return per.detach(), loss.detach(), grad, rest


@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.1, 0.3)])
def test_cispo_is_verls(low, high):
    """CISPO's loss, gradient and clip fraction equal verl's at two clip ranges; control: its gradient is not PPO's
    (CISPO keeps a gradient on clipped tokens)."""
    lp, old, adv, mask = _inputs()
    loss, metrics, grad = _ours("cispo", lp, old, adv, mask, eps_clip=low, eps_clip_high=high)
    per, want, want_grad, (clipfrac,) = _verl(verl_cispo, lp, old, adv, mask, low=low, high=high)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad * mask, want_grad * mask, rtol=1e-10, atol=1e-12)
    assert float(metrics["clip_frac"][0] / metrics["clip_frac"][1]) == pytest.approx(float(clipfrac), rel=1e-6)
    assert float(metrics["policy_loss"][0]) == pytest.approx(float((per * mask).sum()), rel=1e-10)
    assert 0.1 < float(clipfrac) < 0.9
    _, _, ppo_grad = _ours("ppo", lp, old, adv, mask, eps_clip=low, eps_clip_high=high)
    assert (ppo_grad - grad).abs().max() > 1e-3


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo_is_verls(tau_pos, tau_neg):
    """SAPO's loss (seq_mean_token_mean, as verl always aggregates it) and gradient equal verl's at verl's default
    temperatures and at others; control: the temperatures swapped give another loss."""
    lp, old, adv, mask = _inputs(1)
    cfg = PolicyVariantConfig(tau_pos=tau_pos, tau_neg=tau_neg)
    loss, metrics, grad = _ours("sapo", lp, old, adv, mask, mode="seq_mean_token_mean", variant=cfg)
    per, want, want_grad, _ = _verl(verl_sapo, lp, old, adv, mask, tau_pos=tau_pos, tau_neg=tau_neg)
    # verl divides each sequence's token sum by (its count + 1e-8): 1e-8 relative on a one-token row
    torch.testing.assert_close(loss, want, rtol=2e-8, atol=1e-12)
    torch.testing.assert_close(grad * mask, want_grad * mask, rtol=2e-8, atol=1e-12)
    assert float(metrics["policy_loss"][0]) == pytest.approx(float((per * mask).sum()), rel=1e-10)
    swapped = verl_sapo(old, lp, adv, mask, tau_pos=tau_neg, tau_neg=tau_pos)[1]
    assert abs(float(swapped - want)) > 1e-4


def test_sapo_defaults_to_verls_aggregation():
    """``ActorLossConfig.from_parts`` gives SAPO seq_mean_token_mean without --loss_agg_mode, as verl forces it."""
    from types import SimpleNamespace

    from rlhf.algo.advantages import get_estimator
    from rlhf.algo.rollout_correction import RolloutCorrectionConfig

    algo = SimpleNamespace(eps_clip=0.2, eps_clip_low_high=None, dual_clip=None, policy_loss_type="sapo",
                           loss_agg_mode=None, entropy_coef=None, kl_estimator="k1", use_kl_loss=None)
    cfg = ActorLossConfig.from_parts(algo, RolloutCorrectionConfig(), get_estimator("grpo"))
    assert cfg.loss_agg_mode == "seq_mean_token_mean"
    assert ActorLossConfig.from_parts(SimpleNamespace(**{**vars(algo), "policy_loss_type": "cispo"}),
                                      RolloutCorrectionConfig(), get_estimator("grpo")).loss_agg_mode == "token_mean"


@pytest.mark.parametrize("ratio", [0.05, 1.0])
def test_clip_cov_is_verls(ratio):
    """Clip-Cov: the same tokens dropped (verl's randperm and ours from one seed; at ratio 1 every candidate), the
    same loss and gradient. Controls: the dropped tokens lie inside the covariance bounds and were not clipped by
    PPO, some candidates are left at ratio 0.05, and the loss is not plain PPO's (a dropped token changes it)."""
    lp, old, adv, mask = _inputs(2, spread=1.5)
    cfg = PolicyVariantConfig(clip_cov_ratio=ratio, clip_cov_lb=0.5, clip_cov_ub=4.0)
    loss, metrics, grad = _ours("clip_cov", lp, old, adv, mask, variant=cfg,
                                generator=torch.Generator().manual_seed(11))
    torch.manual_seed(11)
    per, want, want_grad, (corr,) = _verl(verl_clip_cov, lp, old, adv, mask, clip_cov_ratio=ratio, lb=0.5, ub=4.0)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad * mask, want_grad * mask, rtol=1e-10, atol=1e-12)
    dropped = int((corr == 0).sum())
    assert float(metrics["clip_frac"][0]) == dropped >= 1
    cand = _candidates(lp, old, adv, mask, 0.5, 4.0)
    assert bool(cand[corr == 0].all())
    if ratio < 1:
        assert dropped == max(int(ratio * mask.sum()), 1) < int(cand.sum())
    else:
        assert dropped == int(cand.sum())
    ppo, _, _ = _ours("ppo", lp, old, adv, mask)
    assert abs(float(ppo - loss)) > 1e-6


def _candidates(lp, old, adv, mask, lb, ub):
    m = mask.bool()
    r = (lp - old).exp()
    clipped = (-adv * r.clamp(0.8, 1.2)) > (-adv * r)
    cov = (adv - adv[m].mean()) * (lp - lp[m].mean())
    return m & ~clipped & (cov > lb) & (cov < ub)


@pytest.mark.parametrize("ratio,coef", [(0.1, 0.1), (0.3, 2.0)])
def test_kl_cov_is_verls(ratio, coef):
    """KL-Cov's loss and gradient equal verl's; control: the penalty on the smallest covariances instead (or none)
    gives another loss."""
    lp, old, adv, mask = _inputs(3)
    cfg = PolicyVariantConfig(kl_cov_ratio=ratio, ppo_kl_coef=coef)
    loss, metrics, grad = _ours("kl_cov", lp, old, adv, mask, variant=cfg)
    _, want, want_grad, _ = _verl(verl_kl_cov, lp, old, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad * mask, want_grad * mask, rtol=1e-10, atol=1e-12)
    assert int(metrics["clip_frac"][0]) == max(1, int(ratio * mask.sum()))
    none = verl_kl_cov(old, lp, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=0.0)[1]
    assert abs(float(none - want)) > 1e-4


@pytest.mark.parametrize("kind", ["cispo", "sapo", "clip_cov", "kl_cov"])
def test_padding_never_leaks(kind):
    """NaN and inf in the padding of every input change nothing (the loss, its gradient)."""
    lp, old, adv, mask = _inputs(4)
    pad = mask == 0
    bad = [x.masked_fill(pad, v) for x, v in ((lp, float("nan")), (old, float("inf")), (adv, float("nan")))]
    kw = {"generator": torch.Generator().manual_seed(0)} if kind == "clip_cov" else {}
    a = _ours(kind, lp, old, adv, mask, **kw)
    kw = {"generator": torch.Generator().manual_seed(0)} if kind == "clip_cov" else {}
    b = _ours(kind, *bad, mask, **kw)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[2], b[2])


def test_variants_bad_values():
    """Bad values name the flag: the part's own, and dual-clip with a variant (verl's variants have none)."""
    for kw, msg in (({"tau_neg": 0.0}, "--tau_neg"), ({"clip_cov_ratio": 0.0}, "--clip_cov_ratio"),
                    ({"kl_cov_ratio": 1.5}, "--kl_cov_ratio"), ({"clip_cov_lb": 5.0}, "--clip_cov_lb"),
                    ({"ppo_kl_coef": -1.0}, "--ppo_kl_coef")):
        with pytest.raises(ValueError, match=msg):
            PolicyVariantConfig(**kw).check()
    with pytest.raises(ValueError, match="--policy_loss_type cispo with --dual_clip"):
        ActorLossConfig(policy_loss_type="cispo", dual_clip=3.0)


def test_make_actor_loss_passes_the_variant_and_seeds_clip_cov():
    """Through ``make_actor_loss``: the variant's parameters reach the loss, and Clip-Cov's draws come from the seed
    (the same seed, the same loss; another seed, other draws)."""
    lp, old, adv, mask = _inputs(2, spread=1.5)
    batch = {"old_logprobs": old, "advantages": adv, "action_mask": mask}
    ent = torch.zeros_like(lp)
    cfg = ActorLossConfig(policy_loss_type="clip_cov",
                          variant=PolicyVariantConfig(clip_cov_ratio=0.05, clip_cov_lb=0.5, clip_cov_ub=4.0))
    run = [make_actor_loss(lambda b, o: (lp, ent), cfg, seed=s)(batch, None) for s in (5, 5, 6, 7, 8)]
    assert float(run[0][0]) == float(run[1][0])
    assert len({float(r[0]) for r in run[1:]}) > 1
    torch.manual_seed(5)
    want = verl_clip_cov(old, lp, adv, mask, clip_cov_ratio=0.05, lb=0.5, ub=4.0)[1]
    assert float(run[0][0] / run[0][1]) == pytest.approx(float(want), rel=1e-12)
    sapo = ActorLossConfig(policy_loss_type="sapo", loss_agg_mode="seq_mean_token_mean",
                           variant=PolicyVariantConfig(tau_pos=0.5, tau_neg=2.0))
    s, n, _ = make_actor_loss(lambda b, o: (lp, ent), sapo)(batch, None)
    assert float(s / n) == pytest.approx(float(verl_sapo(old, lp, adv, mask, 0.5, 2.0)[1]), rel=2e-8)
