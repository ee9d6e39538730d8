"""OpenRLHF's --algo.kl.use_loss and --reward.clip_range change a run here as they do in OpenRLHF: the flags go
through the PPO parser (rlhf/config/openrlhf.py), then this repo's advantage stage (rlhf.ppo.stages.compute_advantages)
and actor loss (rlhf.algo.ppo_losses.make_actor_loss), against OpenRLHF's formulas written out below in fp64 from its
source at 3c3be6234e0c, not from ours:

* openrlhf/models/utils.py: ``compute_approx_kl`` (k1/k2/k3, clamped to [-10, 10]) and ``compute_reward`` (the
  reward clamped to ``reward_clip_range``, ``-kl_coef * kl`` per token, the reward on the last token);
* openrlhf/trainer/ppo_utils/experience_maker.py: ``make_experience`` (the KL is zeros when ``algo.kl.use_loss``)
  and ``compute_advantages_and_returns`` (group baselines, then ``compute_reward``, then GAE or the cumulative
  return, then the batch normalisation of gae / reinforce / reinforce_baseline);
* openrlhf/trainer/ray/ppo_actor.py ``training_step``: ``loss = actor_loss + kl_loss * kl_ctl`` with ``kl_loss``
  the token-mean of ``compute_approx_kl(logprobs, ref)`` when ``algo.kl.use_loss``.

Negative controls: the reward clipped before the group baseline, and the KL left where the estimator puts it, are
told apart from OpenRLHF's by the figures asserted."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

F64 = torch.float64
N, PROMPTS, T = 4, 3, 6
KL_COEF = 0.05


# ---- OpenRLHF, written out
def openrlhf_approx_kl(lp, base, estimator):
    log_ratio = lp - base
    if estimator == "k2":
        log_ratio = log_ratio ** 2 / 2.0
    elif estimator == "k3":
        log_ratio = (-log_ratio).exp() - 1 + log_ratio
    return log_ratio.clamp(min=-10, max=10)


def openrlhf_compute_reward(r, kl_coef, kl, mask, clip):
    if clip:
        r = r.clamp(min=clip[0], max=clip[1])
    eos = mask.size(1) - 1 - mask.long().fliplr().argmax(dim=1, keepdim=True)
    return torch.zeros_like(kl).scatter_(1, eos, r.unsqueeze(1).to(kl.dtype)) - kl_coef * kl


def openrlhf_advantages(estimator, rewards, lp, ref, values, mask, *, use_loss, clip, kl_estimator, gamma=1.0,
                        lambd=0.95):
    """make_experience's KL, then compute_advantages_and_returns -> (advantages, returns), each (B, T)."""
    kl = torch.zeros_like(lp) if use_loss else openrlhf_approx_kl(lp, ref, kl_estimator)
    r = rewards.reshape(-1, N)
    if estimator == "rloo":
        r = r - (r.sum(-1, keepdim=True) - r) / (N - 1)
    elif estimator in ("reinforce_baseline", "dr_grpo"):
        r = r - r.mean(-1, keepdim=True)
    elif estimator == "group_norm":
        r = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)
    reward = openrlhf_compute_reward(r.reshape(-1), KL_COEF, kl, mask, clip)
    if estimator == "gae":  # get_advantages_and_returns
        v, rw = mask * values, mask * reward
        last, out = 0, []
        for t in reversed(range(T)):
            nv = v[:, t + 1] if t < T - 1 else 0.0
            last = rw[:, t] + gamma * nv - v[:, t] + gamma * lambd * last
            out.append(last)
        adv = torch.stack(out[::-1], dim=1)
        returns = adv + v
    else:  # get_cumulative_returns, gamma forced to 1 for the group estimators
        returns, run = torch.zeros_like(reward), torch.zeros(reward.size(0), dtype=F64)
        for t in reversed(range(T)):
            run = (mask * reward)[:, t] + gamma * run
            returns[:, t] = run
        adv = returns.clone()
    if estimator in ("gae", "reinforce", "reinforce_baseline"):
        m = mask.flatten()
        mean = (adv.flatten() * m).sum() / m.sum()
        adv = (adv - mean) * (((adv.flatten() - mean) ** 2 * m).sum() / m.sum()).clamp(min=1e-8).rsqrt()
    return adv, returns


