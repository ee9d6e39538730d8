"""SFT and reward-model losses in megatron's per-token contract: ``(loss_sum, count, {name: [sum, count]})``.

``loss_sum / count`` summed over every micro-batch and DP rank is the exact mean over the global batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, *, tp_group=None,
                        vocab_size: int | None = None, temperature: float = 1.0) -> torch.Tensor:
    """log p(input_ids[:, t+1] | ..t). logits (B, S, V_local) vocab-parallel -> (B, S-1) fp32."""
    import kernels

    b, s, v = logits.shape
    lp = kernels.token_logprobs(logits[:, :-1].reshape(-1, v), input_ids[:, 1:].reshape(-1),
                                temperature=temperature, tp_group=tp_group, vocab_size=vocab_size)
    return lp.view(b, s - 1)


def sft_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, *, tp_group=None,
             vocab_size: int | None = None):
    """Negative log-likelihood of the response tokens only.

    logits (B, S, V_local); input_ids, loss_mask (B, S) with loss_mask 1 on the response tokens to predict.
    """
    lp = next_token_logprobs(logits, input_ids, tp_group=tp_group, vocab_size=vocab_size)  # (B, S-1)
    mask = loss_mask[:, 1:].to(lp.dtype)
    loss_sum = -(lp * mask).sum()
    n = mask.sum().to(torch.int)
    return loss_sum, n, {"loss": [loss_sum.detach(), n.detach()]}


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last non-pad token of each right-padded row. attention_mask (B, S) -> (B,)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask.to(positions.dtype)).argmax(dim=-1)


def sequence_rewards(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The score head at the last non-pad token, as HF ``*ForSequenceClassification`` does. (B, S) -> (B,)."""
    idx = last_token_index(attention_mask)
    return values.gather(1, idx.unsqueeze(1)).squeeze(1).float()


def pairwise_rm_loss(values: torch.Tensor, attention_mask: torch.Tensor, margin: torch.Tensor | None = None):
    """``-log sigmoid(r_chosen - r_rejected - margin)``. values/attention_mask (2B, S): chosen rows first."""
    r = sequence_rewards(values, attention_mask)
    b = r.shape[0] // 2
    chosen, rejected = r[:b], r[b:]
    gap = chosen - rejected
    loss = -F.logsigmoid(gap - (margin.float() if margin is not None else 0.0))
    n = torch.tensor(b, dtype=torch.int)
    acc = (gap > 0).float().sum()
    return loss.sum(), n, {"loss": [loss.sum().detach(), n], "acc": [acc, n], "reward_gap": [gap.sum().detach(), n],
                           "chosen_reward": [chosen.sum().detach(), n],
                           "rejected_reward": [rejected.sum().detach(), n]}
