"""Qwen3-Next (``qwen3_next``) and Qwen3.5's text models (``qwen3_5_text``, and ``qwen3_5_moe_text``, every layer
MoE): Gated DeltaNet layers and gated softmax attention in one stack, on megatron-core 0.16.1's own layers. Qwen3.5's
layers are Qwen3-Next's; its checkpoints keep the DeltaNet's input projections apart (``rlhf.models.hf_hybrid``) and
its rotary is multimodal (``text_rope``).

What each ``config.json`` field becomes (``hybrid_fields`` reads them; the rest are refused by name):

* ``layer_types`` (``linear_attention`` / ``full_attention``; older configs: ``full_attention_interval``) ->
  ``linear_attention_freq``, the per-layer pattern of megatron's ``GatedDeltaNet`` (``ssm/gated_delta_net.py``);
  ``linear_conv_kernel_dim``, ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_num_key_heads``,
  ``linear_num_value_heads`` -> the same-named ``TransformerConfig`` fields.
* the softmax layers: ``attention_output_gate`` (q_proj's second half per head, a sigmoid gate on the output),
  q/k norms (``qk_layernorm``), ``partial_rotary_factor`` -> ``rotary_percent``.
* every RMSNorm but the DeltaNet's gated output norm scales by ``1 + w`` (transformers' ``Qwen3NextRMSNorm``, its
  weights zero-initialised): ``ZeroCenteredRMSNorm``. The gated norm (``Qwen3NextRMSNormGated``) is a plain one.
* ``num_experts`` > 0: the layers that ``decoder_sparse_step`` and ``mlp_only_layers`` leave MoE (megatron's
  ``moe_layer_freq`` list) route with a softmax over the experts, top ``num_experts_per_tok``, renormalised with
  ``norm_topk_prob`` (``rlhf.models.gpt.moe_config``), experts of ``moe_intermediate_size``, and one shared expert of
  ``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))`` (``moe_shared_expert_gate``); the
  other layers, and every layer with ``num_experts`` 0, are dense MLPs of ``intermediate_size``.
  ``router_aux_loss_coef`` / ``output_router_logits`` are transformers' training switches (ours:
  ``--aux_loss_coef``).

megatron's hybrid block builder (``get_transformer_block_with_experimental_attention_variant_spec``) takes
Transformer Engine only; ``hybrid_block_spec`` builds the same per-layer pattern from the local specs of
``rlhf.models.layer_specs``. megatron's ``GatedDeltaNet.forward`` calls fla and causal-conv1d directly and raises on
packed sequences; ``GatedDeltaNetLayer`` keeps its parameters, TP split and checkpoint layout and runs the same math
through ``rlhf.kernels.gated_delta`` (fla on CUDA, the torch twin elsewhere), with ``cu_seqlens`` for packed
micro-batches: the recurrent state and the convolution restart at every sequence boundary.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from rlhf.models.layer_specs import RMSNorm


def _refuse(source: str, what: str) -> None:
    raise ValueError(f"{source}: unsupported config field {what}")


def _need(cfg: dict, key: str, source: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"{source}: missing required config field {key!r} for model_type={cfg['model_type']!r}")
    return cfg[key]


def text_rope(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """qwen3_5_text: its rotary is the multimodal one (``mrope_section``, interleaved), whose time, height and width
    positions are equal on text, so it turns each frequency by the token's position as plain RoPE does: the
    config without ``mrope_section`` / ``mrope_interleaved``."""
    block = cfg.get("rope_parameters")
    if not isinstance(block, dict) or not {"mrope_section", "mrope_interleaved"} & set(block):
        return cfg
    if block.get("mrope_interleaved", True) is not True:
        _refuse(source, "rope_parameters.mrope_interleaved=False (qwen3_5's text rotary is interleaved)")
    return {**cfg, "rope_parameters": {k: v for k, v in block.items()
                                       if k not in ("mrope_section", "mrope_interleaved")}}


def hybrid_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelSpec keyword arguments of a qwen3_next config's own fields (``partial_rotary_factor``: read by
    ``rlhf.models.spec_families``, as GLM's)."""
    layers = int(_need(cfg, "num_hidden_layers", source))
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
    elif cfg.get("full_attention_interval") is not None and types != [
            "full_attention" if (i + 1) % int(cfg["full_attention_interval"]) == 0 else "linear_attention"
            for i in range(layers)]:
        _refuse(source, f"full_attention_interval={cfg['full_attention_interval']} disagrees with layer_types")
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        _refuse(source, f"layer_types={types} (one of linear_attention / full_attention per layer)")
    la = {k: int(_need(cfg, f"linear_{k}", source)) for k in ("conv_kernel_dim", "key_head_dim", "value_head_dim",
                                                               "num_key_heads", "num_value_heads")}
    if la["num_value_heads"] % la["num_key_heads"]:
        _refuse(source, f"linear_num_value_heads={la['num_value_heads']} (a multiple of linear_num_key_heads="
                        f"{la['num_key_heads']})")
    if cfg.get("attention_bias"):
        _refuse(source, "attention_bias=True (qwen3_next's projections have no biases)")
    if cfg.get("sliding_window") or cfg.get("use_sliding_window"):
        _refuse(source, "sliding_window / use_sliding_window (qwen3_next attends to the whole sequence)")
    experts = int(cfg.get("num_experts") or 0)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    if cfg["model_type"] == "qwen3_5_moe_text":  # transformers makes every layer MoE, renormalises the top k
        for key, ok in (("mlp_only_layers", not mlp_only), ("decoder_sparse_step", step == 1),
                        ("norm_topk_prob", cfg.get("norm_topk_prob", True) is True), ("num_experts", experts > 0)):
            if not ok:
                _refuse(source, f"{key}={cfg.get(key)!r} (Qwen3.5-MoE's layers are all MoE, their top k "
                                "renormalised; transformers' Qwen3_5MoeForCausalLM reads no such field)")
    moe_layers = [i not in mlp_only and experts > 0 and (i + 1) % step == 0 for i in range(layers)]
    # in_proj_qkv, _z, _b, _a apart (hf_hybrid)
    la["split_in_proj"] = cfg["model_type"] in ("qwen3_5_text", "qwen3_5_moe_text")
    out = dict(linear_attention={**la, "layers": tuple(t == "linear_attention" for t in types)},
               attention_gate=True, zero_centered_norm=True, qk_norm=True, qkv_bias=False)
    if any(moe_layers):
        out.update(_moe(cfg, experts, source), moe_layers=tuple(moe_layers))
    return out


