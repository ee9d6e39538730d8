"""Architecture description read from a Hugging Face ``config.json``, checked before any weight is touched.

``ModelSpec`` is the one place that knows which HF fields we honour. A field that would change the math and that
we do not implement (a rope type other than those of ``rlhf.models.rope``, a non-SiLU activation, MLP
biases, ...) raises ``ValueError`` naming it, and so does any key we have never heard of: nothing is silently
dropped.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from rlhf.models.reward_config import head_prefix, is_openrlhf_config

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "qwen2_5_vl", "deepseek_v3",
                         "glm4_moe", "gpt_oss", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5",
                         "qwen3_5_moe", "qwen3_vl")
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")
"""MoE families whose fields ``_moe_fields`` reads; deepseek_v3, glm4_moe and gpt_oss: rlhf.models.spec_families"""
CAUSAL_LM_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                   "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                   "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                   "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                   "gpt_oss": "GptOssForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                   "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                   "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                   "qwen3_vl": "Qwen3VLForConditionalGeneration"}
SEQ_CLS_ARCHS = {"llama": "LlamaForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification",
                 "qwen3": "Qwen3ForSequenceClassification", "mistral": "MistralForSequenceClassification",
                 "mixtral": "MixtralForSequenceClassification", "qwen3_moe": "Qwen3MoeForSequenceClassification"}

# Keys that carry no math for us (generation defaults, bookkeeping, generic PretrainedConfig attributes).
_BENIGN_KEYS = {
    "_name_or_path", "_model_name_or_path", "unk_token_id", "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "use_cache",
    "initializer_range", "id2label", "label2id", "num_labels", "problem_type", "output_attentions",
    "output_hidden_states", "return_dict", "is_encoder_decoder", "is_decoder", "chunk_size_feed_forward",
    "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "cross_attention_hidden_size",
    "add_cross_attention", "tie_encoder_decoder", "torchscript", "pruned_heads", "tf_legacy_loss",
    "use_bfloat16", "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "temperature",
    "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "num_beam_groups",
    "diversity_penalty", "quantization_config", "max_window_layers", "layer_types", "use_sliding_window",
    "sliding_window", "pretraining_tp", "mlp_bias", "attention_bias", "attention_dropout", "hidden_act",
    "rope_scaling", "rope_parameters", "rope_theta", "original_max_position_embeddings", "head_dim",
    "tie_word_embeddings", "rms_norm_eps",
    "max_position_embeddings", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "embedding_multiplier", "_attn_implementation_autoset",
    # MoE (mixtral, qwen3_moe; checked by _moe_fields). router_aux_loss_coef / output_router_logits are HF's
    # training switches: our load-balancing loss is --aux_loss_coef.
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "router_aux_loss_coef", "output_router_logits", "router_jitter_noise", "decoder_sparse_step", "mlp_only_layers",
    "shared_expert_intermediate_size",
    "rlhf",  # our own block: reward normalisation statistics etc.
    "normalize_reward", "mean", "std", "value_head_prefix",  # OpenRLHF's reward/critic models (reward_config.py)
}


@dataclass(frozen=True)
class ModelSpec:
    """The dimensions and options of a Llama-family decoder."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None = None
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on each query and key head (megatron's qk_layernorm)
    rope_scaling: dict | None = None  # rlhf.models.rope: rope_type and its filled-in parameters; None = plain
    num_experts: int = 0  # MoE (mixtral, qwen3_moe): experts per layer; 0 = a dense MLP
    moe_topk: int = 0  # experts per token
    moe_ffn_hidden_size: int = 0  # each expert's intermediate size
    moe_norm_topk: bool = True  # renormalise the top-k routing weights (mixtral always; qwen3_moe: norm_topk_prob)
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    pad_token_id: int | None = None
    is_seq_cls: bool = False
    torch_dtype: str = "float32"
    mrope_section: tuple | None = None
    """vision-language models (``rlhf.models.vlm``): the rotary dimensions' split into time, height, width"""
    vision: dict | None = None
    """vision-language models: ``vision_config`` (transformers' fields) and the image/video/vision-start/end token
    ids; None for a text model"""
    # The families of rlhf.models.spec_families; the defaults are the Llama layout.
    mla: dict | None = None
    """deepseek_v3's multi-latent attention: q_lora_rank (None: a plain q projection), kv_lora_rank,
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim (``head_dim`` is then the q/k head width, nope + rope)"""
    router: dict | None = None
    """an MoE router beyond mixtral's: score (``softmax`` | ``sigmoid``), expert_bias (DeepSeek's
    e_score_correction_bias), num_groups / group_topk (group-limited top-k; None: off), scaling
    (routed_scaling_factor), bias (gpt_oss: the router's linear has a bias); None: mixtral's softmax router"""
    shared_expert_size: int = 0  # n_shared_experts * moe_intermediate_size; 0: no shared experts
    dense_layers: int = 0  # first_k_dense_replace: the first N layers have a dense MLP of intermediate_size
    rotary_percent: float = 1.0  # glm4_moe's partial_rotary_factor: RoPE on the first part of each head
    attention_sinks: bool = False  # gpt_oss: a learned logit per head in every softmax's denominator
    window_layers: tuple | None = None  # gpt_oss: per layer, True where it attends within ``sliding_window``
    linear_bias: bool = False  # gpt_oss: every linear (q, k, v, o, router, experts) has a bias
    swiglu: tuple | None = None  # gpt_oss: (alpha, limit) of its clamped SwiGLU, (up + 1) * g * sigmoid(alpha g)
    mtp_layers: int = 0  # num_nextn_predict_layers: read; their tensors are kept through a round trip, untrained
    mxfp4: bool = False  # gpt_oss: the HF folder stores the experts as MXFP4 blocks and scales
    linear_attention: dict | None = None
    """qwen3_next's Gated DeltaNet (``rlhf.models.hybrid``): conv_kernel_dim, key_head_dim, value_head_dim,
    num_key_heads, num_value_heads, and ``layers``: per layer, True for a DeltaNet, False for softmax attention"""
    attention_gate: bool = False  # qwen3_next: q_proj's second half per head gates the output, sigmoid
    zero_centered_norm: bool = False  # qwen3_next: the RMSNorms scale by (1 + w)
    moe_layers: tuple | None = None  # qwen3_next: per layer, True for MoE (decoder_sparse_step, mlp_only_layers)
    shared_expert_gate: bool = False  # qwen3_next: the shared expert's output times sigmoid(x . w)
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")

    @property
    def num_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
        if self.mla is not None or self.router is not None or self.linear_attention is not None:
            from rlhf.models.spec_families import layer_params

            return sum(layer_params(self, i) for i in range(self.num_layers)) + self.vocab_size * h * 2 + h
        mlp = 3 * h * self.intermediate_size
        if self.num_experts:
            mlp = self.num_experts * (3 * h * self.moe_ffn_hidden_size + h)  # experts + router
        per_layer = attn + mlp + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        emb = self.vocab_size * h
        head = h if self.is_seq_cls else (0 if self.tie_word_embeddings else emb)
        return self.num_layers * per_layer + emb + h + head

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def spec_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Validate an HF config dict and turn it into a ``ModelSpec``. Raises ``ValueError`` naming the field."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source}: unsupported model_type={model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    from rlhf.models.vlm import LANGUAGE_MODEL_TYPES, is_vlm_config, split_vlm_config

    if is_vlm_config(cfg):  # the language model (a qwen2 or qwen3_5_text decoder) with the multimodal rotary
        text, vision, mrope = split_vlm_config(cfg, source)
        lm = spec_from_hf_config({**text, "model_type": LANGUAGE_MODEL_TYPES[model_type]}, source)
        half = int(lm.head_dim * lm.rotary_percent) // 2
        if sum(mrope) != half:
            raise ValueError(f"{source}: rope_parameters.mrope_section={mrope} must sum to the rotary dimension / 2 "
                             f"= {half}")
        if lm.is_seq_cls:
            raise ValueError(f"{source}: a sequence-classification head on {model_type} is not supported")
        from dataclasses import replace

        return replace(lm, model_type=model_type, mrope_section=tuple(mrope), vision=vision)
    from rlhf.models.spec_families import FAMILY_KEYS, family_fields

    unknown = sorted(set(cfg) - _BENIGN_KEYS - FAMILY_KEYS.get(model_type, set()))
    if unknown:
        raise ValueError(f"{source}: unknown config field(s) {unknown} for model_type={model_type!r}")
    if model_type == "qwen3_5_moe_text" and "intermediate_size" not in cfg:  # no dense MLP: every layer is MoE
        cfg = {**cfg, "intermediate_size": cfg.get("moe_intermediate_size")}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in cfg:
            raise ValueError(f"{source}: missing required config field {key!r}")
    family = family_fields(cfg, source) if model_type in FAMILY_KEYS else None
    if family is not None:
        return _family_spec(cfg, family, source)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: unsupported config field hidden_act={cfg['hidden_act']!r} (only 'silu')")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{source}: unsupported config field mlp_bias=True")
    if cfg.get("pretraining_tp", 1) not in (None, 1):
        raise ValueError(f"{source}: unsupported config field pretraining_tp={cfg['pretraining_tp']}")
    archs = cfg.get("architectures") or []
    is_seq_cls = any(a.endswith("ForSequenceClassification") for a in archs) or is_openrlhf_config(cfg)
    if is_seq_cls and int(cfg.get("num_labels", len(cfg.get("id2label", {}) or {}) or 1)) != 1:
        raise ValueError(f"{source}: unsupported config field num_labels={cfg.get('num_labels')} (a scalar head "
                         "has num_labels=1)")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    sliding = _sliding_window(cfg, model_type, max_pos, source)
    qkv_bias = True if model_type == "qwen2" else bool(cfg.get("attention_bias", False))
    moe = _moe_fields(cfg, model_type, source)
    from rlhf.models.rope import parse_rope

    rope_theta, rope_scaling = parse_rope(cfg, source)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return ModelSpec(model_type=model_type, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
                     intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
                     num_attention_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                     head_dim=head_dim, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                     rope_theta=rope_theta, rope_scaling=rope_scaling, qk_norm=model_type in ("qwen3", "qwen3_moe"),
                     max_position_embeddings=max_pos,
                     tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
                     sliding_window=sliding, attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
                     initializer_range=float(cfg.get("initializer_range", 0.02)),
                     pad_token_id=cfg.get("pad_token_id"), is_seq_cls=is_seq_cls, torch_dtype=str(dtype), **moe,
                     extra={**{k: cfg[k] for k in ("bos_token_id", "eos_token_id", "rlhf") if k in cfg},
                            **({"score_head": head_prefix(cfg)} if is_seq_cls else {})})