def openrlhf_actor_loss(lp, old, adv, ref, mask, *, use_loss, kl_estimator, eps=0.2):
    """PolicyLoss (token-level) + kl_loss * kl_ctl when use_loss (ppo_actor.training_step)."""
    ratio = (lp - old).clamp(-20, 20).exp()
    loss = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    total = (loss * mask).sum() / mask.sum()
    if use_loss:
        total = total + KL_COEF * (openrlhf_approx_kl(lp, ref, kl_estimator) * mask).sum() / mask.sum()
    return total


# ---- ours: the PPO parser (OpenRLHF's flags translated), the advantage stage, the actor loss
def ppo_args(extra: list[str]) -> argparse.Namespace:
    from rlhf.config.migration import add_launcher_args
    from rlhf.config.openrlhf import translate
    from rlhf.ppo.args import add_args

    p = argparse.ArgumentParser()
    add_args(p)
    add_launcher_args(p)
    args = p.parse_args(translate(["--pretrain", "m", "--prompt_data", "p.jsonl", "--save_path", "o", "--n_samples_per_prompt", str(N),
                                   "--init_kl_coef", str(KL_COEF), "--lambd", "0.95", *extra], "ppo",
                                  set(p._option_string_actions)))
    args.old_logprobs_source = "forward"
    return args


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    b = N * PROMPTS
    rewards = torch.randn(b, generator=g, dtype=F64) * 2.0  # beyond the clip range on both sides
    lens = torch.randint(1, T + 1, (b,), generator=g)
    mask = (torch.arange(T)[None] < lens[:, None]).to(F64)
    old = torch.randn(b, T, generator=g, dtype=F64) * 0.5 - 1.5
    ref = old + torch.randn(b, T, generator=g, dtype=F64) * 0.4
    values = torch.randn(b, T, generator=g, dtype=F64) * 0.3
    return rewards, mask, old, ref, values


def ours_advantages(args, rewards, mask, old, ref, values):
    from rlhf.algo.advantages import get_estimator
    from rlhf.ppo.stages import compute_advantages

    est = get_estimator(args.advantage_estimator)
    exp = SimpleNamespace(batch={"action_mask": mask.bool()}, old_logprobs=old, ref_logprobs=ref, rewards=rewards,
                          values=values if est.needs_critic else None, vllm_logprobs=old, teacher_logprobs=None)
    job = SimpleNamespace(algo=args, batch=args)  # the job's parts compute_advantages reads, as the parsed flags
    compute_advantages(exp, rewards, est, KL_COEF, job, SimpleNamespace(dp=1, dp_rank=0))
    return exp, est


def ours_actor_loss(args, est, lp, old, adv, ref, mask):
    from rlhf.algo.ppo_losses import ActorLossConfig, make_actor_loss

    loss_fn = make_actor_loss(lambda batch, out: (out, torch.zeros_like(out)), ActorLossConfig.from_args(args, est),
                              kl_coef=KL_COEF)
    s, n, _ = loss_fn({"old_logprobs": old, "advantages": adv, "action_mask": mask.bool(), "ref_logprobs": ref}, lp)
    return s / n


CASES = [(e, u) for e in ("gae", "reinforce_baseline", "rloo", "group_norm", "dr_grpo") for u in (True, False)]


