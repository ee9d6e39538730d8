"""The config fields of the families beyond the Llama layout: DeepSeek-V3 (``deepseek_v3``: also DeepSeek-R1 and
Kimi-K2), GLM-4.5/4.6/4.7 (``glm4_moe``) and GPT-OSS (``gpt_oss``). Every field of their ``config.json`` is used,
checked against the one value we implement, or refused by name; ``rlhf.models.spec.spec_from_hf_config`` calls
``family_fields`` and adds the fields common to every family.

What each field becomes (megatron-core 0.16.1 names, ``rlhf.models.families``):

deepseek_v3  q_lora_rank (None: a plain q projection), kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
             -> multi-latent attention; the q/kv LoRA norms -> its q/kv layernorms; rope_interleave=True (megatron's
             MLA RoPE is the interleaved layout); YaRN (mscale, mscale_all_dim) -> megatron's MLA YaRN;
             scoring_func=sigmoid, e_score_correction_bias, n_group/topk_group, routed_scaling_factor,
             norm_topk_prob -> the sigmoid router with expert bias and group-limited top-k; n_shared_experts ->
             shared experts; first_k_dense_replace -> dense first layers (moe_layer_freq);
             num_nextn_predict_layers (transformers: num_mtp_layers) -> read; the MTP layers' tensors are kept beside
             the checkpoint and written back on export (``rlhf.models.hf_families``), not trained.
glm4_moe     partial_rotary_factor -> rotary_percent; use_qk_norm -> q/k norms; attention_bias -> q/k/v biases (no
             o_proj bias); the router, shared experts, dense first layers and MTP layers as DeepSeek's.
gpt_oss      sinks -> softmax_type='learnable'; layer_types (sliding_attention / full_attention) and sliding_window
             -> per-layer windows; attention_bias, the router's and the experts' biases -> add_bias_linear; the
             experts' interleaved gate/up -> [gate; up]; swiglu_alpha, swiglu_limit -> the clamped SwiGLU with
             glu_linear_offset 1; YaRN (truncate) as for Llama; MXFP4 experts (quantization_config.quant_method=
             mxfp4) dequantized on load.
"""
from __future__ import annotations

from typing import Any

FAMILY_TYPES = ("deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")

# Read here; keys common to every family are in rlhf.models.spec._BENIGN_KEYS.
_ROUTER_KEYS = {"n_routed_experts", "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group",
                "first_k_dense_replace", "num_nextn_predict_layers", "num_mtp_layers"}
