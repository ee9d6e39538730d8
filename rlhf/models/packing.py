"""Padding-free micro-batches for the megatron model: sequences packed into one ``[1, T]`` row (THD).

    batch = make_packed_batch(seqs)                      # or make_packed_batch(padded_ids, attention_mask)
    run_microbatches(model, [batch], loss_fn=...)        # the model sees input_ids (1, T), positions restart
    logits_per_seq = split_packed(batch, logits)         # [L_i, V_local] each

Next-token targets that never cross a sequence boundary: ``kernels.packed_next_tokens(batch["input_ids"][0],
batch["packed_seq_params"].cu_seqlens_q)``.

Pipeline parallelism (PP > 1): megatron's schedule sends activations of one fixed shape ``(T, 1, H)`` between
stages, so every micro-batch of a step must have the same T. Pass the same ``pad_to`` (at least the largest
micro-batch's token count, e.g. the ``--max_tokens_per_microbatch`` budget of
``kernels.balance_microbatches``) to every call: the stream is filled up to ``pad_to`` with dummy trailing
sequences of ``pad_token_id`` that attend only to themselves. Their outputs are garbage and carry no loss
(``num_tokens`` / ``split_packed`` exclude them). Without PP, ``pad_to`` is unnecessary.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

from rlhf.kernels import cu_seqlens_from_lengths, pack_padded, pack_sequences, position_ids_from_cu_seqlens

# Dummy padding is split into sequences of at most max(longest real sequence, this): attention over the
# padding costs O(pad * chunk) instead of O(pad^2), and max_seqlen (RoPE tables, kernel grids) stays small.
DUMMY_CHUNK = 128


def make_packed_batch(input_ids: Tensor | Sequence[Tensor], attention_mask: Tensor | None = None, *,
                      pad_to: int | None = None, pad_token_id: int = 0,
                      per_token: Mapping[str, Tensor | Sequence[Tensor]] | None = None) -> dict:
    """Pack sequences into one row for ``run_microbatches``.

    Args:
        input_ids: a list of B 1-D token tensors ``[L_i]``, or a padded ``[B, L]`` batch (right or left padded)
            with ``attention_mask`` ``[B, L]`` (1 on real tokens; None: every token is real).
        pad_to: fill the stream up to this many tokens (needed for PP > 1, see the module docstring).
        pad_token_id: token id of the dummy padding.
        per_token: extra per-token tensors laid out like ``input_ids`` (``[B, L]`` or a list of ``[L_i]``),
            e.g. ``loss_mask``; each is packed the same way and padded with zeros.

    Returns a dict with
        input_ids ``[1, T]`` int64, position_ids ``[1, T]`` int64 restarting at 0 per sequence,
        packed_seq_params: megatron ``PackedSeqParams(qkv_format="thd")`` over all T tokens (dummy padding
            included, as the attention needs),
        cu_seqlens ``[B + 1]`` int32 and num_tokens (int): the real sequences only, for mapping outputs back,
        unpack_mask ``[B, L]`` bool (padded input only): where each real token came from,
        and each ``per_token`` key as ``[1, T]``.
    There is deliberately no ``attention_mask`` key: the model must not get one with packed batches.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    per_token = dict(per_token or {})
    if "input_ids" in per_token:
        raise ValueError("per_token must not contain 'input_ids'")
    if isinstance(input_ids, Tensor):
        if input_ids.dim() != 2:
            raise ValueError(f"padded input_ids must be [B, L], got {tuple(input_ids.shape)}")
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        packed = pack_padded(input_ids, mask)
        fields = {k: pack_padded(v, mask).values for k, v in per_token.items()}
        extra = {"unpack_mask": mask}
    else:
        if attention_mask is not None:
            raise ValueError("attention_mask is only for a padded [B, L] input_ids")
        seqs = list(input_ids)
        if any(s.dim() != 1 for s in seqs):
            raise ValueError("each sequence must be a 1-D token tensor [L_i]")
        packed = pack_sequences(seqs)
        fields = {k: torch.cat(list(v)) for k, v in per_token.items()}
        extra = {}
    for k, v in fields.items():
        if v.shape[0] != packed.values.shape[0]:
            raise ValueError(f"per_token[{k!r}] has {v.shape[0]} tokens where input_ids has {packed.values.shape[0]}")

    ids, cu_real, max_len = packed.values.long(), packed.cu_seqlens, packed.max_seqlen
    n_real = ids.shape[0]
    lengths = (cu_real[1:] - cu_real[:-1]).tolist()
    if pad_to is not None:
        if pad_to < max(n_real, 1):
            raise ValueError(f"pad_to={pad_to} is smaller than the {n_real} tokens of this micro-batch")
        pad = pad_to - n_real
        if pad:
            chunk = max(max_len, min(pad, DUMMY_CHUNK))
            lengths += [chunk] * (pad // chunk) + ([pad % chunk] if pad % chunk else [])
            max_len = max(max_len, min(pad, chunk))
            ids = torch.cat([ids, ids.new_full((pad,), pad_token_id)])
            fields = {k: torch.cat([v, v.new_zeros((pad, *v.shape[1:]))]) for k, v in fields.items()}
    if ids.shape[0] == 0:
        raise ValueError("cannot pack a micro-batch with no tokens: pass pad_to or at least one token")
    cu = cu_real if len(lengths) == cu_real.numel() - 1 else cu_seqlens_from_lengths(lengths, device=ids.device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len,
                             max_seqlen_kv=max_len)
    return {"input_ids": ids.unsqueeze(0),  # (1, T)
            "position_ids": position_ids_from_cu_seqlens(cu, ids.shape[0]).unsqueeze(0),  # (1, T)
            "packed_seq_params": params, "cu_seqlens": cu_real, "num_tokens": n_real,
            **extra, **{k: v.unsqueeze(0) for k, v in fields.items()}}


def split_packed(batch: dict, output: Tensor) -> list[Tensor]:
    """A packed model output ``[1, T, *F]`` (or ``[T, *F]``) -> B tensors ``[L_i, *F]``, padding dropped."""
    total = batch["input_ids"].shape[1]
    values = output[0] if output.dim() >= 2 and tuple(output.shape[:2]) == (1, total) else output
    if values.shape[0] != total:
        raise ValueError(f"output {tuple(output.shape)} does not match the packed length T={total}")
    cu = batch["cu_seqlens"]
    return list(torch.split(values[: batch["num_tokens"]], (cu[1:] - cu[:-1]).tolist(), dim=0))


def packed_to_padded(batch: dict, output: Tensor, pad_value: float = 0) -> Tensor:
    """A packed model output ``[1, T, *F]`` -> ``[B, L, *F]`` in the layout of the padded input it came from."""
    mask = batch.get("unpack_mask")
    if mask is None:
        raise ValueError("packed_to_padded needs a batch made from a padded input (it has no unpack_mask)")
    values = output[0, : batch["num_tokens"]]
    out = values.new_full((*mask.shape, *values.shape[1:]), pad_value)
    out[mask] = values
    return out


def pack_padded_batch(batch: Mapping[str, Tensor], *, pad_to: int | None = None, pad_token_id: int = 0) -> dict:
    """A collated right- (or left-) padded micro-batch (``rlhf.data.collate``) -> one packed row.

    ``input_ids`` and ``attention_mask`` (B, S) become the packed layout of ``make_packed_batch``; every other
    (B, S) tensor (e.g. ``loss_mask``) is packed the same way (zeros on dummy padding); the rest (``margin``,
    ``prompt_lens``, ...) is passed through. ``pad_to``: see ``make_packed_batch``.
    """
    ids, mask = batch["input_ids"], batch["attention_mask"]
    per_token = {k: v for k, v in batch.items()
                 if k not in ("input_ids", "attention_mask") and isinstance(v, Tensor) and v.shape == ids.shape}
    rest = {k: v for k, v in batch.items() if k not in per_token and k not in ("input_ids", "attention_mask")}
    return {**rest, **make_packed_batch(ids, mask, pad_to=pad_to, pad_token_id=pad_token_id, per_token=per_token)}
