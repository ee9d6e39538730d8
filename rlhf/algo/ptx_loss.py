"""PPO-ptx: the actor's policy loss and a pretraining next-token loss in one optimizer step (pure: tensors in,
losses out, in megatron's per-token contract of ``rlhf.algo.ppo_losses``)."""
from __future__ import annotations

import torch

from rlhf.algo.ppo_losses import _count, masked_sum


def make_ptx_combined_loss(actor_loss, ptx_logprobs_fn, *, ptx_coef: float, n_policy: float, n_ptx: float,
                           metric_keys: tuple):
    """The actor's policy loss plus ``ptx_coef`` times a pretraining (ptx) next-token loss, in one optimizer step
    (InstructGPT's PPO-ptx; OpenRLHF's --ptx_coef, DeepSpeed-Chat's --unsup_coef).

    A micro-batch holding ``loss_mask`` is a ptx batch: ``ptx_logprobs_fn(batch, output)`` -> (B, S-1) log-probs of
    its next tokens. The schedule divides the summed losses by the summed token counts of all micro-batches; the
    sums are scaled so that the step's loss is ``policy_mean + ptx_coef * ptx_mean``, each a mean over its own
    tokens: ``n_policy`` response tokens and ``n_ptx`` ptx target tokens of the whole step (all DP ranks).
    Metrics: ``metric_keys`` from the policy batches, ``ptx_loss`` from the ptx batches."""
    total = n_policy + n_ptx

    def loss_fn(batch: dict, output: torch.Tensor):
        if "loss_mask" in batch:
            lp = ptx_logprobs_fn(batch, output)  # (B, S-1)
            mask = batch["loss_mask"][:, 1:]
            nll = -masked_sum(lp, mask)
            n = _count(mask)
            metrics = {k: [torch.zeros((), device=nll.device), torch.zeros((), dtype=torch.int)] for k in metric_keys}
            metrics["ptx_loss"] = [nll.detach(), n]
            return nll * (ptx_coef * total / max(n_ptx, 1.0)), n, metrics
        loss, n, metrics = actor_loss(batch, output)
        metrics["ptx_loss"] = [torch.zeros((), device=loss.device), torch.zeros((), dtype=torch.int)]
        return loss * (total / max(n_policy, 1.0)), n, metrics

    return loss_fn
