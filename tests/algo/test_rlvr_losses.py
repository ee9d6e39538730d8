"""The RLVR options of the policy loss and the group estimators against OpenRLHF's own formulas, written out here in
fp64 from its source (openrlhf/models/loss.py ``PolicyLoss`` and ``aggregate_loss``;
openrlhf/trainer/ppo_utils/experience_maker.py ``compute_advantages_and_returns``, ``compute_reward``,
``get_cumulative_returns``), not from ours: clip-higher, dual-clip, GSPO, the three loss aggregations, the entropy
bonus, RLOO, REINFORCE++-baseline (with and without --no_std_norm) and group_norm. Values and gradients."""
import pytest
import torch

from rlhf.algo.advantages import get_estimator
from rlhf.algo.ppo_losses import ActorLossConfig, make_actor_loss, policy_loss

F64 = torch.float64


def _inputs(seed=0, b=6, t=7):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(b, t, generator=g, dtype=F64) * 0.3 - 1.0
    old = lp + torch.randn(b, t, generator=g, dtype=F64) * 0.25  # ratios spread over both clip bounds
    adv = torch.randn(b, t, generator=g, dtype=F64) * 2.0
    lens = torch.tensor([7, 5, 1, 3, 0, 6])[:b]  # one empty row (all padding), one single-token row
    mask = (torch.arange(t)[None] < lens[:, None]).to(F64)
    return lp, old, adv, mask


# ---- OpenRLHF's PolicyLoss.forward and aggregate_loss, written out (its clamp of the token log ratio included)
def openrlhf_policy_loss(lp, old, adv, mask, low, high, dual_clip=None, loss_type="ppo", token_level=True):
    raw = lp - old
    if loss_type == "ppo":
        ratio = raw.clamp(min=-20.0, max=20.0).exp()
    else:  # gspo
        ratio = ((raw * mask).sum(-1) / mask.sum(-1).clamp(min=1)).exp().unsqueeze(-1) * mask
    surr1 = ratio * adv
    surr2 = ratio.clamp(1 - low, 1 + high) * adv
    if dual_clip is None:
        loss = -torch.min(surr1, surr2)
    else:
        clip1 = torch.min(surr1, surr2)
        loss = -torch.where(adv < 0, torch.max(clip1, dual_clip * adv), clip1)
    if token_level:
        return (loss * mask).sum() / mask.sum()
    counts = mask.sum(-1)
    seq = (loss * mask).sum(-1) / (counts + 1e-8)
    seq_mask = (counts > 0).to(F64)
    return (seq * seq_mask).sum() / seq_mask.sum()


def openrlhf_gspo_with_is(lp, old, rollout, adv, mask, low, high):
    """OpenRLHF's ``PolicyLoss.forward`` (openrlhf/models/loss.py at 3c3be6234e0c) for ``policy_loss_type="gspo"``
    with ``enable_vllm_is_correction=True``, written out: the sequence ratio against ``rollout_log_probs``, no IS
    weight (its IS block is ``if self.enable_vllm_is_correction and self.policy_loss_type == "ppo"``), the loss
    aggregated per sample (``token_level_loss=False`` for GSPO: each sequence's token mean, then the mean)."""
    log_ratio = lp - rollout
    ratio = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    ratio = ratio.exp().unsqueeze(-1) * mask
    surr1 = ratio * adv
    surr2 = ratio.clamp(1 - low, 1 + high) * adv
    loss = -torch.min(surr1, surr2)
    counts = mask.sum(-1)
    seq = (loss * mask).sum(-1) / (counts + 1e-8)
    return seq.sum() / (counts > 0).sum()


def verl_seq_mean_token_sum(loss, mask):
    """verl's ``seq-mean-token-sum``: each sequence's token sum, averaged over the sequences that have tokens."""
    per = (loss * mask).sum(-1)
    keep = mask.sum(-1) > 0
    return per[keep].mean()