def _moe(cfg: dict[str, Any], experts: int, source: str) -> dict[str, Any]:
    """The MoE layers: softmax router over ``num_experts``, top ``num_experts_per_tok`` (renormalised with
    ``norm_topk_prob``), experts of ``moe_intermediate_size``, one shared expert of ``shared_expert_intermediate_size``
    gated by ``sigmoid(shared_expert_gate(x))`` (megatron's ``moe_shared_expert_gate``)."""
    topk = int(_need(cfg, "num_experts_per_tok", source))
    norm = bool(cfg.get("norm_topk_prob", True))
    if not 1 <= topk <= experts:
        _refuse(source, f"num_experts_per_tok={topk} (must be in [1, {experts}])")
    if topk == 1 and norm:
        _refuse(source, "num_experts_per_tok=1 with norm_topk_prob=True (megatron's router renormalises k >= 2 only)")
    shared = int(_need(cfg, "shared_expert_intermediate_size", source))
    if shared < 1:
        _refuse(source, f"shared_expert_intermediate_size={shared} (transformers always builds the shared expert)")
    ffn = int(_need(cfg, "moe_intermediate_size", source))
    return dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=ffn, moe_norm_topk=norm,
                shared_expert_size=shared, shared_expert_gate=True)


def hybrid_config(spec) -> dict:
    """The TransformerConfig fields of a hybrid stack."""
    la = spec.linear_attention
    out = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=[int(x) for x in la["layers"]],
               linear_conv_kernel_dim=la["conv_kernel_dim"], linear_key_head_dim=la["key_head_dim"],
               linear_value_head_dim=la["value_head_dim"], linear_num_key_heads=la["num_key_heads"],
               linear_num_value_heads=la["num_value_heads"], attention_output_gate=spec.attention_gate)
    if spec.moe_layers is not None:  # the router, top-k and experts: rlhf.models.gpt.moe_config
        out.update(moe_layer_freq=[int(x) for x in spec.moe_layers],
                   moe_shared_expert_intermediate_size=spec.shared_expert_size,
                   moe_shared_expert_gate=spec.shared_expert_gate, moe_shared_expert_overlap=False)
    return out