FAMILY_KEYS = {
    "deepseek_v3": _ROUTER_KEYS | {"kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                                   "qk_nope_head_dim", "qk_head_dim", "rope_interleave", "scoring_func",
                                   "topk_method", "moe_layer_freq", "aux_loss_alpha", "seq_aux", "ep_size",
                                   "auto_map"},
    "glm4_moe": _ROUTER_KEYS | {"partial_rotary_factor", "use_qk_norm"},
    "gpt_oss": {"swiglu_alpha", "swiglu_limit", "experts_per_token", "initial_context_length"},
    "qwen3_next": {"linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                   "linear_num_value_heads", "full_attention_interval", "partial_rotary_factor"},
}
FAMILY_KEYS["qwen3_5_text"] = FAMILY_KEYS["qwen3_5_moe_text"] = FAMILY_KEYS["qwen3_next"]
"""aux_loss_alpha / seq_aux: DeepSeek's load-balancing loss switches, as HF's router_aux_loss_coef (ours is
--aux_loss_coef); ep_size: DeepSeek's own inference code's expert parallelism (ours is --expert_model_parallel_size)"""

GPT_OSS_SWIGLU_ALPHA = 1.702
"""transformers' GptOssConfig default (the released config.json has no swiglu_alpha)"""


def _need(cfg: dict, key: str, source: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"{source}: missing required config field {key!r} for model_type={cfg['model_type']!r}")
    return cfg[key]


def _refuse(source: str, what: str) -> None:
    raise ValueError(f"{source}: unsupported config field {what}")


def family_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelSpec keyword arguments of a deepseek_v3 / glm4_moe / gpt_oss config (the family's own fields)."""
    model_type = cfg["model_type"]
    if cfg.get("quantization_config") and not (model_type == "gpt_oss" and _is_mxfp4(cfg)):
        q = cfg["quantization_config"]
        _refuse(source, f"quantization_config={q.get('quant_method', q) if isinstance(q, dict) else q!r}: "
                        "convert the checkpoint to bf16 first (DeepSeek's inference/fp8_cast_bf16.py for its FP8 "
                        "blocks) and drop quantization_config")
    if cfg.get("hidden_act", "silu") != "silu":
        _refuse(source, f"hidden_act={cfg['hidden_act']!r} (only 'silu')")
    if cfg.get("mlp_bias"):
        _refuse(source, "mlp_bias=True")
    if model_type == "gpt_oss":
        return _gpt_oss(cfg, source)
    if model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):  # rlhf.models.hybrid
        from rlhf.models.hybrid import hybrid_fields

        return {**hybrid_fields(cfg, source), "rotary_percent": _partial_rotary(cfg, source)}
    out = _sigmoid_moe(cfg, source)
    if model_type == "deepseek_v3":
        out.update(_deepseek_attention(cfg, source))
    else:
        out.update(qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=bool(cfg.get("use_qk_norm", False)),
                   rotary_percent=_partial_rotary(cfg, source))
    return out


def _sigmoid_moe(cfg: dict, source: str) -> dict:
    """DeepSeek-V3's and GLM-4.5's MoE: sigmoid scores, the expert-bias correction, group-limited top-k, the
    routed scaling factor, shared experts, dense first layers, MTP layers."""
    experts, topk = int(_need(cfg, "n_routed_experts", source)), int(_need(cfg, "num_experts_per_tok", source))
    ffn = int(_need(cfg, "moe_intermediate_size", source))
    if not 1 <= topk <= experts:
        _refuse(source, f"num_experts_per_tok={topk} (must be in [1, {experts}])")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        _refuse(source, f"scoring_func={cfg['scoring_func']!r} (only 'sigmoid')")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        _refuse(source, f"topk_method={cfg['topk_method']!r} (only 'noaux_tc': group-limited top-k of the "
                        "bias-corrected sigmoid scores)")
    if cfg.get("moe_layer_freq", 1) != 1:
        _refuse(source, f"moe_layer_freq={cfg['moe_layer_freq']} (only 1: every layer after the dense ones)")
    norm = bool(cfg.get("norm_topk_prob", True))
    if norm != (topk > 1):  # megatron's sigmoid router renormalises the top-k weights exactly when k > 1
        _refuse(source, f"norm_topk_prob={norm} with num_experts_per_tok={topk} (megatron's sigmoid router "
                        "renormalises exactly when k > 1)")
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if groups > 1:
        if experts % groups or not 1 <= group_topk <= groups:
            _refuse(source, f"n_group={groups} / topk_group={group_topk} for {experts} experts")
        if topk % group_topk or topk // group_topk != 2:
            # HF scores a group by its top-2 experts, megatron by its top-(k / topk_group)
            _refuse(source, f"n_group={groups} with num_experts_per_tok={topk} / topk_group={group_topk} != 2 "
                            "(megatron scores a group by its top k / topk_group experts, transformers by its top 2)")
    dense = int(cfg.get("first_k_dense_replace") or 0)
    layers = int(_need(cfg, "num_hidden_layers", source))
    if not 0 <= dense < layers:
        _refuse(source, f"first_k_dense_replace={dense} (must leave at least one MoE layer of {layers})")
    mtp = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0
    return dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=ffn, moe_norm_topk=norm,
                router={"score": "sigmoid", "expert_bias": True, "num_groups": groups if groups > 1 else None,
                        "group_topk": group_topk if groups > 1 else None,
                        "scaling": float(cfg.get("routed_scaling_factor", 1.0) or 1.0), "bias": False},
                shared_expert_size=int(cfg.get("n_shared_experts") or 0) * ffn, dense_layers=dense,
                mtp_layers=int(mtp))