def _ours(lp, old, adv, mask, **kw):
    s, n, _ = policy_loss(lp, old, adv, mask, **kw)
    return s / n


@pytest.mark.parametrize("low,high,dual,loss_type,mode", [
    (0.2, 0.2, None, "ppo", "token_mean"),
    (0.2, 0.28, None, "ppo", "token_mean"),          # DAPO's clip-higher
    (0.2, 0.28, 3.0, "ppo", "token_mean"),           # dual-clip
    (0.2, 0.28, None, "ppo", "seq_mean_token_mean"),
    (3e-4, 4e-4, None, "gspo", "seq_mean_token_mean"),  # GSPO's paper clip range
    (0.2, 0.2, None, "gspo", "seq_mean_token_mean"),
])
def test_policy_loss_matches_openrlhf(low, high, dual, loss_type, mode):
    lp, old, adv, mask = _inputs()
    a = lp.clone().requires_grad_(True)
    b = lp.clone().requires_grad_(True)
    ref = openrlhf_policy_loss(a, old, adv, mask, low, high, dual, loss_type, token_level=mode == "token_mean")
    ours = _ours(b, old, adv, mask, eps_clip=low, eps_clip_high=high, dual_clip=dual, policy_loss_type=loss_type,
                 loss_agg_mode=mode)
    ref.backward(), ours.backward()
    # OpenRLHF divides each sequence's sum by (tokens + 1e-8), ours by its tokens: a relative 1e-8 / tokens, at most
    # 1e-8 here (a one-token row); the token mean has no such term
    rel = 1e-12 if mode == "token_mean" else 1.5e-8
    assert ours.item() == pytest.approx(ref.item(), rel=rel, abs=1e-12)
    assert torch.allclose(b.grad, a.grad, rtol=rel, atol=1e-14), (b.grad - a.grad).abs().max()
    # the options change something on these inputs (each case can fail against the plain loss)
    plain = openrlhf_policy_loss(lp, old, adv, mask, 0.2, 0.2)
    if (low, high, dual, loss_type, mode) != (0.2, 0.2, None, "ppo", "token_mean"):
        assert abs(ref.item() - plain.item()) > 1e-4


def test_seq_mean_token_sum_matches_verl():
    lp, old, adv, mask = _inputs(seed=1)
    a = lp.clone().requires_grad_(True)
    b = lp.clone().requires_grad_(True)
    ratio = (a - old).exp()
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    ref = verl_seq_mean_token_sum(per_token, mask)
    ours = _ours(b, old, adv, mask, loss_agg_mode="seq_mean_token_sum")
    ref.backward(), ours.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(b.grad, a.grad, rtol=1e-10, atol=1e-12)


def test_dual_clip_bounds_negative_advantages_only():
    """ratio 4, A = -1: PPO's loss is 4 (unbounded in the ratio), dual-clip C=3 caps it at 3; A > 0 untouched."""
    lp = torch.tensor([[0.0, 0.0]], dtype=F64)
    old = torch.log(torch.tensor([[0.25, 0.25]], dtype=F64))
    adv = torch.tensor([[-1.0, 1.0]], dtype=F64)
    m = torch.ones(1, 2, dtype=F64)
    s, n, _ = policy_loss(lp, old, adv, m, eps_clip=0.2, dual_clip=3.0)
    assert (s / n).item() == pytest.approx((3.0 - 1.2) / 2)  # -min(4*1, 1.2*1) = -1.2 for A = +1
    s, n, _ = policy_loss(lp, old, adv, m, eps_clip=0.2)
    assert (s / n).item() == pytest.approx((4.0 - 1.2) / 2)


