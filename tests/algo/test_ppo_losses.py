"""PPO losses, KL estimators, masked statistics and the KL controller against hand-computed values."""
import math

import pytest
import torch

from rlhf.algo.kl import AdaptiveKLController, FixedKLController, make_kl_controller
from rlhf.algo.ppo_losses import (kl_estimate, kl_loss, masked_mean, masked_sum, masked_var, masked_whiten,
                                  policy_loss, value_loss)

F64 = torch.float64


def t(rows, dtype=F64):
    return torch.tensor(rows, dtype=dtype)


# Row 0: token 0 unclipped (ratio 1), token 1 clipped above (ratio e^0.3 > 1.2, A > 0), token 2 clipped below
# (ratio e^-0.5 < 0.8, A < 0). Row 1: one real token (ratio e^-0.1, inside the band), then padding holding values
# that would overflow exp() if they leaked.
LOGPROBS = [[-1.0, -0.5, -2.0], [-0.3, 100.0, 100.0]]
OLD = [[-1.0, -0.8, -1.5], [-0.2, 0.0, 0.0]]
ADV = [[1.0, 2.0, -1.0], [0.5, 3.0, 3.0]]
MASK = [[1, 1, 1], [1, 0, 0]]


def _policy(eps_clip_high=None, weights=None, dtype=F64):
    lp = t(LOGPROBS, dtype).requires_grad_(True)
    out = policy_loss(lp, t(OLD, dtype), t(ADV, dtype), torch.tensor(MASK), eps_clip=0.2,
                      eps_clip_high=eps_clip_high, rollout_is_weights=weights)
    return lp, out


def test_policy_loss_hand_values():
    lp, (loss_sum, n, m) = _policy()
    # -min(r A, clip(r) A) per token: -1*1, -1.2*2, -(0.8*-1), -e^-0.1*0.5
    expected = -1.0 - 2.4 + 0.8 - 0.5 * math.exp(-0.1)
    assert loss_sum.item() == pytest.approx(expected, abs=1e-12)
    assert n.dtype == torch.int32 and n.item() == 4
    assert m["policy_loss"][0].item() == pytest.approx(expected, abs=1e-12) and m["policy_loss"][1].item() == 4
    assert not m["policy_loss"][0].requires_grad
    assert m["clip_frac"][0].item() == 2.0
    assert m["approx_kl"][0].item() == pytest.approx(0.5 * (0.0 + 0.3 ** 2 + 0.5 ** 2 + 0.1 ** 2), abs=1e-12)
    assert m["ratio"][0].item() == pytest.approx(1.0 + math.exp(0.3) + math.exp(-0.5) + math.exp(-0.1), abs=1e-12)
    assert all(v[1].item() == 4 for v in m.values())


def test_policy_loss_fp32_padding_overflow_is_masked():
    lp, (loss_sum, n, m) = _policy(dtype=torch.float32)
    loss_sum.backward()
    assert math.isfinite(loss_sum.item()) and math.isfinite(m["ratio"][0].item())
    assert torch.isfinite(lp.grad).all()
    assert loss_sum.item() == pytest.approx(-1.0 - 2.4 + 0.8 - 0.5 * math.exp(-0.1), abs=1e-6)


def test_policy_loss_clip_higher_and_is_weights():
    _, (loss_sum, _, m) = _policy(eps_clip_high=0.4)  # e^0.3 = 1.35 < 1.4: token 1 no longer clipped
    assert loss_sum.item() == pytest.approx(-1.0 - 2 * math.exp(0.3) + 0.8 - 0.5 * math.exp(-0.1), abs=1e-12)
    assert m["clip_frac"][0].item() == 1.0
    w = t([[1.0, 0.5, 2.0], [3.0, 9.0, 9.0]])
    _, (loss_sum, _, _) = _policy(weights=w)
    assert loss_sum.item() == pytest.approx(-1.0 - 0.5 * 2.4 + 2 * 0.8 - 3 * 0.5 * math.exp(-0.1), abs=1e-12)


def test_policy_loss_gradient_zero_on_clipped_tokens():
    lp, (loss_sum, _, _) = _policy()
    loss_sum.backward()
    # d/dlogp of -r*A is -A*r on unclipped tokens; 0 on clipped tokens and padding.
    expected = [[-1.0, 0.0, 0.0], [-0.5 * math.exp(-0.1), 0.0, 0.0]]
    assert torch.allclose(lp.grad, t(expected), atol=1e-12, rtol=0)


