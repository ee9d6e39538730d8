"""DPO / IPO / cDPO / KTO losses against values computed by hand with plain python math."""
import math

import pytest
import torch

from rlhf.algo.preference_losses import (PREFERENCE_LOSSES, dpo_loss, kto_kl_estimate, kto_loss)

F64 = torch.float64


def t(xs):
    return torch.tensor(xs, dtype=F64)


def logsig(x):
    return -math.log1p(math.exp(-x))


# Two pairs. Pair 0: policy log-ratio (chosen - rejected) = -3 - (-5) = 2, reference's = -4 - (-4.5) = 0.5, so
# h = 1.5. Pair 1: policy -7 - (-6) = -1, reference -6.5 - (-6) = -0.5, h = -0.5.
PC, PR, RC, RR = [-3.0, -7.0], [-5.0, -6.0], [-4.0, -6.5], [-4.5, -6.0]
H = [1.5, -0.5]
BETA = 0.1


def test_dpo_hand_values():
    pc = t(PC).requires_grad_(True)
    loss_sum, n, m = dpo_loss(pc, t(PR), t(RC), t(RR), beta=BETA)
    expected = [-logsig(BETA * h) for h in H]  # 0.62096..., 0.71846...
    assert loss_sum.item() == pytest.approx(sum(expected), abs=1e-12)
    assert n.item() == 2 and m["loss"][1].item() == 2
    # chosen rewards beta*(pc - rc) = 0.1, -0.05; rejected beta*(pr - rr) = -0.05, 0.0
    assert m["chosen_reward"][0].item() == pytest.approx(0.1 - 0.05, abs=1e-12)
    assert m["rejected_reward"][0].item() == pytest.approx(-0.05 + 0.0, abs=1e-12)
    assert m["margin"][0].item() == pytest.approx(0.15 - 0.05, abs=1e-12)  # margins 0.15, -0.05
    assert m["acc"][0].item() == 1.0  # pair 0 only
    # d/d pc of -log sigmoid(beta h) = -beta * (1 - sigmoid(beta h))
    loss_sum.backward()
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert pc.grad.tolist() == pytest.approx([-BETA * (1 - sig(BETA * h)) for h in H], abs=1e-12)
    assert math.isclose(expected[0], 0.6209570, abs_tol=1e-6)  # written out: -log(sigmoid(0.15)) = log(1 + e^-0.15)


def test_cdpo_hand_values():
    eps = 0.2
    loss_sum, n, m = PREFERENCE_LOSSES["cdpo"](t(PC), t(PR), t(RC), t(RR), beta=BETA, label_smoothing=eps)
    expected = sum(-(1 - eps) * logsig(BETA * h) - eps * logsig(-BETA * h) for h in H)
    assert loss_sum.item() == pytest.approx(expected, abs=1e-12)
    # label_smoothing 0.5 makes the loss blind to the label: both orders cost the same
    a = PREFERENCE_LOSSES["cdpo"](t(PC), t(PR), t(RC), t(RR), beta=BETA, label_smoothing=0.5)[0]
    b = PREFERENCE_LOSSES["cdpo"](t(PR), t(PC), t(RR), t(RC), beta=BETA, label_smoothing=0.5)[0]
    assert a.item() == pytest.approx(b.item(), abs=1e-12)


def test_dpo_ignores_label_smoothing_and_ipo_hand_values():
    plain = PREFERENCE_LOSSES["dpo"](t(PC), t(PR), t(RC), t(RR), beta=BETA, label_smoothing=0.3)[0]
    assert plain.item() == pytest.approx(sum(-logsig(BETA * h) for h in H), abs=1e-12)
    loss_sum, n, m = PREFERENCE_LOSSES["ipo"](t(PC), t(PR), t(RC), t(RR), beta=BETA)
    # (h - 1/(2 beta))^2 = (1.5 - 5)^2 + (-0.5 - 5)^2 = 12.25 + 30.25
    assert loss_sum.item() == pytest.approx(42.5, abs=1e-12)
    assert n.item() == 2


def test_kto_hand_values():
    # Three samples: two desirable, one undesirable. Log-ratios logp - ref_logp: 0.5, -1.0, 2.0.
    lp, ref = t([-2.0, -4.0, -1.0]), t([-2.5, -3.0, -3.0])
    labels = torch.tensor([True, True, False])
    # Mismatched pairs: log-ratios 0.3 and 0.1 -> z = 0.2
    z = kto_kl_estimate(t([-1.0, -2.0]), t([-1.3, -2.1]))
    assert z.item() == pytest.approx(0.2, abs=1e-12)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    wd, wu, beta = 1.0, 1.5, 0.5
    loss_sum, n, m = kto_loss(lp, ref, labels, z, beta=beta, desirable_weight=wd, undesirable_weight=wu)
    expected = (wd * (1 - sig(beta * (0.5 - 0.2))) + wd * (1 - sig(beta * (-1.0 - 0.2)))
                + wu * (1 - sig(beta * (0.2 - 2.0))))
    assert loss_sum.item() == pytest.approx(expected, abs=1e-12)
    assert n.item() == 3
    assert m["chosen_reward"][0].item() == pytest.approx(beta * (0.5 - 1.0), abs=1e-12)
    assert m["chosen_reward"][1].item() == 2 and m["rejected_reward"][1].item() == 1
    assert m["rejected_reward"][0].item() == pytest.approx(beta * 2.0, abs=1e-12)
    assert m["kl"][0].item() / m["kl"][1].item() == pytest.approx(0.2, abs=1e-12)


def test_kto_kl_is_clamped_and_detached():
    kl_lp = t([-3.0, -3.0]).requires_grad_(True)
    z = kto_kl_estimate(kl_lp, t([-1.0, -2.0]))  # mean log-ratio -1.5 -> clamped to 0
    assert z.item() == 0.0 and not z.requires_grad


def _kl_over_dp(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    # rank 0: log-ratios 0.3, 0.1; rank 1: -0.1 -> mean over the group's 3 pairs 0.1 (each rank alone: 0.2, 0)
    rows = {0: (t([-1.0, -2.0]), t([-1.3, -2.1])), 1: (t([-1.1]), t([-1.0]))}[rank]
    z = kto_kl_estimate(*rows, group=dist.group.WORLD)
    neg = kto_kl_estimate(t([-5.0]), t([-1.0]), group=dist.group.WORLD)  # mean < 0 over the group -> 0
    torch.save({"z": z, "neg": neg, "local": kto_kl_estimate(*rows)}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_kto_kl_is_averaged_over_the_dp_group(tmp_path):
    from helpers import spawn_within

    out = str(tmp_path / "kl")
    spawn_within(_kl_over_dp, (2, f"file://{tmp_path / 'store'}", out), nprocs=2, timeout=300)
    for rank, local in ((0, 0.2), (1, 0.0)):
        r = torch.load(f"{out}.{rank}")
        assert r["z"].item() == pytest.approx(0.1, abs=1e-12)
        assert r["neg"].item() == 0.0
        assert r["local"].item() == pytest.approx(local, abs=1e-12)