@pytest.mark.parametrize("estimator,use_loss", CASES)
def test_kl_place_and_reward_clip_match_openrlhf(estimator, use_loss):
    """--algo.kl.use_loss (or --no-use_kl_loss, OpenRLHF's run without it) with --reward.clip_range -1 1.2 and
    --algo.kl.estimator k3: the KL in the loss for any estimator (k3 there), in the reward otherwise, the rewards
    clipped after the baseline: returns and advantages (GAE's before our whitening, whose variance is Bessel-
    corrected where OpenRLHF's is not) and the actor's loss and gradient equal OpenRLHF's."""
    flags = ["--algo.kl.use_loss"] if use_loss else ["--no-use_kl_loss"]
    args = ppo_args(["--algo.advantage.estimator", estimator, "--reward.clip_range", "-1", "1.2",
                     "--algo.kl.estimator", "k3", *flags])
    assert args.use_kl_loss is use_loss and list(args.reward_clip_range) == [-1.0, 1.2]
    rewards, mask, old, ref, values = inputs()
    exp, est = ours_advantages(args, rewards, mask, old, ref, values)
    want_adv, want_ret = openrlhf_advantages(estimator, rewards, old, ref, values, mask, use_loss=use_loss,
                                             clip=(-1.0, 1.2), kl_estimator="k3")
    assert torch.allclose(exp.returns * mask, want_ret * mask, rtol=1e-12, atol=1e-12), \
        (exp.returns * mask - want_ret * mask).abs().max()
    if estimator != "gae":
        assert torch.allclose(exp.advantages * mask, want_adv * mask, rtol=1e-12, atol=1e-12)
    g = torch.Generator().manual_seed(1)
    lp0 = old + torch.randn(old.shape, generator=g, dtype=F64) * 0.3
    grads = []
    for fn in (lambda lp: ours_actor_loss(args, est, lp, old, want_adv, ref, mask),
               lambda lp: openrlhf_actor_loss(lp, old, want_adv, ref, mask, use_loss=use_loss, kl_estimator="k3")):
        lp = lp0.clone().requires_grad_(True)
        loss = fn(lp)
        loss.backward()
        grads.append((loss.item(), lp.grad * mask))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-12, abs=1e-14)
    assert torch.allclose(grads[0][1], grads[1][1], rtol=1e-10, atol=1e-14)


def test_negative_controls():
    """What the tests above would miss: (1) the rewards clipped before RLOO's leave-one-out baseline instead of after
    it (compute_reward clips the shaped reward) move the returns by more than 0.3; (2) without the flag, gae keeps
    the KL in the reward: its loss lacks OpenRLHF's KL loss term, which is more than 1e-3 here; (3) group_norm
    without --no-use_kl_loss keeps its KL in the loss here, and its returns differ from OpenRLHF's default run (the
    KL in the reward) by more than 1e-3: why the flag exists in both directions."""
    rewards, mask, old, ref, values = inputs()
    args = ppo_args(["--advantage_estimator", "rloo", "--reward_clip_range", "-1", "1.2", "--no-use_kl_loss"])
    exp, _ = ours_advantages(args, rewards, mask, old, ref, values)
    pre = openrlhf_advantages("rloo", rewards.clamp(-1, 1.2), old, ref, values, mask, use_loss=False, clip=None,
                              kl_estimator="k1")[1]
    assert (exp.returns * mask - pre * mask).abs().max() > 0.3

    args = ppo_args(["--algo.advantage.estimator", "gae", "--algo.kl.estimator", "k3"])
    assert args.use_kl_loss is None
    from rlhf.algo.advantages import get_estimator

    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    ours = ours_actor_loss(args, get_estimator("gae"), old + 0.1, old, adv, ref, mask)
    theirs = openrlhf_actor_loss(old + 0.1, old, adv, ref, mask, use_loss=True, kl_estimator="k3")
    assert abs(ours.item() - theirs.item()) > 1e-3

    args = ppo_args(["--algo.advantage.estimator", "group_norm"])
    exp, _ = ours_advantages(args, rewards, mask, old, ref, values)
    theirs = openrlhf_advantages("group_norm", rewards, old, ref, values, mask, use_loss=False, clip=None,
                                 kl_estimator="k1")[1]
    assert (exp.returns * mask - theirs * mask).abs().max() > 1e-3


def test_bad_values_name_the_flag(tmp_path):
    from rlhf.ppo.algo_args import check_algo
    from rlhf.ppo.args import PPOJobConfig

    (tmp_path / "p.jsonl").write_text('{"prompt": "1 + 1 ="}\n')
    args = ppo_args(["--reward.clip_range", "2", "-2", "--reward_fn", "rlhf.rewards.verifiers:math_reward"])
    args.prompt_data = str(tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match=r"--reward_clip_range 2 -2: LOW must be below HIGH"):
        check_algo(PPOJobConfig.from_args(args))  # the part's own check as the job is built, then the job's


