"""Padding-free packed sequences (THD) in megatron's local (torch) layer spec.

megatron-core runs ``PackedSeqParams(qkv_format="thd")`` only through transformer-engine's attention; its own
``DotProductAttention`` asserts ``packed_seq_params is None``. ``PackedDotProductAttention`` takes its place in
the local spec: with ``packed_seq_params`` it calls ``kernels.varlen_attention`` (torch on CPU, Triton /
flash-attn / TE on CUDA), otherwise it runs megatron's own math unchanged (the unpacked path is bit-identical).

Shapes in the THD path, as ``Attention.forward`` hands them over: q ``[T, Hq/tp, D]``, k/v ``[T, Hkv/tp, D]``
(megatron squeezes the dummy batch dim; ``[T, 1, H, D]`` is accepted too); the result is ``[T, Hq/tp * D]``.
TP needs nothing special: each rank holds whole heads (and whole KV groups) of its partition.

RoPE: megatron applies it before core attention. Its unfused THD path (``_apply_rotary_pos_emb_thd``) splits
the stream at ``cu_seqlens`` and gives every sequence the frequencies of positions ``0..L_i-1``, so positions
restart per sequence, as wanted. One trap: when ``max_seqlen_q`` equals the whole pack length T it instead
reads the frequencies as per-token *absolute* positions. That is only right if one sequence fills the pack, so
an over-estimated ``max_seqlen_q == T`` is rejected here (``rlhf.models.packing.make_packed_batch`` always
sets the exact maximum).

Not supported when packed (a ValueError says so): sliding windows shorter than the longest packed sequence
(mistral), attention dropout while training, off-by-one / learnable softmax, attention bias or masks.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

import rlhf.kernels as kernels

log = logging.getLogger(__name__)
_LOGGED: set[str] = set()


def _log_once(path: str, msg: str) -> None:
    if path not in _LOGGED:
        _LOGGED.add(path)
        log.info("core attention: %s", msg)


class PackedDotProductAttention(DotProductAttention):
    """megatron's ``DotProductAttention`` (same constructor) plus a varlen path for THD packed sequences."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        from rlhf.models.context_parallel import current_layout

        layout = current_layout()
        if layout is not None:
            _log_once("cp", f"context parallelism over {layout.cp} ranks -> rlhf.models.context_parallel.cp_attention")
            return self._cp_forward(query, key, value, attention_mask, attention_bias, packed_seq_params, layout)
        if packed_seq_params is None:
            _log_once("unpacked", "unpacked batches -> megatron DotProductAttention (torch)")
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        _log_once("packed", "packed (THD) batches -> kernels.varlen_attention")
        return self._packed_forward(query, key, value, attention_mask, attention_bias, packed_seq_params)

    def _packed_forward(self, q, k, v, attention_mask, attention_bias, params) -> torch.Tensor:
        if params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format={params.qkv_format!r}: only 'thd' is supported")
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("packed (THD) batches take no attention_mask/attention_bias: sequence boundaries "
                             "come from packed_seq_params.cu_seqlens_q")
        if q.dim() == 4:  # [T, 1, H, D]
            if q.shape[1] != 1:
                raise ValueError(f"THD query must be [T, 1, H, D] or [T, H, D], got {tuple(q.shape)}")
            q, k, v = q.squeeze(1), k.squeeze(1), v.squeeze(1)
        cu = _self_attention_cu_seqlens(params)
        total = q.shape[0]
        max_seqlen = params.max_seqlen_q
        if max_seqlen is None:
            max_seqlen = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        self._check_packed_supported(int(max_seqlen), total, cu)
        out = kernels.varlen_attention(q, k, v, cu, int(max_seqlen), softmax_scale=self._scale())  # (T, Hq, D)
        return out.reshape(total, -1)  # (T, Hq * D), as TE returns it; Attention reshapes to (T, 1, Hq * D)

    def _scale(self) -> float:
        scale = self.softmax_scale
        if self.config.apply_query_key_layer_scaling:  # megatron divides the scale by it, then its softmax
            scale *= self.layer_number                   # multiplies it back: the net scale is unchanged
        return scale

    def _cp_forward(self, q, k, v, attention_mask, attention_bias, packed_seq_params, layout) -> torch.Tensor:
        from rlhf.models.context_parallel import cp_attention

        if packed_seq_params is not None or attention_mask is not None or attention_bias is not None:
            raise ValueError("context parallelism: the decoder runs the local tokens as a plain batch; "
                             "packed_seq_params, attention masks and biases are not taken here")
        if self.training and self.attention_dropout.p > 0:
            raise ValueError(f"attention_dropout={self.attention_dropout.p} is not supported with context "
                             "parallelism while training")
        if self.softmax_offset is not None:
            raise ValueError(f"softmax_type={self.config.softmax_type!r} is not supported with context parallelism")
        window = self.scale_mask_softmax.window_size
        return cp_attention(q, k, v, layout, self._scale(), window[0] if window is not None else None)

    def _check_packed_supported(self, max_seqlen: int, total: int, cu: torch.Tensor) -> None:
        window = self.scale_mask_softmax.window_size
        if window is not None and max_seqlen - 1 > window[0]:
            raise ValueError(f"sliding_window={window[0] + 1} is not supported with packed sequences (longest "
                             f"packed sequence {max_seqlen}): use padded batches for this model")
        if self.training and self.attention_dropout.p > 0:
            raise ValueError(f"attention_dropout={self.attention_dropout.p} is not supported with packed "
                             "sequences while training")
        if self.softmax_offset is not None:
            raise ValueError(f"softmax_type={self.config.softmax_type!r} is not supported with packed sequences")
        if max_seqlen == total and cu.numel() > 2:
            lengths = cu[1:] - cu[:-1]
            if int(lengths.max()) != max_seqlen:
                raise ValueError(f"packed_seq_params.max_seqlen_q={max_seqlen} equals the pack length but the "
                                 f"longest sequence has {int(lengths.max())} tokens; megatron's THD RoPE would "
                                 "then use absolute positions. Pass the exact maximum (make_packed_batch does)")


def _self_attention_cu_seqlens(params) -> torch.Tensor:
    cu = params.cu_seqlens_q
    if cu is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is required for packed (THD) batches")
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        other = getattr(params, name)
        if other is not None and other is not cu and not torch.equal(other, cu):
            raise ValueError(f"packed_seq_params.{name} differs from cu_seqlens_q: only self-attention over "
                             "unpadded packed sequences is supported")
    return cu


def local_spec_with_packed_attention(qk_layernorm: bool = False, num_experts: int = 0):
    """megatron's local GPT layer spec (RMSNorm; with ``qk_layernorm`` an RMSNorm on every query and key head;
    with ``num_experts`` megatron's MoE layer with its SequentialMLP experts) with ``PackedDotProductAttention``
    as core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm,
                                    num_experts=num_experts or None, moe_grouped_gemm=False)
    attn = spec.submodules.self_attention
    assert attn.submodules.core_attention is DotProductAttention, attn.submodules.core_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules,
                                                                    core_attention=PackedDotProductAttention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))
