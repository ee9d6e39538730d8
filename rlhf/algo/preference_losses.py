"""Offline preference losses: DPO, IPO, cDPO (paired) and KTO (unpaired). Pure: tensors in, loss + metrics out.

Inputs are *sequence* log-probs, ``log pi(y | x)`` summed over the response tokens, of the trained policy and of
the frozen reference. The implicit reward of a response is ``beta * (logp - ref_logp)``.

Every loss returns megatron's per-token contract, ``(loss_sum, n, {name: [sum, count]})`` (see rlhf/runtime/role.py),
so ``loss_sum / n`` summed over micro-batches and DP ranks is the mean over the global batch.

    loss_sum, n, metrics = PREFERENCE_LOSSES["dpo"](pc, pr, rc, rr, beta=0.1)

Formulas (as in OpenRLHF's ``DPOLoss`` / ``KTOLoss`` and TRL), with ``h = (pc - pr) - (rc - rr)``:
- dpo:  ``-log sigmoid(beta * h)``                                                    (Rafailov et al. 2023)
- cdpo: ``-(1 - eps) log sigmoid(beta * h) - eps log sigmoid(-beta * h)``, eps = label_smoothing
        (conservative DPO: each label is flipped with probability eps)
- ipo:  ``(h - 1 / (2 * beta)) ** 2``                                                  (Azar et al. 2023)
  on summed log-probs, as OpenRLHF does (TRL averages over tokens for IPO).
- kto:  desirable ``w_d * (1 - sigmoid(beta * (logratio - z)))``, undesirable
        ``w_u * (1 - sigmoid(beta * (z - logratio)))``, with the reference point ``z`` = a KL estimate,
        ``mean(logp - ref_logp)`` over mismatched (prompt, completion) pairs, clamped at 0 and detached
        (Ethayarajh et al. 2024).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Metrics = dict[str, list]


def _count(b: int) -> torch.Tensor:
    return torch.tensor(b, dtype=torch.int)


def _pair_metrics(loss: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> Metrics:
    n = _count(loss.shape[0])
    margin = chosen_rewards - rejected_rewards
    return {"loss": [loss.sum().detach(), n], "acc": [(margin > 0).float().sum(), n],
            "chosen_reward": [chosen_rewards.sum(), n], "rejected_reward": [rejected_rewards.sum(), n],
            "margin": [margin.sum(), n]}


def dpo_loss(logps_chosen: torch.Tensor, logps_rejected: torch.Tensor, ref_logps_chosen: torch.Tensor,
             ref_logps_rejected: torch.Tensor, *, beta: float, label_smoothing: float = 0.0, ipo: bool = False):
    """DPO (``label_smoothing`` 0), cDPO (``label_smoothing`` in (0, 0.5)) or IPO (``ipo``). All inputs (B,):
    sequence log-probs of the chosen / rejected responses under the policy and the reference.

    Metrics: loss, acc (chosen reward > rejected reward), chosen_reward, rejected_reward and margin, where a
    reward is ``beta * (logp - ref_logp)`` (detached).
    """
    h = (logps_chosen - logps_rejected) - (ref_logps_chosen - ref_logps_rejected)  # (B,)
    if ipo:
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        loss = -F.logsigmoid(beta * h) * (1.0 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    chosen_rewards = beta * (logps_chosen - ref_logps_chosen).detach()
    rejected_rewards = beta * (logps_rejected - ref_logps_rejected).detach()
    return loss.sum(), _count(loss.shape[0]), _pair_metrics(loss, chosen_rewards, rejected_rewards)


def ipo_loss(logps_chosen, logps_rejected, ref_logps_chosen, ref_logps_rejected, *, beta: float,
             label_smoothing: float = 0.0):
    return dpo_loss(logps_chosen, logps_rejected, ref_logps_chosen, ref_logps_rejected, beta=beta, ipo=True)


def cdpo_loss(logps_chosen, logps_rejected, ref_logps_chosen, ref_logps_rejected, *, beta: float,
              label_smoothing: float):
    return dpo_loss(logps_chosen, logps_rejected, ref_logps_chosen, ref_logps_rejected, beta=beta,
                    label_smoothing=label_smoothing)


def _dpo(logps_chosen, logps_rejected, ref_logps_chosen, ref_logps_rejected, *, beta: float,
         label_smoothing: float = 0.0):
    return dpo_loss(logps_chosen, logps_rejected, ref_logps_chosen, ref_logps_rejected, beta=beta)


PREFERENCE_LOSSES: dict[str, Callable] = {"dpo": _dpo, "ipo": ipo_loss, "cdpo": cdpo_loss}
"""``--loss_type`` -> loss. Each takes (logps_chosen, logps_rejected, ref_logps_chosen, ref_logps_rejected, *,
beta, label_smoothing)."""


def kto_kl_estimate(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor, group=None) -> torch.Tensor:
    """KTO's reference point: ``mean(logp - ref_logp)`` over mismatched pairs (B,), clamped at 0, detached.

    With ``group`` (the data-parallel group) the mean is over the pairs of every rank in it, as TRL and OpenRLHF
    average it over processes: every rank of the group must call it the same number of times."""
    diff = (kl_logps - ref_kl_logps).detach()
    if group is None:
        return diff.mean().clamp(min=0)
    import torch.distributed as dist

    s = torch.stack([diff.sum(), torch.tensor(float(diff.numel()), dtype=diff.dtype, device=diff.device)])
    dist.all_reduce(s, group=group)
    return (s[0] / s[1]).clamp(min=0)


def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor, *,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
    """KTO over unpaired samples. logps, ref_logps (B,) sequence log-probs; labels (B,) bool (True: desirable);
    kl () the reference point (``kto_kl_estimate``). The loss is the weighted mean over the B samples.

    Metrics: loss, chosen_reward (mean ``beta * logratio`` of desirable samples), rejected_reward (of undesirable
    ones), kl.
    """
    labels = labels.bool()
    logratio = logps - ref_logps  # (B,)
    desirable = desirable_weight * (1.0 - torch.sigmoid(beta * (logratio - kl)))
    undesirable = undesirable_weight * (1.0 - torch.sigmoid(beta * (kl - logratio)))
    loss = torch.where(labels, desirable, undesirable)  # (B,)
    rewards = beta * logratio.detach()
    n = _count(loss.shape[0])
    n_d, n_u = _count(int(labels.sum())), _count(int((~labels).sum()))
    metrics = {"loss": [loss.sum().detach(), n], "chosen_reward": [rewards[labels].sum(), n_d],
               "rejected_reward": [rewards[~labels].sum(), n_u], "kl": [kl.detach() * loss.shape[0], n]}
    return loss.sum(), n, metrics