def check_hybrid_fit(spec, tp: int) -> None:
    """TP constraints of the DeltaNet layers (whole key heads per rank) and of the gated attention's groups."""
    la = spec.linear_attention
    if la["num_key_heads"] % tp:
        raise ValueError(f"--tp {tp} does not divide linear_num_key_heads={la['num_key_heads']}")
    if spec.num_kv_heads % tp:
        raise ValueError(f"--tp {tp} with num_key_value_heads={spec.num_kv_heads}: the gated attention's KV groups "
                         "are not replicated over TP here; use a TP that divides num_key_value_heads")
    if spec.moe_layers is not None:
        if spec.shared_expert_size % tp:
            raise ValueError(f"--tp {tp} does not divide shared_expert_intermediate_size={spec.shared_expert_size}")
        if not all(spec.moe_layers) and spec.intermediate_size % tp:
            raise ValueError(f"--tp {tp} does not divide intermediate_size={spec.intermediate_size} (the dense layers)")


def check_hybrid_layout(spec, *, pp: int, ep: int, cp: int, value_head: bool, use_te: bool) -> None:
    """Layouts a hybrid model does not run in yet, refused by name before any weight is read (PP and EP run: each
    stage builds its slice of the layer pattern, the experts are megatron's own MoE layer)."""
    if cp > 1:
        raise ValueError(f"--context_parallel_size {cp} with {spec.model_type}: the DeltaNet's recurrent state is not "
                         "passed between context-parallel ranks (megatron-core 0.16.1 has no GatedDeltaNet CP); use "
                         "--context_parallel_size 1")
    if value_head:
        raise ValueError(f"a value head on {spec.model_type} (a critic or reward model) is not supported; use a "
                         "group estimator (--advantage_estimator group_norm, rloo, reinforce_baseline)")
    if use_te:
        raise ValueError(f"{spec.model_type} runs megatron's local layers here (its TE layer names are not mapped "
                         "yet): use --transformer_impl local")


def check_hybrid_job(spec, *, lora: bool = False, what: str = "--pretrain") -> None:
    """Job features a hybrid model does not run with yet, refused by name before any model is built: LoRA (its
    targets miss the DeltaNet's projections). The generator is the megatron one (vLLM is refused by
    ``rlhf.models.spec_families.vllm_refusal``): after a prompt's prefill it feeds one token per forward, the
    DeltaNet's convolution window and recurrent state carried between decode steps (``rlhf.rollout.decode_cache``)."""
    if spec.linear_attention is None:
        return
    if lora:
        raise ValueError(f"{what} ({spec.model_type}) with --lora_rank: LoRA does not wrap the Gated DeltaNet's "
                         "projections yet; train every weight (drop --lora_rank)")