def test_entropy_bonus_and_kl_are_aggregated_as_the_policy_loss():
    """OpenRLHF: loss = policy + kl_coef * agg(kl) - entropy_coef * agg(entropy), each agg the policy's own."""
    lp, old, adv, mask = _inputs(seed=2)
    ent = torch.rand(lp.shape, generator=torch.Generator().manual_seed(3), dtype=F64) * 3
    ref_lp = lp - 0.1
    for mode in ("token_mean", "seq_mean_token_mean"):
        cfg = ActorLossConfig(loss_agg_mode=mode, entropy_coef=0.01, kl_in_loss=True, kl_estimator="k3")
        e = ent.clone().requires_grad_(True)
        a = lp.clone().requires_grad_(True)
        batch = {"old_logprobs": old, "advantages": adv, "action_mask": mask, "ref_logprobs": ref_lp}
        s, n, _ = make_actor_loss(lambda bt, out: (a, e), cfg, kl_coef=0.05)(batch, None)
        (s / n).backward()
        lr = (lp - ref_lp).clamp(-20, 20)  # k3 of OpenRLHF's compute_approx_kl: exp(-lr) - 1 + lr, clamped +-10
        k3 = ((-lr).exp() - 1 + lr).clamp(-10, 10)
        tok = mode == "token_mean"

        def agg(x):
            if tok:
                return (x * mask).sum() / mask.sum()
            c = mask.sum(-1)
            keep = c > 0
            return ((x * mask).sum(-1)[keep] / c[keep]).mean()

        ref = openrlhf_policy_loss(lp, old, adv, mask, 0.2, 0.2, token_level=tok) + 0.05 * agg(k3) - 0.01 * agg(ent)
        assert (s / n).item() == pytest.approx(ref.item(), rel=1e-12 if tok else 1.5e-8), mode  # 1e-8: see above
        want = -0.01 * (mask / mask.sum() if tok else mask / mask.sum(-1, keepdim=True).clamp(min=1) / 5)
        assert torch.allclose(e.grad, want, atol=1e-15), mode  # 5 rows with tokens


# ---- OpenRLHF's compute_advantages_and_returns for the group estimators, written out
def openrlhf_group_advantages(estimator, rewards, kl, mask, n, kl_coef, no_std_norm=False):
    r = rewards.reshape(-1, n)
    if estimator == "rloo":
        r = r - (r.sum(-1, keepdim=True) - r) / (n - 1)
    elif estimator == "reinforce_baseline":
        r = r - r.mean(-1, keepdim=True)
    elif estimator == "group_norm":
        r = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)
    r = r.reshape(-1)
    eos = mask.size(1) - 1 - mask.long().fliplr().argmax(dim=1, keepdim=True)  # compute_reward
    token_r = torch.zeros_like(kl).scatter_(1, eos, r.unsqueeze(1)) - kl_coef * kl
    returns = torch.zeros_like(token_r)  # get_cumulative_returns, gamma 1
    run = torch.zeros(token_r.size(0), dtype=F64)
    masked = mask * token_r
    for t in reversed(range(token_r.size(1))):
        run = masked[:, t] + run
        returns[:, t] = run
    adv = returns.clone()
    if estimator == "reinforce_baseline":
        flat, m = adv.flatten(), mask.flatten()
        mean = (flat * m).sum() / m.sum()
        rstd = 1 if no_std_norm else (((flat - mean).pow(2) * m).sum() / m.sum()).clamp(min=1e-8).rsqrt()
        adv = (adv - mean) * rstd
    return adv * mask, returns * mask


@pytest.mark.parametrize("estimator,kl_coef,no_std_norm", [
    ("rloo", 0.0, False), ("rloo", 0.1, False), ("reinforce_baseline", 0.1, False),
    ("reinforce_baseline", 0.1, True), ("group_norm", 0.0, False)])
