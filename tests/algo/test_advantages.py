"""Advantage estimators against plain Python loops over rows and tokens."""
import math
import statistics

import pytest
import torch

from rlhf.algo.advantages import (ADVANTAGE_ESTIMATORS, compute_token_rewards, gae, get_estimator, grpo,
                                  reinforce_plus_plus, whiten_advantages)

F64 = torch.float64


def _batch(seed, b=6, t=9, empty_row=False):
    """Random (B, T) float64 tensors and a ragged right-padded mask; padding holds junk on purpose."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t  # one full row
    if empty_row:
        lengths[-1] = 0
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    junk = 1e3 * (1 - mask)
    token_rewards = torch.randn(b, t, generator=g, dtype=F64) + junk
    values = torch.randn(b, t, generator=g, dtype=F64) + junk
    rewards = torch.randn(b, generator=g, dtype=F64)
    kl = torch.rand(b, t, generator=g, dtype=F64) * 0.1 + junk
    return token_rewards, values, rewards, kl, mask, lengths.tolist()


def _ref_gae(r, v, lengths, gamma, lambd):
    b, t = len(r), len(r[0])
    adv = [[0.0] * t for _ in range(b)]
    ret = [[0.0] * t for _ in range(b)]
    for i in range(b):
        n = lengths[i]
        running = 0.0
        for j in reversed(range(n)):
            next_v = v[i][j + 1] if j + 1 < n else 0.0
            delta = r[i][j] + gamma * next_v - v[i][j]
            running = delta + gamma * lambd * running
            adv[i][j] = running
            ret[i][j] = running + v[i][j]
    return adv, ret


def _ref_return_to_go(r, lengths, gamma):
    out = [[0.0] * len(r[0]) for _ in r]
    for i, n in enumerate(lengths):
        running = 0.0
        for j in reversed(range(n)):
            running = r[i][j] + gamma * running
            out[i][j] = running
    return out


def _close(actual, expected, tol=1e-6):
    assert torch.allclose(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0), \
        (actual - torch.tensor(expected, dtype=actual.dtype)).abs().max()


@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_python_loop(gamma, lambd, seed):
    r, v, _, _, mask, lengths = _batch(seed, empty_row=seed == 1)
    adv, ret = gae(r, v, mask, gamma, lambd)
    ref_adv, ref_ret = _ref_gae(r.tolist(), v.tolist(), lengths, gamma, lambd)
    _close(adv, ref_adv)
    _close(ret, ref_ret)
    # fp32 inputs give fp32 outputs within fp32 accuracy.
    adv32, _ = gae(r.float(), v.float(), mask, gamma, lambd)
    assert adv32.dtype == torch.float32
    _close(adv32, ref_adv, tol=1e-4)


def test_compute_token_rewards_matches_python_loop():
    _, _, rewards, kl, mask, lengths = _batch(2, empty_row=True)
    out = compute_token_rewards(rewards, kl, mask, kl_coef=0.05)
    kl_l, r_l = kl.tolist(), rewards.tolist()
    expected = [[0.0] * mask.shape[1] for _ in lengths]
    for i, n in enumerate(lengths):
        for j in range(n):
            expected[i][j] = -0.05 * kl_l[i][j] + (r_l[i] if j == n - 1 else 0.0)
    _close(out, expected, tol=1e-12)
    no_kl = compute_token_rewards(rewards, None, mask, kl_coef=0.05)
    assert torch.allclose(no_kl.sum(dim=1), rewards * (torch.tensor(lengths) > 0))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_python_loop(gamma):
    r, _, _, _, mask, lengths = _batch(3)
    adv, ret = reinforce_plus_plus(r, mask, gamma)
    ref_ret = _ref_return_to_go(r.tolist(), lengths, gamma)
    _close(ret, ref_ret, tol=1e-12)
    flat = [ref_ret[i][j] for i, n in enumerate(lengths) for j in range(n)]
    mean, var = statistics.mean(flat), statistics.variance(flat)  # unbiased, over the whole batch
    expected = [[(ref_ret[i][j] - mean) / math.sqrt(var + 1e-8) if j < n else 0.0 for j in range(mask.shape[1])]
                for i, n in enumerate(lengths)]
    _close(adv, expected, tol=1e-9)


@pytest.mark.parametrize("n_samples", [2, 4])
def test_grpo_matches_python_loop(n_samples):
    _, _, _, _, mask, lengths = _batch(4, b=8)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, -1.0, 0.25, 0.75], dtype=F64)
    adv, ret = grpo(rewards, mask, n_samples)
    r = rewards.tolist()
    expected, expected_mean_only = [], []
    for i, n in enumerate(lengths):
        group = r[(i // n_samples) * n_samples:(i // n_samples + 1) * n_samples]
        a = (r[i] - statistics.mean(group)) / (statistics.stdev(group) + 1e-6)
        b = r[i] - statistics.mean(group)
        expected.append([a if j < n else 0.0 for j in range(mask.shape[1])])
        expected_mean_only.append([b if j < n else 0.0 for j in range(mask.shape[1])])
    _close(adv, expected, tol=1e-9)
    _close(ret, expected, tol=1e-9)
    adv, _ = grpo(rewards, mask, n_samples, std_normalize=False)
    _close(adv, expected_mean_only, tol=1e-12)


def test_grpo_rejects_bad_group_size():
    mask = torch.ones(6, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="--n_samples_per_prompt"):
        grpo(torch.zeros(6), mask, 4)
    with pytest.raises(ValueError, match="--n_samples_per_prompt"):
        grpo(torch.zeros(6), mask, 1)


def test_registry_uniform_calling_convention():
    _, values, rewards, kl, mask, _ = _batch(5, b=8)
    kwargs = dict(rewards=rewards, kl=kl, values=values, action_mask=mask, kl_coef=0.1, gamma=0.99, lambd=0.95,
                  n_samples_per_prompt=4)
    assert {"gae", "reinforce_plus_plus", "grpo", "dr_grpo"} <= set(ADVANTAGE_ESTIMATORS)
    for name in ADVANTAGE_ESTIMATORS:
        est = get_estimator(name)
        assert est.needs_critic == (name == "gae")
        out = est(**kwargs)
        assert set(out) == {"advantages", "returns", "token_rewards"}
        for x in out.values():
            assert x.shape == mask.shape and (x[mask == 0] == 0).all()

    out = get_estimator("gae")(**kwargs)
    token_rewards = compute_token_rewards(rewards, kl, mask, 0.1)
    assert torch.equal(out["token_rewards"], token_rewards)
    assert torch.equal(out["advantages"], gae(token_rewards, values, mask, 0.99, 0.95)[0])
    # GRPO leaves the KL out of the rewards: it belongs in the loss.
    out = get_estimator("grpo")(**kwargs)
    assert torch.equal(out["token_rewards"], compute_token_rewards(rewards, None, mask, 0.0))
    with pytest.raises(ValueError, match="--advantage_estimator"):
        get_estimator("ppo2")
    with pytest.raises(ValueError, match="--advantage_estimator"):
        get_estimator("gae")(**{**kwargs, "values": None})


def test_whiten_advantages():
    r, v, _, _, mask, _ = _batch(6)
    adv, _ = gae(r, v, mask, 1.0, 0.95)
    w = whiten_advantages(adv, mask)
    sel = w[mask.bool()]
    assert abs(sel.mean().item()) < 1e-9 and sel.std().item() == pytest.approx(1.0, abs=1e-6)
    assert (w[mask == 0] == 0).all()