def test_tis_threshold_is_openrlhfs_clamp():
    """--algo.advantage.is_correction_threshold LOW HIGH (with --algo.advantage.is_correction_enable) is OpenRLHF's
    tis weight ``exp(old - rollout).clamp(LOW, HIGH)`` on each token's PPO loss (openrlhf/models/loss.py
    ``PolicyLoss.forward``): --tis_floor LOW --tis_cap HIGH here; loss and gradient equal OpenRLHF's. Negative
    control: the upper bound alone (what the flag did before: --tis_cap 2, no floor) is told apart."""
    from rlhf.algo.advantages import get_estimator

    args = ppo_args(["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_threshold", "0.8", "1.1"])
    assert (args.use_tis, args.tis_floor, args.tis_cap) == (True, 0.8, 1.1)
    _, mask, old, ref, _ = inputs()
    g = torch.Generator().manual_seed(4)
    rollout = old + torch.randn(old.shape, generator=g, dtype=F64) * 0.3  # weights on both sides of the range
    adv = torch.randn(old.shape, generator=g, dtype=F64)
    lp0 = old + torch.randn(old.shape, generator=g, dtype=F64) * 0.2

    def openrlhf(lp, low, high):
        ratio = (lp - old).clamp(-20, 20).exp()
        loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        loss = (old - rollout).exp().clamp(min=low, max=high) * loss
        return (loss * mask).sum() / mask.sum()

    def ours(lp, a):
        from rlhf.algo.ppo_losses import ActorLossConfig, make_actor_loss

        cfg = ActorLossConfig.from_args(a, get_estimator("grpo"))
        fn = make_actor_loss(lambda batch, out: (out, torch.zeros_like(out)), cfg, kl_coef=0.0)
        s, n, _ = fn({"old_logprobs": old, "advantages": adv, "action_mask": mask.bool(), "vllm_logprobs": rollout},
                     lp)
        return s / n

    res = []
    for fn in (lambda lp: ours(lp, args), lambda lp: openrlhf(lp, 0.8, 1.1)):
        lp = lp0.clone().requires_grad_(True)
        loss = fn(lp)
        loss.backward()
        res.append((loss.item(), lp.grad * mask))
    assert res[0][0] == pytest.approx(res[1][0], rel=1e-12)
    assert torch.allclose(res[0][1], res[1][1], rtol=1e-10, atol=1e-14)
    cap_only = ours(lp0, ppo_args(["--algo.advantage.is_correction_enable"])).item()
    assert abs(cap_only - res[1][0]) > 1e-3, (cap_only, res[1][0])


@pytest.mark.parametrize("estimator", ["group_norm", "rloo"])
def test_an_openrlhf_command_line_gets_openrlhfs_defaults(estimator):
    """Without --algo.kl.use_loss and --reward.clip_range, OpenRLHF puts the KL in the reward for every estimator
    and clips rewards to [-10, 10] (openrlhf/cli/train_ppo_ray.py's defaults). An OpenRLHF command line (one naming
    --actor.model_name_or_path) gets both here, so its returns equal OpenRLHF's. Negative control: our own command
    line keeps our defaults (group_norm's KL in the loss, no clip) and is told apart (> 1e-3)."""
    args = ppo_args(["--actor.model_name_or_path", "m", "--algo.advantage.estimator", estimator])
    assert args.use_kl_loss is False and list(args.reward_clip_range) == [-10.0, 10.0]
    rewards, mask, old, ref, values = inputs()
    rewards = rewards * 8  # RLOO's shaped rewards pass +-10
    exp, _ = ours_advantages(args, rewards, mask, old, ref, values)
    want = openrlhf_advantages(estimator, rewards, old, ref, values, mask, use_loss=False, clip=(-10.0, 10.0),
                               kl_estimator="k1")[1]
    assert torch.allclose(exp.returns * mask, want * mask, rtol=1e-12, atol=1e-12)
    own, _ = ours_advantages(ppo_args(["--advantage_estimator", estimator]), rewards, mask, old, ref, values)
    assert (own.returns * mask - want * mask).abs().max() > 1e-3