def _family_spec(cfg: dict[str, Any], family: dict[str, Any], source: str) -> ModelSpec:
    """A deepseek_v3 / glm4_moe / gpt_oss config: the fields every family shares, then the family's own
    (``family``: ``rlhf.models.spec_families.family_fields``)."""
    model_type = cfg["model_type"]
    if any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures") or []) or \
            is_openrlhf_config(cfg):
        raise ValueError(f"{source}: a sequence-classification head on {model_type} is not supported (a reward model "
                         "or critic of this family); use a rule reward and a group estimator (--advantage_estimator "
                         "group_norm, rloo, reinforce_baseline)")
    if model_type not in ("gpt_oss", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text") and (
            cfg.get("use_sliding_window") or cfg.get("sliding_window") or
                                    any(t != "full_attention" for t in cfg.get("layer_types") or [])):
        raise ValueError(f"{source}: unsupported config field sliding_window / layer_types for {model_type}")
    from rlhf.models.rope import parse_rope

    if model_type in ("qwen3_5_text", "qwen3_5_moe_text"):  # rlhf.models.hybrid.text_rope
        from rlhf.models.hybrid import text_rope

        cfg = text_rope(cfg, source)
    rope_theta, rope_scaling = parse_rope(cfg, source, partial_ok=model_type in ("glm4_moe", "qwen3_next",
                                                                                   "qwen3_5_text", "qwen3_5_moe_text"))
    if family.get("mla") is not None and rope_scaling is not None and rope_scaling["rope_type"] != "yarn":
        raise ValueError(f"{source}: unsupported config field rope_type={rope_scaling['rope_type']!r} with "
                         "multi-latent attention (megatron's MLA RoPE: default or yarn)")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    head_dim = family.pop("head_dim", None) or int(cfg.get("head_dim") or hidden // heads)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return ModelSpec(model_type=model_type, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
                     intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
                     num_attention_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                     head_dim=head_dim, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
                     rope_scaling=rope_scaling, max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                     tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                     attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
                     initializer_range=float(cfg.get("initializer_range", 0.02)), pad_token_id=cfg.get("pad_token_id"),
                     torch_dtype=str(dtype), **family,
                     extra={k: cfg[k] for k in ("bos_token_id", "eos_token_id", "rlhf") if k in cfg})