class ZeroCenteredRMSNorm(RMSNorm):
    """transformers' ``Qwen3NextRMSNorm``: ``x / rms(x) * (1 + w)`` in fp32, cast back; ``w`` starts at zero."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kw):
        super().__init__(config, hidden_size, eps, **kw)
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def _gdn_class():
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from rlhf.compat.megatron_ssm import gated_delta_net_without_fla

    gated_delta_net_without_fla()

    class GatedDeltaNetLayer(GatedDeltaNet):
        """megatron's ``GatedDeltaNet`` (its parameters, TP split and sharded state dict) with a forward that
        dispatches the delta rule and the convolution (``rlhf.kernels.gated_delta``) and takes packed sequences.
        hidden_states ``(S, B, H)`` (sequence parallel: ``S / TP``); returns ``(out, out_bias)`` as megatron's."""

        def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                    attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                    inference_params=None, **kwargs):
            from rlhf.kernels import gated_delta as gd

            cache = getattr(inference_context, "recurrent", None)  # rlhf.rollout.decode_cache.DecodeCache
            if (inference_context is not None and cache is None) or inference_params is not None:
                raise ValueError("Gated DeltaNet: megatron's inference contexts are not supported (the megatron "
                                 "generator's DecodeCache carries the recurrent state)")
            if cache is not None and packed_seq_params is not None:
                raise ValueError("Gated DeltaNet: a decode cache takes unpacked rows")
            prev = cache.get(self.layer_number) if cache is not None else None
            qkvzba, _ = self.in_proj(hidden_states)  # (S, B, D_local): sequence-parallel input gathered
            seq_len, batch = qkvzba.shape[:2]
            qkvzba = qkvzba.transpose(0, 1)  # (B, S, D_local)
            tp, nv = self.tp_size, self.num_value_heads
            qkv, gate, beta, alpha = torch.split(qkvzba, [(2 * self.qk_dim + self.v_dim) // tp, self.v_dim // tp,
                                                          nv // tp, nv // tp], dim=-1)
            cu = None
            if packed_seq_params is not None:
                if batch != 1:
                    raise ValueError(f"Gated DeltaNet: a packed micro-batch is one row, got {batch}")
                cu = packed_seq_params.cu_seqlens_q_padded
                cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            x = qkv.transpose(1, 2)  # (B, conv_dim_local, S)
            if cache is not None:  # the window of the last K - 1 inputs before these (zeros before a prompt)
                width = self.conv1d.weight.shape[-1]
                x = torch.cat([x.new_zeros(batch, x.shape[1], width - 1) if prev is None else prev[0], x], dim=-1)
                window = x[..., x.shape[-1] - (width - 1):]
            qkv = gd.causal_conv1d(x, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation="silu",
                                   cu_seqlens=cu)[..., x.shape[-1] - seq_len:].transpose(1, 2)  # (B, S, conv_local)
            query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
            query = gd.l2norm(query.reshape(batch, seq_len, -1, self.key_head_dim).float())
            key = gd.l2norm(key.reshape(batch, seq_len, -1, self.key_head_dim).float())
            value = value.reshape(batch, seq_len, -1, self.value_head_dim)
            if nv // self.num_key_heads > 1:
                query = query.repeat_interleave(nv // self.num_key_heads, dim=2)
                key = key.repeat_interleave(nv // self.num_key_heads, dim=2)
            g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)  # (B, S, H_local), fp32
            if cache is not None:  # from the state after the tokens before these; the state after them kept
                out, state = gd.gated_delta_rule_with_state(query, key, value, g, beta.sigmoid(),
                                                            None if prev is None else prev[1])
                cache[self.layer_number] = (window, state)
            else:
                out = gd.chunk_gated_delta_rule(query, key, value, g, beta.sigmoid(), cu_seqlens=cu)  # (B,S,H,Dv)
            dtype = value.dtype  # the model's (the rule ran in fp32 from the fp32 q and k)
            # transformers' gated norm (Qwen3NextRMSNormGated): the rule's output in the model's dtype, normed in
            # fp32, scaled in the model's dtype, then gated in fp32. Its weight is shared by this rank's heads only,
            # so its gradient sums over TP (megatron-core 0.16.1 sums only q/k_layernorm's and sequence-parallel ones)
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            weight = self.out_norm.weight  # (under sequence parallelism finalize_model_grads sums it)
            if tp > 1 and not getattr(weight, "sequence_parallel", False):
                weight = copy_to_tensor_model_parallel_region(weight)
            h = out.to(dtype).reshape(-1, self.value_head_dim).float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.out_norm.eps)
            y = weight * h.to(dtype)
            y = (y * F.silu(gate.reshape(-1, self.value_head_dim).float())).to(dtype)
            y = y.reshape(batch, seq_len, -1).transpose(0, 1).contiguous()  # (S, B, V_local)
            return self.out_proj(y)

    return GatedDeltaNetLayer


def _swap(spec, **changes):
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **changes))