def _deepseek_attention(cfg: dict, source: str) -> dict:
    if cfg.get("rope_interleave", True) is not True:
        _refuse(source, "rope_interleave=False (megatron's MLA applies RoPE to interleaved pairs, as DeepSeek's "
                        "released checkpoints store them)")
    if cfg.get("attention_bias"):
        _refuse(source, "attention_bias=True (megatron's MLA projections have no biases)")
    nope, rope_dim = int(_need(cfg, "qk_nope_head_dim", source)), int(_need(cfg, "qk_rope_head_dim", source))
    if cfg.get("qk_head_dim") not in (None, nope + rope_dim):
        _refuse(source, f"qk_head_dim={cfg['qk_head_dim']} (must be qk_nope_head_dim + qk_rope_head_dim = "
                        f"{nope + rope_dim})")
    if cfg.get("head_dim") not in (None, rope_dim):  # transformers writes head_dim = qk_rope_head_dim
        _refuse(source, f"head_dim={cfg['head_dim']} (transformers sets it to qk_rope_head_dim={rope_dim})")
    heads = int(_need(cfg, "num_attention_heads", source))
    if int(cfg.get("num_key_value_heads") or heads) != heads:
        _refuse(source, f"num_key_value_heads={cfg['num_key_value_heads']} (MLA has one latent per token: "
                        f"transformers expands it to num_attention_heads={heads})")
    q_lora = cfg.get("q_lora_rank")
    mla = {"q_lora_rank": None if q_lora is None else int(q_lora),
           "kv_lora_rank": int(_need(cfg, "kv_lora_rank", source)), "qk_nope_head_dim": nope,
           "qk_rope_head_dim": rope_dim, "v_head_dim": int(_need(cfg, "v_head_dim", source))}
    return dict(mla=mla, head_dim=nope + rope_dim, qk_norm=True, qkv_bias=False)  # qk_norm: the q/kv LoRA norms


def _partial_rotary(cfg: dict, source: str) -> float:
    values = {float(b["partial_rotary_factor"]) for b in (cfg, cfg.get("rope_parameters") or {},
                                                          cfg.get("rope_scaling") or {})
              if isinstance(b, dict) and b.get("partial_rotary_factor") is not None}
    if len(values) > 1:
        _refuse(source, f"partial_rotary_factor: disagreeing values {sorted(values)}")
    factor = values.pop() if values else 1.0
    if not 0 < factor <= 1:
        _refuse(source, f"partial_rotary_factor={factor}")
    return factor


def _is_mxfp4(cfg: dict) -> bool:
    q = cfg.get("quantization_config") or {}
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def _gpt_oss(cfg: dict, source: str) -> dict:
    experts = int(_need(cfg, "num_local_experts", source))
    topk = int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 0)
    if cfg.get("experts_per_token") not in (None, topk) or not 1 <= topk <= experts:
        _refuse(source, f"num_experts_per_tok={cfg.get('num_experts_per_tok')} / experts_per_token="
                        f"{cfg.get('experts_per_token')}")
    if cfg.get("attention_bias", True) is not True:
        _refuse(source, "attention_bias=False (gpt_oss's projections have biases)")
    layers = int(_need(cfg, "num_hidden_layers", source))
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        _refuse(source, f"layer_types={types} (one of sliding_attention / full_attention per layer)")
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and not window:
        _refuse(source, "sliding_window (required by the sliding_attention layers)")
    rope_block = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    initial = cfg.get("initial_context_length")
    if initial is not None and rope_block.get("original_max_position_embeddings") not in (None, initial):
        _refuse(source, f"initial_context_length={initial} differs from the rope's original_max_position_embeddings="
                        f"{rope_block.get('original_max_position_embeddings')}")
    alpha, limit = float(cfg.get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)), float(_need(cfg, "swiglu_limit", source))
    return dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=int(_need(cfg, "intermediate_size", source)),
                moe_norm_topk=True, qkv_bias=True, linear_bias=True, attention_sinks=True,
                router={"score": "softmax", "expert_bias": False, "num_groups": None, "group_topk": None,
                        "scaling": 1.0, "bias": True},
                window_layers=tuple(t == "sliding_attention" for t in types),
                sliding_window=int(window) if window else None, swiglu=(alpha, limit), mxfp4=_is_mxfp4(cfg))