@pytest.mark.parametrize("log_ratio,adv,clipped", [
    (0.5, 1.0, True),     # ratio 1.65 > 1.2 and A > 0: clipped
    (0.5, -1.0, False),   # ratio above the band but A < 0: the unclipped term is the min, gradient flows
    (-0.5, -1.0, True),   # ratio 0.61 < 0.8 and A < 0: clipped
    (-0.5, 1.0, False),   # ratio below the band but A > 0: gradient flows
    (0.1, -2.0, False),   # inside the band
])
def test_policy_loss_gradient_by_sign_of_advantage(log_ratio, adv, clipped):
    lp = t([[log_ratio - 1.0]]).requires_grad_(True)
    loss_sum, _, m = policy_loss(lp, t([[-1.0]]), t([[adv]]), torch.tensor([[1]]), eps_clip=0.2)
    loss_sum.backward()
    expected = 0.0 if clipped else -adv * math.exp(log_ratio)
    assert lp.grad.item() == pytest.approx(expected, abs=1e-12)
    assert m["clip_frac"][0].item() == float(clipped)


VALUES = [[1.0, 2.0, 5.0], [0.0, 1e30, 1e30]]
OLD_VALUES = [[1.0, 1.5, 5.0], [1.0, 0.0, 0.0]]
RETURNS = [[2.0, 3.0, 0.0], [0.5, 0.0, 0.0]]
VMASK = [[1, 1, 0], [1, 0, 0]]


def test_value_loss_clipped_hand_values():
    v = t(VALUES, torch.float32).requires_grad_(True)
    loss_sum, n, m = value_loss(v, t(OLD_VALUES), t(RETURNS), torch.tensor(VMASK), value_clip=0.2)
    # token (0,0): v == old, (1-2)^2 = 1 both ways -> 0.5, not clipped.
    # token (0,1): clip(2, 1.3, 1.7) = 1.7; max((2-3)^2, (1.7-3)^2) = 1.69 -> 0.845, clipped term active.
    # token (1,0): clip(0, 0.8, 1.2) = 0.8; max((0-.5)^2, (.8-.5)^2) = 0.25 -> 0.125, unclipped term active.
    assert loss_sum.item() == pytest.approx(0.5 + 0.845 + 0.125, abs=1e-6)
    assert n.item() == 3
    assert m["vf_clip_frac"][0].item() == 1.0
    assert m["values"][0].item() == pytest.approx(3.0)
    loss_sum.backward()
    # Gradient: (v - R) on the unclipped-active tokens, 0 where the clipped term is active (v outside the band).
    assert torch.allclose(v.grad, torch.tensor([[-1.0, 0.0, 0.0], [-0.5, 0.0, 0.0]]), atol=1e-6)


def test_value_loss_unclipped_hand_values():
    loss_sum, n, m = value_loss(t(VALUES), t(OLD_VALUES), t(RETURNS), torch.tensor(VMASK))
    assert loss_sum.item() == pytest.approx(0.5 * (1.0 + 1.0 + 0.25), abs=1e-12)
    assert m["vf_clip_frac"][0].item() == 0.0 and m["value_loss"][1].item() == 3


def test_kl_estimators_hand_values():
    lp = t([[-1.0, -2.0, 0.0]])
    ref = t([[-1.5, -1.0, 7.0]])
    mask = torch.tensor([[1, 1, 0]])
    k1 = kl_estimate(lp, ref, "k1", mask)
    k2 = kl_estimate(lp, ref, "k2", mask)
    k3 = kl_estimate(lp, ref, "k3", mask)
    assert torch.allclose(k1, t([[0.5, -1.0, 0.0]]), atol=1e-12)
    assert torch.allclose(k2, t([[0.125, 0.5, 0.0]]), atol=1e-12)
    # k3 = exp(ref - lp) - (ref - lp) - 1
    assert torch.allclose(k3, t([[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 2.0, 0.0]]), atol=1e-12)
    with pytest.raises(ValueError, match="--kl_estimator"):
        kl_estimate(lp, ref, "k4")


def test_kl_loss_sums_masked_k3():
    lp = t([[-1.0, -2.0, 0.0]]).requires_grad_(True)
    kl_sum, n, m = kl_loss(lp, t([[-1.5, -1.0, 7.0]]), torch.tensor([[1, 1, 0]]))
    assert kl_sum.item() == pytest.approx(math.exp(-0.5) + 0.5 - 1 + math.exp(1.0) - 2.0, abs=1e-12)
    assert n.item() == 2 and "kl_loss" in m
    kl_sum.backward()
    # d/dlp [exp(ref - lp) + lp - ref - 1] = 1 - exp(ref - lp)
    assert torch.allclose(lp.grad, t([[1 - math.exp(-0.5), 1 - math.exp(1.0), 0.0]]), atol=1e-12)


def _ragged(seed, b=5, t_=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t_, generator=g, dtype=F64) * 3 + 1.5
    lengths = torch.randint(1, t_ + 1, (b,), generator=g)
    mask = (torch.arange(t_)[None, :] < lengths[:, None]).long()
    return x, mask