def test_group_estimators_match_openrlhf(estimator, kl_coef, no_std_norm):
    g = torch.Generator().manual_seed(7)
    n, prompts, t = 4, 3, 6
    rewards = torch.randint(0, 2, (n * prompts,), generator=g).to(F64) + 0.1 * torch.randn(n * prompts, generator=g,
                                                                                            dtype=F64)
    lens = torch.randint(1, t + 1, (n * prompts,), generator=g)
    mask = (torch.arange(t)[None] < lens[:, None]).to(F64)
    kl = torch.randn(n * prompts, t, generator=g, dtype=F64) * 0.05 * mask
    est = get_estimator(estimator)
    out = est(rewards=rewards, kl=kl, action_mask=mask, kl_coef=0.0 if est.kl_in_loss else kl_coef,
              n_samples_per_prompt=n, std_norm=not no_std_norm)
    ref_adv, ref_ret = openrlhf_group_advantages(estimator, rewards, kl, mask, n,
                                                 0.0 if est.kl_in_loss else kl_coef, no_std_norm)
    assert torch.allclose(out["advantages"] * mask, ref_adv, rtol=1e-12, atol=1e-12), \
        (out["advantages"] * mask - ref_adv).abs().max()
    if estimator != "group_norm":  # ours keeps GRPO's returns == advantages; OpenRLHF's are the same numbers
        assert torch.allclose(out["returns"] * mask, ref_ret, rtol=1e-12, atol=1e-12)


def test_rloo_baseline_leaves_one_out():
    """A hand case: rewards (1, 0, 0, 1) -> each minus the mean of the other three: 1 - 1/3, 0 - 2/3, ..."""
    est = get_estimator("rloo")
    out = est(rewards=torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64), action_mask=torch.ones(4, 1, dtype=F64),
              n_samples_per_prompt=4)
    assert out["advantages"].flatten().tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


