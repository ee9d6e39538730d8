"""SFT and reward-model losses in megatron's per-token contract: ``(loss_sum, count, {name: [sum, count]})``.

``loss_sum / count`` summed over every micro-batch and DP rank is the exact mean over the global batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, *, tp_group=None,
                        vocab_size: int | None = None, temperature: float = 1.0,
                        inplace_backward: bool = False, cp=None) -> torch.Tensor:
    """log p(input_ids[:, t+1] | ..t). logits (B, S, V_local) vocab-parallel -> (B, S-1) fp32.

    ``inplace_backward``: the backward writes the gradient into ``logits``' own storage instead of a new
    ``[B*S, V_local]`` tensor (see ``kernels.token_logprobs``). Only when nothing uses ``logits`` afterwards.
    ``cp``: a context-parallel split (``rlhf.models.context_parallel.CPLayout``); logits are then this rank's
    tokens (B, S_local, V_local), and the log-probs are gathered over its group into (B, S-1).
    """
    import rlhf.kernels as kernels

    targets = torch.zeros_like(input_ids)  # (B, S): the last position's target is a dummy, its log-prob dropped
    targets[:, :-1] = input_ids[:, 1:]
    if cp is not None:
        from rlhf.models.context_parallel import gather_tokens, split_input

        targets = split_input(targets, cp, dim=1)  # (B, S_local)
    # All S positions rather than logits[:, :-1]: slicing would make the kernel's input a copy (and its gradient
    # a second [B, S, V] buffer). Rows go in (S, B) order, megatron's own layout, in which flattening its
    # (transposed) logits is a view. The order is fixed, not picked from strides: with TP the row statistics are
    # all-reduced row by row, so every rank must use the same order, whatever layout its shard has.
    kw = dict(temperature=temperature, tp_group=tp_group, vocab_size=vocab_size, inplace_backward=inplace_backward)
    lp = kernels.token_logprobs(logits.transpose(0, 1), targets.t(), **kw).t()  # (B, S) [or (B, S_local)]
    if cp is not None:
        lp = gather_tokens(lp, cp)
    return lp[:, :-1]


def _masked_nll(lp: torch.Tensor, mask: torch.Tensor):
    mask = mask.to(lp.dtype)
    loss_sum = -(lp * mask).sum()
    n = mask.sum().to(torch.int)
    return loss_sum, n, {"loss": [loss_sum.detach(), n.detach()]}


def sft_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, *, tp_group=None,
             vocab_size: int | None = None, inplace_backward: bool = False, cp=None):
    """Negative log-likelihood of the response tokens only.

    logits (B, S, V_local); input_ids, loss_mask (B, S) with loss_mask 1 on the response tokens to predict.
    ``inplace_backward``, ``cp``: see ``next_token_logprobs``.
    """
    lp = next_token_logprobs(logits, input_ids, tp_group=tp_group, vocab_size=vocab_size,
                             inplace_backward=inplace_backward, cp=cp)  # (B, S-1)
    return _masked_nll(lp, loss_mask[:, 1:])


def packed_sft_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                    cu_seqlens: torch.Tensor, *, tp_group=None, vocab_size: int | None = None,
                    inplace_backward: bool = False, cp=None):
    """``sft_loss`` on a packed micro-batch (``rlhf.models.packing``): sequences back to back in one row.

    logits (1, T, V_local); input_ids, loss_mask (1, T); cu_seqlens [n + 1] over the whole stream (dummy
    padding included, i.e. ``packed_seq_params.cu_seqlens_q``). The last token of each sequence predicts
    nothing: a target never crosses into the next sequence.
    """
    import rlhf.kernels as kernels

    targets, mask = packed_sft_targets(input_ids, loss_mask, cu_seqlens)  # (T,), (T,) bool
    if cp is not None:  # logits (1, T_local, V_local): this rank's tokens; the log-probs gathered back to (T,)
        from rlhf.models.context_parallel import gather_tokens, split_input

        targets = split_input(targets.unsqueeze(0), cp, dim=1)[0]
    lp = kernels.token_logprobs(logits[0], targets, tp_group=tp_group, vocab_size=vocab_size,
                                inplace_backward=inplace_backward)  # (T,) [or (T_local,)]
    if cp is not None:
        lp = gather_tokens(lp.unsqueeze(0), cp)[0]
    return _masked_nll(lp, mask)


def packed_sft_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor):
    """A packed micro-batch's next-token targets (T,) and which positions are scored (T,) bool: position t iff
    token t + 1 is a response token of the same sequence (``packed_sft_loss``, and SFT's fused head)."""
    import rlhf.kernels as kernels

    targets, valid = kernels.packed_next_tokens(input_ids[0], cu_seqlens)  # (T,), (T,) bool
    mask = torch.zeros_like(valid)
    mask[:-1] = loss_mask[0, 1:].bool()
    return targets, mask & valid


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last non-pad token of each right-padded row. attention_mask (B, S) -> (B,)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask.to(positions.dtype)).argmax(dim=-1)


def sequence_rewards(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The score head at the last non-pad token, as HF ``*ForSequenceClassification`` does. (B, S) -> (B,)."""
    idx = last_token_index(attention_mask)
    return values.gather(1, idx.unsqueeze(1)).squeeze(1).float()


def packed_sequence_rewards(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The score head at the last token of each packed sequence. values (1, T); cu_seqlens [B + 1] of the real
    (non-empty) sequences, i.e. the batch's ``cu_seqlens``, not the dummy padding -> (B,)."""
    return values[0, cu_seqlens[1:].long() - 1].float()


def pairwise_rm_loss(values: torch.Tensor, attention_mask: torch.Tensor, margin: torch.Tensor | None = None):
    """``-log sigmoid(r_chosen - r_rejected - margin)``. values/attention_mask (2B, S): chosen rows first."""
    return pairwise_loss(sequence_rewards(values, attention_mask), margin)


def pairwise_loss(rewards: torch.Tensor, margin: torch.Tensor | None = None):
    """``-log sigmoid(r_chosen - r_rejected - margin)`` from rewards (2B,): chosen first, then rejected."""
    r = rewards
    b = r.shape[0] // 2
    chosen, rejected = r[:b], r[b:]
    gap = chosen - rejected
    loss = -F.logsigmoid(gap - (margin.float() if margin is not None else 0.0))
    n = torch.tensor(b, dtype=torch.int)
    acc = (gap > 0).float().sum()
    return loss.sum(), n, {"loss": [loss.sum().detach(), n], "acc": [acc, n], "reward_gap": [gap.sum().detach(), n],
                           "chosen_reward": [chosen.sum().detach(), n],
                           "rejected_reward": [rejected.sum().detach(), n]}