def test_masked_stats_match_selection():
    x, mask = _ragged(0)
    sel = x[mask.bool()]
    assert masked_sum(x, mask).item() == pytest.approx(sel.sum().item(), abs=1e-12)
    assert masked_mean(x, mask).item() == pytest.approx(sel.mean().item(), abs=1e-12)
    assert masked_var(x, mask).item() == pytest.approx(sel.var(unbiased=True).item(), abs=1e-12)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(sel.var(unbiased=False).item(), abs=1e-12)
    rows = masked_mean(x, mask, dim=1)
    for i in range(x.shape[0]):
        assert rows[i].item() == pytest.approx(x[i, mask[i].bool()].mean().item(), abs=1e-12)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0  # empty mask: 0, not NaN


def test_masked_whiten_zero_mean_unit_std_padding_zeroed():
    x, mask = _ragged(1)
    w = masked_whiten(x, mask)
    sel = w[mask.bool()]
    assert sel.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert sel.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-6)
    assert (w[~mask.bool()] == 0).all()  # padding is zeroed, not left untouched
    w = masked_whiten(x, mask, shift_mean=False)
    assert w[mask.bool()].mean().item() == pytest.approx(x[mask.bool()].mean().item(), abs=1e-9)


def test_adaptive_kl_controller():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(9.0, n_steps=1000)  # e = clip(9/6 - 1 = 0.5) = 0.2; mult = 1 + 0.2 * 1000 / 10000 = 1.02
    assert ctl.value == pytest.approx(0.102, abs=1e-15)
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(torch.tensor(3.0), n_steps=1000)  # e = clip(-0.5) = -0.2 -> 0.98
    assert ctl.value == pytest.approx(0.098, abs=1e-15)
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(6.6, n_steps=1000)  # e = 0.1 (inside the clip) -> 1.01
    assert ctl.value == pytest.approx(0.101, abs=1e-15)

    state = ctl.state_dict()
    other = AdaptiveKLController(0.5, target=6.0, horizon=10000)
    other.load_state_dict(state)
    assert other.value == ctl.value and other.state_dict() == state
    other.update(9.0, 1000)
    ctl.update(9.0, 1000)
    assert other.value == ctl.value


def test_fixed_kl_controller_and_factory():
    ctl = make_kl_controller(0.05, None, 10000)
    assert type(ctl) is FixedKLController
    ctl.update(100.0, 1000)
    assert ctl.value == 0.05
    other = FixedKLController(0.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05
    assert isinstance(make_kl_controller(0.05, 6.0, 10000), AdaptiveKLController)
    with pytest.raises(ValueError, match="--kl_target"):
        make_kl_controller(0.05, 0.0, 10000)
    with pytest.raises(ValueError, match="--kl_horizon"):
        make_kl_controller(0.05, 6.0, 0)
    with pytest.raises(ValueError, match="--init_kl_coef"):
        make_kl_controller(-1.0, None, 10000)


def test_kl_estimates_are_clamped_at_wide_log_ratios():
    """OpenRLHF clamps the estimate to [-10, 10]; before, k3 reached e^10 - 11 (about 22,000) per token. Gradients
    stay finite, and are zero where the clamp holds."""
    lp = t([[0.0, 0.0, 0.0, -30.0, -200.0, -1.0]]).requires_grad_(True)
    ref = t([[-20.0, 20.0, -2.0, 0.0, 0.0, -1.5]])
    mask = torch.ones(1, 6, dtype=torch.bool)
    k1, k2, k3 = (kl_estimate(lp, ref, e, mask) for e in ("k1", "k2", "k3"))
    assert k1.tolist() == [[10.0, -10.0, 2.0, -10.0, -10.0, 0.5]]
    assert k2.tolist()[0][:5] == [10.0, 10.0, 2.0, 10.0, 10.0] and k2[0, 5].item() == pytest.approx(0.125)
    # k3 = exp(ref - lp) - (ref - lp) - 1, then clamped: 20 - 1 - e^-20 ~ 19 -> 10; e^20 - 21 -> 10; e^-2 + 1 stays
    expect = [10.0, 10.0, math.exp(-2) + 2 - 1, 10.0, 10.0, math.exp(-0.5) + 0.5 - 1]
    assert k3[0].tolist() == pytest.approx(expect, rel=1e-12)
    assert k3.max().item() <= 10.0  # the old guard gave e^10 - 11 = 22015.5 at log r = -20
    (k1.sum() + k2.sum() + k3.sum()).backward()
    g = lp.grad[0]
    assert torch.isfinite(g).all()
    assert g[3].item() == 0.0 and g[4].item() == 0.0  # clamped for every estimator: no gradient
    # unclamped token 5 (log r = 0.5): d/dlp [k1 + k2 + k3] = 1 + 0.5 + (1 - e^-0.5)
    assert g[5].item() == pytest.approx(1 + 0.5 + 1 - math.exp(-0.5), rel=1e-12)
