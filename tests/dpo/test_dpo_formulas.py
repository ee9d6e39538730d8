"""Every DPO/KTO coefficient flag reaches a real job's loss (the launchers' body, rlhf.supervised.loop.main, in this process, one
rank, a few steps): each call of the loss records its inputs and output, and the output must be the peer's formula at
the flag's value on those inputs: OpenRLHF's ``DPOLoss`` (openrlhf/models/loss.py at 3c3be6234e0c, tests/peer_math.py)
for ``--beta``, cDPO's ``--label_smoothing`` and ``--ipo``; OpenRLHF's ``KTOLoss`` (openrlhf/models/loss.py at 04898500,
the last commit before OpenRLHF removed KTO, written out below) for ``--beta``, ``--desirable_loss_weight`` and
``--undesirable_loss_weight``. Controls: the same inputs at the defaults give another loss, so a flag ignored shows."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peer_math import openrlhf_dpo_loss

pytestmark = pytest.mark.timeout(300)


def _run(task, pref_setup, tmp_path, monkeypatch, extra: list[str]) -> None:
    from helpers import free_port
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.supervised.loop import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    data = pref_setup["kto"] if task.__name__.endswith("kto") else pref_setup["pref"]
    keys = ["--input_key", "prompt", "--output_key", "completion", "--label_key", "label"] \
        if task.__name__.endswith("kto") else []
    argv = ["--pretrain", pref_setup["model"], "--dataset", data, *keys, "--save_path", str(tmp_path / "o"),
            "--train_batch_size", "16", "--micro_train_batch_size", "8", "--max_len", "32", "--max_samples", "48",
            "--learning_rate", "3e-3", "--lr_warmup_ratio", "0", "--seed", "7", *extra]
    try:
        assert main(task, argv) == 0
    finally:
        destroy_mesh()


def _record(monkeypatch, module, name: str) -> list:
    calls = []
    real = getattr(module, name)

    def recording(*args, **kw):
        out = real(*args, **kw)
        kept = (out[0].detach().clone(), int(out[1])) if isinstance(out, tuple) else (out.detach().clone(), 1)
        calls.append(([a.detach().clone() for a in args], dict(kw), *kept))
        return out

    monkeypatch.setattr(module, name, recording)
    return calls


@pytest.mark.parametrize("flags,want", [
    (["--beta", "0.25"], dict(beta=0.25)),
    (["--beta", "0.3", "--loss_type", "cdpo", "--label_smoothing", "0.2"], dict(beta=0.3, label_smoothing=0.2)),
    (["--beta", "0.2", "--ipo"], dict(beta=0.2, ipo=True)),
])
def test_dpo_flags_reach_the_loss(pref_setup, tmp_path, monkeypatch, flags, want):
    from rlhf.algo import preference_losses

    calls = _record(monkeypatch, preference_losses, "dpo_loss")
    from rlhf.supervised import dpo

    _run(dpo, pref_setup, tmp_path, monkeypatch, flags)
    assert len(calls) >= 4  # 3 steps x 2 micro-batches
    told = 0
    for args, _, loss_sum, n in calls:
        peer, _, _ = openrlhf_dpo_loss(*args, **want)
        assert float(loss_sum) / n == pytest.approx(float(peer), rel=1e-5, abs=1e-7)
        default, _, _ = openrlhf_dpo_loss(*args, beta=0.1)
        told += abs(float(default - peer)) > 1e-4
    assert told >= 1, "the flags' values and the defaults give the same loss: the check cannot tell"


def openrlhf_kto_loss(chosen, rejected, kl_logps, ref_chosen, ref_rejected, ref_kl_logps, beta, w_d, w_u):
    """OpenRLHF's ``KTOLoss.forward`` at 04898500 (one process: its all_reduce of the KL over ranks is the identity)."""
    kl = (kl_logps - ref_kl_logps).mean().clamp(min=0)
    chosen_losses = 1 - F.sigmoid(beta * ((chosen - ref_chosen) - kl))
    rejected_losses = 1 - F.sigmoid(beta * (kl - (rejected - ref_rejected)))
    return torch.cat((w_d * chosen_losses, w_u * rejected_losses), 0).mean()


def test_kto_flags_reach_the_loss(pref_setup, tmp_path, monkeypatch):
    """``--beta 0.4 --desirable_loss_weight 1.5 --undesirable_loss_weight 0.7``: each call's loss is OpenRLHF's KTOLoss
    at those values on its inputs; the reference point is the recorded KL (``kto_kl_estimate``), recomputed here from
    the mismatched pairs' log-probs."""
    import rlhf.supervised.kto as kto_mod
    from rlhf.algo import preference_losses

    calls = _record(monkeypatch, kto_mod, "kto_loss")
    kls = _record(monkeypatch, kto_mod, "kto_kl_estimate")
    _run(kto_mod, pref_setup, tmp_path, monkeypatch, ["--beta", "0.4", "--desirable_loss_weight", "1.5",
                                                       "--undesirable_loss_weight", "0.7"])
    assert len(calls) >= 4 and len(kls) == len(calls)
    told = 0
    for (args, kw, loss_sum, n), (kl_args, _, kl_out, _) in zip(calls, kls):
        logps, ref, labels, kl = args
        assert float(kl) == pytest.approx(float((kl_args[0] - kl_args[1]).mean().clamp(min=0)), abs=1e-6)
        d, u = labels.bool(), ~labels.bool()
        peer = openrlhf_kto_loss(logps[d], logps[u], kl_args[0], ref[d], ref[u], kl_args[1], 0.4, 1.5, 0.7)
        assert float(loss_sum) / n == pytest.approx(float(peer), rel=1e-5, abs=1e-7), kw
        default = openrlhf_kto_loss(logps[d], logps[u], kl_args[0], ref[d], ref[u], kl_args[1], 0.1, 1.0, 1.0)
        told += abs(float(default - peer)) > 1e-4
    assert told >= 1
    assert preference_losses.kto_loss is not None
