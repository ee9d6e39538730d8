"""Sequence parallelism on megatron's local layers (MoE models at TP > 1: ``rlhf.models.gpt.sequence_parallel``).

Between the layers' tensor-parallel regions each TP rank holds its own ``S / TP`` positions of the sequence
(megatron's layout: the embedding scatters, column-parallel linears all-gather their input, row-parallel linears
reduce-scatter their output; the norms' weights are summed over TP: ``rlhf.models.layer_specs.RMSNorm``). What this
module adds around megatron's model:

* the sequence must divide by TP: ``pad_inputs`` appends positions to every row (a packed row: a dummy sequence that
  attends only to itself). Attention is causal, so no real token sees them; they are routed and counted by the MoE
  router as the padding of a padded batch is. ``LlamaGPT`` cuts its outputs back to the real length, and the
  pipeline schedule's stage-to-stage shape is the padded ``S / TP`` (``padded_length``).
* the last stage's hidden states (the fused log-prob kernel's input) and a value head's input are gathered back to
  the whole sequence (``gather_sequence``). Every TP rank then computes the same thing from them, so their gradient
  is split, not summed: the fused kernel sums its vocab shards' parts itself.
* MoE routing replay and recording see each rank's own slice (``local_slice`` / ``gather_slices``).
"""
from __future__ import annotations

import dataclasses

import torch


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), \
        ps.get_tensor_model_parallel_group()


def padded_length(s: int, tp: int) -> int:
    return -(-s // tp) * tp


def pad_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor | None, packed_seq_params, tp: int):
    """input_ids (B, S) -> (B, S_pad) with S_pad a multiple of ``tp``; position ids continue (a packed row: restart
    at 0 in a dummy sequence added to ``packed_seq_params``). Returns (input_ids, position_ids, packed_seq_params)."""
    b, s = input_ids.shape
    pad = padded_length(s, tp) - s
    if pad == 0:
        return input_ids, position_ids, packed_seq_params
    input_ids = torch.cat([input_ids, input_ids.new_zeros(b, pad)], dim=1)
    if packed_seq_params is not None:
        cu = packed_seq_params.cu_seqlens_q
        cu = torch.cat([cu, cu.new_tensor([s + pad])])
        longest = max(int(packed_seq_params.max_seqlen_q or 0), pad)
        packed_seq_params = dataclasses.replace(packed_seq_params, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                max_seqlen_q=longest, max_seqlen_kv=longest)
        tail = torch.arange(pad, device=input_ids.device)
    else:
        tail = torch.arange(s, s + pad, device=input_ids.device)
    if position_ids is not None:
        position_ids = torch.cat([position_ids, tail.unsqueeze(0).expand(position_ids.shape[0], -1)], dim=1)
    return input_ids, position_ids, packed_seq_params


def gather_sequence(hidden: torch.Tensor) -> torch.Tensor:
    """(S / TP, B, H) -> (S, B, H) over the TP group; backward: this rank's slice of the (equal) gradients."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)


def local_slice(per_token: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This TP rank's positions of a per-token tensor (B, S, ...): padded to a multiple of TP with zeros, then cut
    in TP equal slices, as the decoder's hidden states are."""
    tp, rank, _ = _tp()
    s = per_token.shape[dim]
    pad = padded_length(s, tp) - s
    if pad:
        shape = list(per_token.shape)
        shape[dim] = pad
        per_token = torch.cat([per_token, per_token.new_zeros(shape)], dim=dim)
    return per_token.chunk(tp, dim=dim)[rank]


def gather_slices(local: torch.Tensor, s: int, dim: int = 1) -> torch.Tensor:
    """The inverse of ``local_slice``: every TP rank's slice, concatenated and cut to ``s`` positions. Collective."""
    tp, _, group = _tp()
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=dim).narrow(dim, 0, s)