def layer_params(spec, layer: int) -> int:
    """Parameters of decoder layer ``layer`` (0-based) of a family spec: attention (MLA's projections and LoRA
    norms, or q/k/v/o with their biases, q/k norms and sinks), the dense MLP of a first layer or the MoE (experts
    with their biases, router, shared experts), and the two norms."""
    if spec.linear_attention is not None:
        from rlhf.models.hybrid import layer_params as hybrid_layer_params

        return hybrid_layer_params(spec, layer)
    h, heads, bias = spec.hidden_size, spec.num_attention_heads, spec.linear_bias
    if spec.mla is not None:
        m = spec.mla
        qh, ql, kvl = m["qk_nope_head_dim"] + m["qk_rope_head_dim"], m["q_lora_rank"], m["kv_lora_rank"]
        attn = (h * ql + ql + ql * heads * qh) if ql else h * heads * qh
        attn += h * (kvl + m["qk_rope_head_dim"]) + kvl + kvl * heads * (m["qk_nope_head_dim"] + m["v_head_dim"])
        attn += heads * m["v_head_dim"] * h
    else:
        q, kv = heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if spec.qkv_bias else 0) + (h if bias else 0)
        attn += (2 * spec.head_dim if spec.qk_norm else 0) + (heads if spec.attention_sinks else 0)
    if layer < spec.dense_layers:
        mlp = 3 * h * spec.intermediate_size
    else:
        f = spec.moe_ffn_hidden_size
        mlp = spec.num_experts * (3 * h * f + (2 * f + h if bias else 0)) + spec.num_experts * (h + (1 if bias else 0))
        mlp += 3 * h * spec.shared_expert_size + (spec.num_experts if spec.router["expert_bias"] else 0)
    return attn + mlp + 2 * h


def expert_tensor_parallel(specs, tp: int) -> int:
    """megatron's expert-TP for a job of these models (None entries skipped) at ``--tp``: TP, or 1 where a model's
    experts carry biases (gpt_oss: megatron-core 0.16.1 takes them at expert-TP 1 only, 'Bias in Moe is only
    supported when ETP==1'); each TP rank then holds its experts whole and runs them on its own tokens (sequence
    parallel), megatron reducing their gradients over the expert-data-parallel group, which spans TP."""
    return 1 if any(s is not None and s.linear_bias and s.num_experts for s in specs) else tp


def check_family_fit(spec, tp: int) -> None:
    """TP constraints of the family layers beyond ``rlhf.models.spec.check_parallel_fit``'s."""
    if spec.shared_expert_size % tp:
        raise ValueError(f"--tp {tp} does not divide the shared experts' size {spec.shared_expert_size}")
    if spec.dense_layers and spec.intermediate_size % tp:
        raise ValueError(f"--tp {tp} does not divide intermediate_size={spec.intermediate_size} (the dense layers)")


