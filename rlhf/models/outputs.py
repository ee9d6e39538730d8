"""Readers of a model's outputs at the positions a workflow needs: the response tokens' log-probs (actor,
reference), the critic's per-token values, a reward model's per-sequence score.

Shapes: B rows, S = padded prompt+response length, T = response width, H hidden size. A batch is either padded
(``input_ids`` (B, S), ``resp_pos`` (B, T): the position whose output predicts response token j,
``prompt_len - 1 + j``) or packed into one row of N tokens (``packed_resp_pos`` (B, T), ``packed_last`` (B,)
index that row; ``rlhf.ppo.experience.pack_microbatch``)."""
from __future__ import annotations

import torch


def response_hidden(hidden: torch.Tensor, batch: dict) -> torch.Tensor:
    """hidden (B, S, H) [or packed (1, N, H)] -> (B, T, H) at the positions that predict the response tokens."""
    if "packed_resp_pos" in batch:
        return hidden[0][batch["packed_resp_pos"]]
    return hidden.gather(1, batch["resp_pos"].unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def response_values(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Critic output (B, S) [or packed (1, N)] -> (B, T) fp32 at the positions before each response token."""
    if "packed_resp_pos" in batch:
        return values[0][batch["packed_resp_pos"]].float()
    return values.gather(1, batch["resp_pos"]).float()


def sequence_scores(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Reward-model output (B, S) [or packed (1, N)] at each sequence's last token -> (B,) fp32."""
    from rlhf.algo.losses import sequence_rewards

    if "packed_last" in batch:
        return values[0][batch["packed_last"]].float()
    return sequence_rewards(values, batch["attention_mask"])


def response_logprobs(engine, batch: dict, hidden: torch.Tensor, temperature: float, entropy: bool = False):
    """log p(response token) at ``temperature`` from the final hidden states, through the fused vocab-parallel
    kernel (the [tokens, vocab] logits are never whole in memory). Returns (B, T) fp32 (and the entropy (B, T))."""
    import kernels

    mesh = engine.mesh
    weight = engine.model.output_weight()
    h = response_hidden(hidden, batch).to(weight.dtype)  # (B, T, H); bf16 models hand fp32 hidden states back
    b, t, hdim = h.shape
    out = kernels.fused_linear_logprobs(h.reshape(-1, hdim), weight,
                                        batch["response_ids"].reshape(-1), temperature=temperature,
                                        tp_group=mesh.tp_group if mesh.tp > 1 else None,
                                        return_entropy=entropy, vocab_size=engine.spec.vocab_size)
    if entropy:
        return out[0].view(b, t), out[1].view(b, t)
    return out.view(b, t)


def next_token_logprobs_from_hidden(engine, batch: dict, hidden: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t+1] | ...) from the final hidden states of a padded batch (B, S, H), through the fused
    vocab-parallel kernel. Returns (B, S-1) fp32."""
    import kernels

    mesh = engine.mesh
    weight = engine.model.output_weight()
    h = hidden[:, :-1].to(weight.dtype)  # (B, S-1, H)
    b, t, hdim = h.shape
    out = kernels.fused_linear_logprobs(h.reshape(-1, hdim), weight, batch["input_ids"][:, 1:].reshape(-1).long(),
                                        temperature=1.0, tp_group=mesh.tp_group if mesh.tp > 1 else None,
                                        vocab_size=engine.spec.vocab_size)
    return out.view(b, t)