def _zero_centered(module):
    return ZeroCenteredRMSNorm if module is RMSNorm else module


def hybrid_block_spec(config, spec):
    """This pipeline stage's local layers of a hybrid stack: megatron's per-layer specs of ``rlhf.models.layer_specs``
    (the stage's slice) with zero-centred norms, and a ``GatedDeltaNetLayer`` in place of the softmax attention where
    ``layer_types`` says ``linear_attention`` for the layer's global number (the stage's offset added)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from rlhf.models.layer_specs import local_block_spec

    block = local_block_spec(config)
    offset = get_transformer_layer_offset(config)
    gdn = ModuleSpec(module=_gdn_class(), submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=RMSNorm, out_proj=RowParallelLinear))
    layers = []
    for i, layer in enumerate(block.layer_specs):
        attn = layer.submodules.self_attention
        if spec.linear_attention["layers"][offset + i]:
            attn = gdn
        else:
            attn = _swap(attn, q_layernorm=_zero_centered(attn.submodules.q_layernorm),
                         k_layernorm=_zero_centered(attn.submodules.k_layernorm))
        layers.append(_swap(layer, self_attention=attn, input_layernorm=ZeroCenteredRMSNorm,
                            pre_mlp_layernorm=_zero_centered(layer.submodules.pre_mlp_layernorm)))
    return dataclasses.replace(block, layer_specs=layers, layer_norm=ZeroCenteredRMSNorm)


def layer_params(spec, layer: int) -> int:
    """Parameters of decoder layer ``layer``: a DeltaNet (in_proj, conv, dt_bias, A_log, gated norm, out_proj) or
    the gated attention (q of twice the width, k, v, o, q/k norms), the dense MLP, two norms."""
    h, la = spec.hidden_size, spec.linear_attention
    if la["layers"][layer]:
        qk, v, nv = la["key_head_dim"] * la["num_key_heads"], la["value_head_dim"] * la["num_value_heads"], \
            la["num_value_heads"]
        mixer = h * (2 * qk + 2 * v + 2 * nv) + (2 * qk + v) * la["conv_kernel_dim"] + 2 * nv + \
            la["value_head_dim"] + v * h
    else:
        q, kv = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        mixer = h * (2 * q + 2 * kv) + q * h + 2 * spec.head_dim
    if spec.moe_layers is not None and spec.moe_layers[layer]:
        mlp = spec.num_experts * (3 * h * spec.moe_ffn_hidden_size + h) + 3 * h * spec.shared_expert_size + h
    else:
        mlp = 3 * h * spec.intermediate_size
    return mixer + mlp + 2 * h


def layer_numels(spec, tp: int, ep: int, layer: int) -> list[int]:
    """Elements of each parameter of decoder layer ``layer`` one TP rank holds (the memory planner's
    ``stage_param_numels``): a DeltaNet's norm, dt_bias, A_log, in_proj, conv, gated norm and out_proj split by key
    heads, or the gated attention's q/gate/k/v rows, o_proj and q/k norms; then the MLP, dense or the router, this EP
    rank's experts and the shared expert with its gate."""
    h, la = spec.hidden_size, spec.linear_attention
    out = [h]  # input norm
    if la["layers"][layer]:
        qk, v, nv = la["key_head_dim"] * la["num_key_heads"], la["value_head_dim"] * la["num_value_heads"], \
            la["num_value_heads"]
        out += [nv // tp, nv // tp, (2 * qk + 2 * v + 2 * nv) // tp * h, (2 * qk + v) // tp * la["conv_kernel_dim"],
                la["value_head_dim"], v // tp * h]
    else:
        q, kv = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        out += [(2 * q + 2 * kv) // tp * h, q // tp * h, spec.head_dim, spec.head_dim]
    out.append(h)  # pre-MLP norm
    if spec.moe_layers is None or not spec.moe_layers[layer]:
        i = spec.intermediate_size // tp
        return out + [2 * i * h, i * h]
    f, s = spec.moe_ffn_hidden_size // tp, spec.shared_expert_size // tp
    return out + [spec.num_experts * h] + [2 * f * h, f * h] * (spec.num_experts // ep) + [2 * s * h, s * h, h]


CHUNK = 64
"""The delta rule's chunk length (fla's ``chunk_gated_delta_rule`` and the torch twin's)."""
DELTANET_KERNELS = ("fla", "torch")


def _deltanet_widths(spec, tp: int):
    la = spec.linear_attention
    hv, dk, dv = la["num_value_heads"] / tp, la["key_head_dim"], la["value_head_dim"]
    qk, v = la["num_key_heads"] / tp * dk, hv * dv
    return hv, dk, dv, qk, v, 2 * qk + 2 * v + 2 * hv, 2 * qk + v  # ..., in_proj's width, the convolution's


def deltanet_saved_bytes_per_token(spec, tp: int, e: int, kernel: str) -> float:
    """Bytes a Gated DeltaNet mixer (``GatedDeltaNetLayer``) saves for backward per token on one TP rank, ``e`` the
    model dtype's bytes (the memory planner adds the layer's norms and MLP).

    Both kernels: in_proj's output and the convolution's pre-activation (model dtype), the fp32 q and k the l2 norm
    keeps, the gated norm's fp32 input, normed copy, gate and gated product, its scaled output and out_proj's input
    (model dtype), the decay's and beta's per-head terms. The delta rule, per value head:
    ``fla`` (fla/ops/gated_delta_rule/chunk.py saves q, k, v, g, beta and A; the chunk states are recomputed in the
    backward): q and k cast to the model dtype, A (``CHUNK`` per token), beta, fp32 g, and the convolution's output
    (v is a view of it);
    ``torch`` (the twin, fp32): per token the chunk's decay, system, q.k and intra rows (``CHUNK`` each, and one copy
    batched matmul makes), about ten ``Dk``-wide and three ``Dv``-wide tensors (padded q, k, v, k beta, w, u, the
    decayed q and k, the new v, the matmuls' copies) and the chunk states (``Dk Dv / CHUNK``); measured per storage
    in tests/models/test_spec_hybrid.py."""
    if kernel not in DELTANET_KERNELS:
        raise ValueError(f"deltanet_kernel must be one of {DELTANET_KERNELS}, got {kernel!r}")
    hv, dk, dv, qk, v, proj, conv = _deltanet_widths(spec, tp)
    outside = e * (proj + conv) + 4 * 2 * qk + 4 * 4 * v + e * 2 * v + 4 * 6 * hv
    if kernel == "fla":
        return outside + e * conv + hv * (e * (2 * dk + CHUNK + 1) + 4)
    return outside + hv * 4 * (5 * CHUNK + 10 * dk + 3 * dv + dk * dv / CHUNK + 4)


def deltanet_working_bytes_per_token(spec, tp: int, e: int, kernel: str) -> float:
    """Bytes alive at the peak of a Gated DeltaNet mixer's forward without autograd, per token on one TP rank:
    in_proj's output and the convolution's (model dtype), then the delta rule: the twin's fp32 decay, system, intra
    and one product (``CHUNK`` each per value head) beside its ``Dk``- and ``Dv``-wide tensors; fla's A (fp32, then
    in the model dtype), w, u, the new v, the output and the chunk states (not measured here: no CUDA)."""
    hv, dk, dv, qk, v, proj, conv = _deltanet_widths(spec, tp)
    outside = e * (proj + conv)
    if kernel == "fla":
        return outside + hv * (4 * CHUNK + e * (CHUNK + 2 * dk + 3 * dv + dk * dv / CHUNK))
    return outside + hv * 4 * (4 * CHUNK + 6 * dk + 4 * dv)