def vllm_refusal(spec, tp: int, dtype: str, on_cuda: bool) -> str | None:
    """Why vLLM 0.32 cannot be this family's generator here (None: it can), measured on its CPU build:

    * gpt_oss: ``reload_weights`` does not refresh its experts and sinks. Its loader (``_load_weights_other`` in
      vllm/model_executor/models/gpt_oss.py) copies them with ``param.copy_`` past the weight loaders the layerwise
      reload counts, which then logs "GptOssRoutedExperts: Failed to load weights" and puts the old tensors back: the
      generator keeps its first weights (measured: log-probs 0.28 off the trainer's after one update). Besides, its
      MoE activation takes alpha 1.702 and limit 7.0 whatever the config says (``SWIGLUOAI`` in
      vllm/model_executor/layers/fused_moe/activation.py), and it splits the KV heads over its TP ranks without
      replicating them.
    * deepseek_v3 on CPU: its MLA backend takes bf16 weights only ("expect weight to be bfloat16, float16, int8,
      fp8_e4m3 or uint8").
    * qwen3_vl without torchvision: vLLM's processor for it builds transformers' ``Qwen2VLVideoProcessor``, which
      imports torchvision (the CPU torch here has none: "requires the Torchvision library")."""
    if spec.model_type == "qwen3_vl":
        import importlib.util

        if importlib.util.find_spec("torchvision") is None:
            return ("qwen3_vl: vLLM's Qwen3-VL processor needs torchvision (its video processor), which is not "
                    "installed: use --rollout_backend megatron")
    if spec.linear_attention is not None:
        return (f"{spec.model_type}: vLLM is not wired as its generator here (the Gated DeltaNet's weights are not "
                "mapped for its weight sync): use --rollout_backend megatron")
    if spec.model_type == "gpt_oss":
        return ("vLLM 0.32 does not refresh gpt_oss's experts and sinks on a weight sync (its reload logs "
                "'GptOssRoutedExperts: Failed to load weights' and keeps the old ones): use --rollout_backend megatron")
    if spec.mla is not None and not on_cuda and dtype != "bfloat16":
        return (f"vLLM's CPU multi-latent attention takes bf16 weights only ({spec.model_type} at {dtype}): use "
                "--bf16 or --rollout_backend megatron")
    return None


def layer_numels(spec, tp: int, ep: int, layer: int) -> list[int]:
    """Elements of each parameter of decoder layer ``layer`` (0-based) one TP rank holds, in megatron's module order
    (the memory planner's ``stage_param_numels``): MLA's replicated down projections and LoRA norms, its up
    projections split over TP by heads; or q/k/v/o with biases, q/k norms and sinks; a dense MLP, or the router (its
    bias), this EP rank's ``num_experts / ep`` experts (their biases; expert-TP sharded) and the shared experts,
    TP-sharded."""
    h, heads, bias = spec.hidden_size, spec.num_attention_heads // tp, spec.linear_bias
    out = [h]  # input norm
    if spec.mla is not None:
        m = spec.mla
        qh, ql, kvl = m["qk_nope_head_dim"] + m["qk_rope_head_dim"], m["q_lora_rank"], m["kv_lora_rank"]
        out += [h * ql, ql, ql * heads * qh] if ql else [h * heads * qh]
        out += [h * (kvl + m["qk_rope_head_dim"]), kvl, kvl * heads * (m["qk_nope_head_dim"] + m["v_head_dim"])]
        out += [heads * m["v_head_dim"] * h]
    else:
        d = spec.head_dim
        qkv = (spec.num_attention_heads + 2 * spec.num_kv_heads) * d // tp
        out += [qkv * h] + ([qkv] if spec.qkv_bias else []) + [heads * d * h] + ([h] if bias else [])
        out += ([d, d] if spec.qk_norm else []) + ([heads] if spec.attention_sinks else [])
    out.append(h)  # pre-MLP norm
    if layer < spec.dense_layers:
        i = spec.intermediate_size // tp
        return out + [2 * i * h, i * h]
    f = spec.moe_ffn_hidden_size // expert_tensor_parallel([spec], tp)  # biased experts: whole on each TP rank
    out += [spec.num_experts * h] + ([spec.num_experts] if bias else [])
    out += ([2 * f * h, 2 * f, f * h, h] if bias else [2 * f * h, f * h]) * (spec.num_experts // ep)
    if spec.shared_expert_size:
        s = spec.shared_expert_size // tp
        out += [2 * s * h, s * h]
    return out


def attention_widths(spec, tp: int) -> tuple[float, float]:
    """(q, kv) widths per token on one TP rank for the planner's activation estimates: MLA's q heads are
    nope + rope wide, its expanded keys and values (nope + rope + v) / 2 on average."""
    m = spec.mla
    qh = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
    heads = spec.num_attention_heads / tp
    return heads * qh, heads * (qh + m["v_head_dim"]) / 2
