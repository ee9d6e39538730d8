"""Readers of a model's outputs at the positions a workflow needs: the response tokens' log-probs (actor,
reference), the critic's per-token values, a reward model's per-sequence score.

Shapes: B rows, S = padded prompt+response length, T = response width, H hidden size. A batch is either padded
(``input_ids`` (B, S), ``resp_pos`` (B, T): the position whose output predicts response token j,
``prompt_len - 1 + j``) or packed into one row of N tokens (``packed_resp_pos`` (B, T), ``packed_last`` (B,)
index that row; ``rlhf.ppo.experience.pack_microbatch``).

Under context parallelism (a reader marked ``rlhf.models.context_parallel.reads_local_tokens``) the model's output
holds this rank's tokens only: each reader computes what lies on this rank's tokens and sums the results over the CP
group (``cp_sum``: every position lies on one rank), so the head runs on 1/CP of the positions on each rank."""
from __future__ import annotations

import torch


def _positions(batch: dict, row_positions: torch.Tensor):
    """Where (row, column) the positions ``row_positions`` (B, ...) of each row lie in the model's output: the
    packed stream's one row, or the padded batch's rows."""
    if "packed_resp_pos" in batch or "packed_last" in batch:
        return torch.zeros_like(row_positions), row_positions
    rows = torch.arange(row_positions.shape[0], device=row_positions.device)
    return rows.view(-1, *([1] * (row_positions.dim() - 1))).expand_as(row_positions), row_positions


def _read_at(out: torch.Tensor, batch: dict, positions: torch.Tensor, fn):
    """``fn(out[rows, cols])`` at ``positions`` (B, ...), one entry each. Under CP only the entries on this rank's
    tokens are computed and the results are summed over the CP group (zeros where another rank holds a token)."""
    from rlhf.models.context_parallel import cp_sum, current_layout, local_index

    rows, cols = _positions(batch, positions)
    layout = current_layout()
    if layout is None:
        return fn(out[rows, cols], None)
    local = local_index(layout, cols)
    own = local >= 0
    res = fn(out[rows[own], local[own]], own)
    if not isinstance(res, tuple):
        return cp_sum(_place(res, own), layout)
    return tuple(cp_sum(_place(r, own), layout) for r in res)


def _place(values: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    full = values.new_zeros(own.shape)
    full[own] = values
    return full


def response_values(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Critic output (B, S) [or packed (1, N)] -> (B, T) fp32 at the positions before each response token."""
    pos = batch["packed_resp_pos"] if "packed_resp_pos" in batch else batch["resp_pos"]
    return _read_at(values.float(), batch, pos, lambda v, own: v)


def sequence_scores(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Reward-model output (B, S) [or packed (1, N)] at each sequence's last token -> (B,) fp32."""
    from rlhf.algo.losses import last_token_index

    pos = batch["packed_last"] if "packed_last" in batch else last_token_index(batch["attention_mask"])
    return _read_at(values.float(), batch, pos, lambda v, own: v)


def response_logprobs(engine, batch: dict, hidden: torch.Tensor, temperature: float, entropy: bool = False):
    """log p(response token) at ``temperature`` from the final hidden states, through the fused vocab-parallel
    kernel (the [tokens, vocab] logits are never whole in memory). Returns (B, T) fp32 (and the entropy (B, T))."""
    import rlhf.kernels as kernels

    mesh = engine.mesh
    weight = engine.model.output_weight()
    pos = batch["packed_resp_pos"] if "packed_resp_pos" in batch else batch["resp_pos"]
    shape = pos.shape

    def logprobs(h: torch.Tensor, own):  # h (M, H): the entries' hidden states (all B x T, or this rank's)
        targets = batch["response_ids"] if own is None else batch["response_ids"][own]
        out = kernels.fused_linear_logprobs(h.to(weight.dtype).reshape(-1, h.shape[-1]), weight,
                                            targets.reshape(-1), temperature=temperature,
                                            tp_group=mesh.tp_group if mesh.tp > 1 else None,
                                            return_entropy=entropy,
                                            vocab_size=getattr(engine, "score_vocab", None) or engine.spec.vocab_size)
        view = (lambda t: t.view(shape)) if own is None else (lambda t: t)
        return (view(out[0]), view(out[1])) if entropy else view(out)

    # bf16 models hand fp32 hidden states back: the kernel takes them in the weight's dtype
    return _read_at(hidden, batch, pos, logprobs)


def next_token_logprobs_from_hidden(engine, batch: dict, hidden: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t+1] | ...) from the final hidden states of a padded batch (B, S, H), through the fused
    vocab-parallel kernel. Returns (B, S-1) fp32."""
    import rlhf.kernels as kernels

    from rlhf.models.context_parallel import current_layout, gather_tokens, split_input

    mesh = engine.mesh
    weight = engine.model.output_weight()
    targets = torch.zeros_like(batch["input_ids"])  # (B, S): the last position's target is a dummy, dropped
    targets[:, :-1] = batch["input_ids"][:, 1:]
    layout = current_layout()
    if layout is not None:  # hidden (B, S_local, H): this rank's tokens
        targets = split_input(targets, layout, dim=1)
    b, t, hdim = hidden.shape
    out = kernels.fused_linear_logprobs(hidden.to(weight.dtype).reshape(-1, hdim), weight,
                                        targets.reshape(-1).long(), temperature=1.0,
                                        tp_group=mesh.tp_group if mesh.tp > 1 else None,
                                        vocab_size=engine.spec.vocab_size).view(b, t)
    if layout is not None:
        out = gather_tokens(out, layout)
    return out[:, :-1]
