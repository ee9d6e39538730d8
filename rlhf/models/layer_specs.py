"""megatron's local (torch) layer specs, one per decoder layer, for every family: dense or MoE layers (DeepSeek's and
GLM's dense first layers), grouped-query or multi-latent attention (MLA), and norms that run under sequence
parallelism.

megatron-core 0.16.1's ``get_gpt_decoder_block_spec(config, use_transformer_engine=False)`` gives the per-layer
specs (``moe_layer_freq``, MLA through ``config.multi_latent_attention``) and the pipeline stage's slice; three of
its modules are swapped here:

* norms: megatron's ``WrappedTorchNorm`` asserts ``not config.sequence_parallel``. ``RMSNorm`` below is the same
  torch module, built by megatron's norm constructor, and marks its weight ``sequence_parallel`` when the model runs
  with sequence parallelism: each TP rank then normalises its own slice of the sequence, the weight's gradient is a
  partial sum, and megatron's ``finalize_model_grads`` sums it over TP
  (``_allreduce_non_tensor_model_parallel_grads``), as it does for TE's norms.
* MLA's down projections (``linear_q_down_proj``, ``linear_kv_down_proj``): megatron's duplicated ``Linear``
  (megatron.core.post_training.modelopt.layers: the whole weight on every TP rank, marked ``sequence_parallel``)
  instead of the local spec's ``ColumnParallelLinear``. With the column-parallel one, MLA all-gathers the
  projection over TP and hands the rotary key part on whole to every TP rank's heads, whose gradients then reach
  it without the sum over TP (its backward only splits): at TP 2 the kv down projection's gradient was 1.3e-2 off
  transformers'. With the duplicated one MLA takes the path TE's spec takes: the rotary key is gathered from the
  sequence-parallel slices, so its backward reduce-scatters (sums) the heads' gradients.
* core attention: ``PackedDotProductAttention`` (packed THD batches, context parallelism; ``rlhf.models.
  packed_attention``), and for MLA ``LatentCoreAttention``: megatron's ``MLASelfAttention`` builds its core attention
  with ``k_channels`` / ``v_channels``, which megatron's own ``DotProductAttention`` does not take (``TypeError: ...
  unexpected keyword argument 'k_channels'``), so megatron's local MLA spec does not build as shipped.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from rlhf.models.packed_attention import PackedDotProductAttention


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with megatron's norm constructor; its weight is marked ``sequence_parallel`` under
    sequence parallelism (see the module docstring). Numerically megatron's ``WrappedTorchNorm``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
            assert not getattr(config, flag, False), f"{flag} is not supported by the torch RMSNorm"
        super().__init__(hidden_size, eps=eps)
        if config.sequence_parallel:
            self.weight.sequence_parallel = True


class LatentCoreAttention(PackedDotProductAttention):
    """MLA's core attention: ``PackedDotProductAttention`` with keys of ``k_channels`` (qk_head_dim +
    qk_pos_emb_head_dim) and values of ``v_channels`` per head. The unpacked path is megatron's math (its
    ``bmm`` takes any value width); the packed and context-parallel kernels take one head width, so there q, k and v
    are zero-padded to the wider of the two (zero columns change no score: the scale is given) and the output cut
    back."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
                         cp_comm_type, pg_collection)
        self.k_channels, self.v_channels = k_channels, v_channels
        if v_channels is not None:  # megatron's Attention base builds a first one without them, then MLA its own
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels  # the output width

    def _packed_forward(self, q, k, v, attention_mask, attention_bias, params) -> torch.Tensor:
        return self._equal_widths(super()._packed_forward, q, k, v, attention_mask, attention_bias, params)

    def _cp_forward(self, q, k, v, attention_mask, attention_bias, packed_seq_params, layout) -> torch.Tensor:
        return self._equal_widths(super()._cp_forward, q, k, v, attention_mask, attention_bias, packed_seq_params,
                                  layout)

    def _equal_widths(self, fn, q, k, v, *rest) -> torch.Tensor:
        dk, dv = q.shape[-1], v.shape[-1]
        d = max(dk, dv)
        if dk < d:
            q, k = F.pad(q, (0, d - dk)), F.pad(k, (0, d - dk))
        if dv < d:
            v = F.pad(v, (0, d - dv))
        out = fn(q, k, v, *rest)  # (..., heads * d)
        if dv == d:
            return out
        heads = q.shape[-2]
        return out.unflatten(-1, (heads, d))[..., :dv].flatten(-2)


def _swap(spec, **changes):
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **changes))


def _norm_or_identity(module):
    from megatron.core.transformer.identity_op import IdentityOp

    return module if module is IdentityOp else RMSNorm


def _local_layer(layer_spec, mla: bool):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    attn = layer_spec.submodules.self_attention
    sub = attn.submodules
    assert sub.core_attention is DotProductAttention, sub.core_attention
    norms = {name: _norm_or_identity(getattr(sub, name)) for name in ("q_layernorm", "k_layernorm", "kv_layernorm")
             if hasattr(sub, name)}
    changes = dict(core_attention=LatentCoreAttention if mla else PackedDotProductAttention, **norms)
    if mla:
        from megatron.core.post_training.modelopt.layers import Linear

        changes.update(linear_q_down_proj=Linear, linear_kv_down_proj=Linear)
    attn = _swap(attn, **changes)
    return _swap(layer_spec, self_attention=attn, input_layernorm=RMSNorm,
                 pre_mlp_layernorm=_norm_or_identity(layer_spec.submodules.pre_mlp_layernorm))


def local_block_spec(config, pp_rank: int | None = None):
    """This pipeline stage's ``TransformerBlockSubmodules`` on megatron's local layers for ``config`` (a
    ``TransformerConfig``, or ``MLATransformerConfig`` for MLA): megatron's per-layer specs with the modules above."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", pp_rank=pp_rank)
    mla = bool(getattr(config, "multi_latent_attention", False))
    layers = [_local_layer(s, mla) for s in block.layer_specs]
    return dataclasses.replace(block, layer_specs=layers, layer_norm=RMSNorm)