def _moe_fields(cfg: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The MoE fields of a mixtral / qwen3_moe config; an option we do not implement raises naming it."""
    if model_type not in MOE_MODEL_TYPES:
        for key in ("num_local_experts", "num_experts", "moe_intermediate_size"):
            if cfg.get(key):
                raise ValueError(f"{source}: unsupported config field {key}={cfg[key]} for model_type={model_type!r}")
        return {}
    experts, topk = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0), cfg.get("num_experts_per_tok")
    if experts < 1 or not topk:
        raise ValueError(f"{source}: model_type={model_type!r} needs num_local_experts (or num_experts) and "
                         "num_experts_per_tok")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError(f"{source}: unsupported config field shared_expert_intermediate_size="
                         f"{cfg['shared_expert_intermediate_size']} (shared experts are not implemented)")
    if cfg.get("router_jitter_noise"):
        raise ValueError(f"{source}: unsupported config field router_jitter_noise={cfg['router_jitter_noise']} "
                         "(a noisy router is not implemented)")
    if model_type == "mixtral":
        ffn, norm = int(cfg["intermediate_size"]), True
    else:
        if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
            raise ValueError(f"{source}: unsupported config field(s) decoder_sparse_step="
                             f"{cfg.get('decoder_sparse_step', 1)} / mlp_only_layers={cfg.get('mlp_only_layers')} "
                             "(dense layers between MoE layers are not implemented)")
        if not cfg.get("moe_intermediate_size"):
            raise ValueError(f"{source}: missing required config field 'moe_intermediate_size'")
        ffn, norm = int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob", False))
    if not 1 <= int(topk) <= experts:
        raise ValueError(f"{source}: config field num_experts_per_tok={topk} must be in [1, {experts}]")
    if int(topk) == 1 and norm:
        raise ValueError(f"{source}: unsupported config field num_experts_per_tok=1 with renormalised routing "
                         "(megatron's router renormalises only k >= 2)")
    return {"num_experts": experts, "moe_topk": int(topk), "moe_ffn_hidden_size": ffn, "moe_norm_topk": norm}


def _sliding_window(cfg: dict[str, Any], model_type: str, max_pos: int, source: str) -> int | None:
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{source}: unsupported config field use_sliding_window=True ({model_type})")
        types = cfg.get("layer_types")
        if types and any(t != "full_attention" for t in types):
            raise ValueError(f"{source}: unsupported config field layer_types={sorted(set(types))}")
        return None
    window = cfg.get("sliding_window") if model_type in ("mistral", "mixtral") else None
    if model_type == "llama" and cfg.get("sliding_window") is not None:
        raise ValueError(f"{source}: unsupported config field sliding_window for llama")
    if window is None or int(window) >= max_pos:
        return None
    return int(window)


def load_hf_config(path: str) -> dict[str, Any]:
    """Read ``config.json`` from an HF folder (or the file itself). Raises ValueError if it is not there."""
    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(cfg_path):
        what = "folder" if not os.path.exists(path) else "config.json"
        raise ValueError(f"{what} not found: {cfg_path if what == 'config.json' else path}")
    with open(cfg_path) as f:
        return json.load(f)


def check_parallel_fit(spec: ModelSpec, tp: int, pp: int, padded_vocab: int | None = None, ep: int = 1) -> None:
    """TP must divide heads and the (padded) vocab, and divide the KV heads or be a multiple of them (megatron
    then replicates each KV head over TP / KV heads ranks); PP must divide the layers; EP the experts."""
    if ep > 1 and not spec.num_experts:
        raise ValueError(f"--expert_model_parallel_size {ep}: {spec.model_type} is not a mixture-of-experts model")
    if spec.num_experts and spec.num_experts % ep:
        raise ValueError(f"--expert_model_parallel_size {ep} does not divide num_experts={spec.num_experts}")
    if spec.num_attention_heads % tp:
        raise ValueError(f"--tp {tp} does not divide num_attention_heads={spec.num_attention_heads}")
    kv = spec.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"--tp {tp} and num_key_value_heads={kv}: one must divide the other (KV heads are "
                         "replicated when TP exceeds them)")
    group_rows = (spec.num_attention_heads // kv + 2) * spec.head_dim
    if kv < tp and group_rows % (tp // kv):
        raise ValueError(f"--tp {tp}: each KV group's {group_rows} fused q/k/v rows must split over "
                         f"{tp // kv} ranks")
    vocab = padded_vocab or spec.vocab_size
    if vocab % tp:
        raise ValueError(f"--tp {tp} does not divide the vocab size {vocab}")
    if spec.num_experts and spec.moe_ffn_hidden_size % tp:
        raise ValueError(f"--tp {tp} does not divide the experts' intermediate size {spec.moe_ffn_hidden_size}")
    if not spec.num_experts and spec.intermediate_size % tp:
        raise ValueError(f"--tp {tp} does not divide intermediate_size={spec.intermediate_size}")
    if spec.num_layers % pp:
        raise ValueError(f"--pp {pp} does not divide num_hidden_layers={spec.num_layers}")
    if spec.mla is not None or spec.router is not None:
        from rlhf.models.spec_families import check_family_fit

        check_family_fit(spec, tp)
    if spec.linear_attention is not None:
        from rlhf.models.hybrid import check_hybrid_fit

        check_hybrid_fit(spec, tp)


def padded_vocab_size(vocab_size: int, divisible_by: int = 128) -> int:
    """Megatron's vocab-parallel layers need V % TP == 0; pad once, independently of TP, so that one checkpoint
    loads at every TP that divides the padded size."""
    return ((vocab_size + divisible_by - 1) // divisible_by) * divisible_by