@pytest.mark.parametrize("kw,needle", [
    ({"eps_clip_low": 1.0}, "--eps_clip_low_high 1.0"),
    ({"dual_clip": 0.5}, "--dual_clip must be > 1"),
    ({"policy_loss_type": "ppo_v2"}, "--policy_loss_type 'ppo_v2'"),
    ({"loss_agg_mode": "token_sum"}, "--loss_agg_mode 'token_sum'"),
    ({"entropy_coef": -0.1}, "--entropy_coef must be >= 0"),
])
def test_actor_loss_config_names_the_flag(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        ActorLossConfig(**kw)


def trl_grpo_loss(lp, rewards, mask, n):
    """TRL 1.12.0's GRPOTrainer step as the RLVR comparison runs it (trl/trainer/grpo_trainer.py: ``scale_rewards``
    'group', ``loss_type`` 'dapo', ``beta`` 0, one update per generation batch so old = current detached), written out:
    advantages ``(r - group mean) / (unbiased group std + 1e-4)``, per-token ``-min(ratio * A, clip(ratio) * A)``,
    summed and divided by the batch's completion-token count."""
    grouped = rewards.view(-1, n)
    std = grouped.std(dim=1).repeat_interleave(n)
    adv = ((rewards - grouped.mean(dim=1).repeat_interleave(n)) / (std + 1e-4)).unsqueeze(1)
    ratio = (lp - lp.detach()).exp()
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    return (per_token * mask).sum() / mask.sum()


def test_grpo_step_is_trls():
    """Why TRL seemed to learn faster (issue 34): not the loss. Our group_norm advantages with the default
    token_mean aggregation and one on-policy update give TRL's GRPO gradient; they differ only by the std epsilon
    (ours 1e-9, TRL's 1e-4), so the relative gradient gap is at most about 1e-4 / (smallest group std), derived
    here. What differed in that run was the schedule: our default cosine_with_min_lr (warmup, decay to 0.1x)
    against TRL's constant rate, and the KL term of --init_kl_coef 0.01 (TRL's beta is 0); the RLVR example and
    bench/rlvr_vs_trl.py set both as TRL does. Negative control: TRL's 'grpo' loss type (per-sequence means,
    our seq_mean_token_mean) is told apart."""
    g = torch.Generator().manual_seed(3)
    n, prompts, t = 8, 4, 12
    rewards = torch.randint(0, 2, (n * prompts,), generator=g).to(F64)
    rewards[:n] = torch.tensor([1.0] + [0.0] * (n - 1), dtype=F64)  # a rare success: the largest advantage
    lens = torch.randint(1, t + 1, (n * prompts,), generator=g)
    mask = (torch.arange(t)[None] < lens[:, None]).to(F64)
    lp0 = torch.randn(n * prompts, t, generator=g, dtype=F64) * 0.5 - 1.0

    def grad(fn):
        lp = lp0.clone().requires_grad_(True)
        fn(lp).backward()
        return lp.grad

    est = get_estimator("group_norm")

    def ours(lp, mode="token_mean"):
        adv = est(rewards=rewards, kl=None, action_mask=mask, n_samples_per_prompt=n)["advantages"]
        s, c, _ = policy_loss(lp, lp.detach(), adv, mask, loss_agg_mode=mode)
        return s / c

    theirs = grad(lambda lp: trl_grpo_loss(lp, rewards, mask, n))
    std = rewards.view(-1, n).std(dim=1)
    bound = 1e-4 / std[std > 0].min().item() * 1.01 + 1e-12
    rel = ((grad(ours) - theirs).abs().max() / theirs.abs().max()).item()
    assert rel <= bound, (rel, bound)
    seq = grad(lambda lp: ours(lp, "seq_mean_token_mean"))
    assert ((seq - theirs).abs().max() / theirs.abs().max()).item() > 100 * bound


@pytest.mark.parametrize("kind", ["tis", "icepop"])
def test_gspo_with_is_correction_is_openrlhfs(kind):
    """--policy_loss_type gspo --use_tis (OpenRLHF's --actor.policy_loss_type gspo
    --algo.advantage.is_correction_enable): the actor loss and its gradient equal OpenRLHF's formula written out
    above, whatever --is_correction_type says (OpenRLHF ignores it for GSPO). Control: the ratio against the
    trainer's old log-probs with the per-token weights (what this project computed before) is another loss."""
    lp, old, adv, mask = _inputs(seed=4)
    g = torch.Generator().manual_seed(5)
    rollout = old + 0.3 * torch.randn(old.shape, generator=g, dtype=F64)  # a generator some versions behind
    from rlhf.algo.rollout_correction import RolloutCorrectionConfig

    corr = RolloutCorrectionConfig(use_tis=True, is_correction_type=kind, tis_floor=0.5, tis_cap=5.0)
    cfg = ActorLossConfig(policy_loss_type="gspo", loss_agg_mode="seq_mean_token_mean", correction=corr,
                          eps_clip_low=0.2, eps_clip_high=0.28)
    batch = {"old_logprobs": old, "vllm_logprobs": rollout, "advantages": adv, "action_mask": mask.bool()}
    a = lp.clone().requires_grad_(True)
    b = lp.clone().requires_grad_(True)
    s, n, _ = make_actor_loss(lambda bt, out: (out, torch.zeros_like(out)), cfg)(batch, b)
    ours = s / n
    ref = openrlhf_gspo_with_is(a, old, rollout, adv, mask, 0.2, 0.28)
    ours.backward(), ref.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1.5e-8)  # OpenRLHF's + 1e-8 per row (see above)
    assert torch.allclose(b.grad, a.grad, rtol=1.5e-8, atol=1e-14), (b.grad - a.grad).abs().max()
    before = ActorLossConfig(policy_loss_type="gspo", loss_agg_mode="seq_mean_token_mean", eps_clip_low=0.2,
                             eps_clip_high=0.28)  # control: against old, weights applied as a plain multiply
    from rlhf.algo.rollout_correction import rollout_correction

    w = rollout_correction(old, rollout, mask.bool(), corr).weights
    s2, n2, _ = policy_loss(lp, old, adv, mask.bool(), eps_clip=0.2, eps_clip_high=0.28, rollout_is_weights=w,
                            policy_loss_type="gspo", loss_agg_mode="seq_mean_token_mean")
    assert abs((s2 / n2).item() - ref.item()) > 1e-3, ((s2 / n2).item(), ref.item())
    assert before.gspo_against_rollout is False and cfg.gspo_against_rollout is True
