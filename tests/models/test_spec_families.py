"""The config.json fields of DeepSeek-V3, GLM-4.5 and GPT-OSS (rlhf.models.spec_families): the released configs read
as they are (their fields as published on the hub), every field we do not implement refused by name, the parameter
count equal to transformers' model."""
import pytest

from rlhf.models.spec import check_parallel_fit, spec_from_hf_config

# deepseek-ai/DeepSeek-V3's config.json (its FP8 quantization_config aside: refused below), 2 layers kept
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], attention_bias=False, attention_dropout=0.0,
    auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, aux_loss_alpha=0.001, bos_token_id=0,
    eos_token_id=1, ep_size=1, first_k_dense_replace=1, hidden_act="silu", hidden_size=7168, initializer_range=0.02,
    intermediate_size=18432, kv_lora_rank=512, max_position_embeddings=163840, model_type="deepseek_v3",
    moe_intermediate_size=2048, moe_layer_freq=1, n_group=8, n_routed_experts=256, n_shared_experts=1,
    norm_topk_prob=True, num_attention_heads=128, num_experts_per_tok=8, num_hidden_layers=2, num_key_value_heads=128,
    num_nextn_predict_layers=1, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-06,
    rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "original_max_position_embeddings": 4096, "type": "yarn"},
    rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", seq_aux=True, tie_word_embeddings=False,
    topk_group=4, topk_method="noaux_tc", torch_dtype="bfloat16", transformers_version="4.46.3", use_cache=True,
    v_head_dim=128, vocab_size=129280)
# zai-org/GLM-4.5's config.json, 4 layers kept
GLM45 = dict(
    architectures=["Glm4MoeForCausalLM"], attention_bias=True, attention_dropout=0.0, pad_token_id=151329,
    eos_token_id=[151329, 151336, 151338], head_dim=128, hidden_act="silu", hidden_size=5120,
    partial_rotary_factor=0.5, initializer_range=0.02, intermediate_size=12288, max_position_embeddings=131072,
    model_type="glm4_moe", moe_intermediate_size=1536, norm_topk_prob=True, num_attention_heads=96, n_group=1,
    topk_group=1, n_routed_experts=160, n_shared_experts=1, routed_scaling_factor=2.5, num_experts_per_tok=8,
    first_k_dense_replace=3, num_hidden_layers=4, num_key_value_heads=8, rms_norm_eps=1e-05, rope_theta=1000000,
    num_nextn_predict_layers=1, tie_word_embeddings=False, torch_dtype="bfloat16", transformers_version="4.54.0",
    use_cache=True, use_qk_norm=True, vocab_size=151552)
# openai/gpt-oss-20b's config.json, 4 layers kept
GPT_OSS = dict(
    architectures=["GptOssForCausalLM"], attention_bias=True, attention_dropout=0.0, eos_token_id=200002,
    experts_per_token=4, head_dim=64, hidden_act="silu", hidden_size=2880, initial_context_length=4096,
    initializer_range=0.02, intermediate_size=2880,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    max_position_embeddings=131072, model_type="gpt_oss", num_attention_heads=64, num_experts_per_tok=4,
    num_hidden_layers=4, num_key_value_heads=8, num_local_experts=32, output_router_logits=False, pad_token_id=199999,
    quantization_config={"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                    "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    rms_norm_eps=1e-05, rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                      "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                      "truncate": False},
    rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False,
    transformers_version="4.55.0.dev0", use_cache=True, vocab_size=201088)


def test_released_configs_read_as_they_are():
    d = spec_from_hf_config(DEEPSEEK_V3)
    assert d.mla == {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                     "v_head_dim": 128}
    assert d.router == {"score": "sigmoid", "expert_bias": True, "num_groups": 8, "group_topk": 4, "scaling": 2.5,
                        "bias": False}
    assert (d.num_experts, d.moe_topk, d.shared_expert_size, d.dense_layers, d.mtp_layers, d.head_dim) == \
        (256, 8, 2048, 1, 1, 192)
    assert d.rope_scaling["rope_type"] == "yarn" and d.rope_scaling["factor"] == 40
    g = spec_from_hf_config(GLM45)
    assert (g.rotary_percent, g.qk_norm, g.qkv_bias, g.dense_layers, g.shared_expert_size, g.router["num_groups"]) == \
        (0.5, True, True, 3, 1536, None)
    o = spec_from_hf_config(GPT_OSS)
    assert (o.attention_sinks, o.linear_bias, o.mxfp4, o.swiglu, o.sliding_window) == (True, True, True, (1.702, 7.0),
                                                                                      128)
    assert o.window_layers == (True, False, True, False) and o.rope_scaling["truncate"] is False


def _cfg(base, **kw):
    c = dict(base)
    for k, v in kw.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    return c


@pytest.mark.parametrize("base,bad,field", [
    (DEEPSEEK_V3, dict(quantization_config={"quant_method": "fp8"}), "fp8_cast_bf16"),
    (DEEPSEEK_V3, dict(scoring_func="softmax"), "scoring_func"),
    (DEEPSEEK_V3, dict(topk_method="greedy"), "topk_method"),
    (DEEPSEEK_V3, dict(rope_interleave=False), "rope_interleave"),
    (DEEPSEEK_V3, dict(attention_bias=True), "attention_bias"),
    (DEEPSEEK_V3, dict(norm_topk_prob=False), "norm_topk_prob"),
    (DEEPSEEK_V3, dict(topk_group=2), "topk_group"),
    (DEEPSEEK_V3, dict(moe_layer_freq=2), "moe_layer_freq"),
    (DEEPSEEK_V3, dict(first_k_dense_replace=2), "first_k_dense_replace"),
    (DEEPSEEK_V3, dict(num_key_value_heads=8), "num_key_value_heads"),
    (DEEPSEEK_V3, dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_type"),
    (DEEPSEEK_V3, dict(kv_lora_rank=None), "kv_lora_rank"),
    (DEEPSEEK_V3, dict(architectures=["DeepseekV3ForSequenceClassification"]), "sequence-classification"),
    (DEEPSEEK_V3, dict(some_new_field=1), "some_new_field"),
    (GLM45, dict(partial_rotary_factor=0.25, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (GLM45, dict(sliding_window=4096), "sliding_window"),
    (GLM45, dict(hidden_act="gelu"), "hidden_act"),
    (GPT_OSS, dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config"),
    (GPT_OSS, dict(layer_types=["chunked_attention"] * 4), "layer_types"),
    (GPT_OSS, dict(attention_bias=False), "attention_bias"),
    (GPT_OSS, dict(swiglu_limit=None), "swiglu_limit"),
    (GPT_OSS, dict(initial_context_length=8192), "initial_context_length"),
])
def test_unsupported_fields_raise_naming_them(base, bad, field):
    with pytest.raises(ValueError, match=field):
        spec_from_hf_config(_cfg(base, **bad))


def test_parallel_fit_of_the_families():
    check_parallel_fit(spec_from_hf_config(DEEPSEEK_V3), 8, 2, 129280, ep=8)
    check_parallel_fit(spec_from_hf_config(GPT_OSS), 2, 1, 201088)  # its biased experts at expert-TP 1
    check_parallel_fit(spec_from_hf_config(GPT_OSS), 1, 2, 201088, ep=4)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3-noqlora", "glm4_moe", "gpt_oss"])
def test_param_count_equals_transformers(tmp_path, name):
    """ModelSpec.num_params (the planner's figure) counts transformers' parameters and the expert-bias buffer."""
    import transformers

    from rlhf.models.spec import load_hf_config
    from rlhf.models.tiny import make_tiny_family

    path = make_tiny_family(str(tmp_path / name), name, **({"num_nextn_predict_layers": 0}
                                                          if name == "deepseek_v3" else {}))
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    n = sum(p.numel() for p in model.parameters()) + sum(b.numel() for k, b in model.named_buffers()
                                                         if k.endswith("e_score_correction_bias"))
    assert spec_from_hf_config(load_hf_config(path)).num_params == n


def test_what_vllm_cannot_generate_is_refused_by_name():
    """vLLM 0.32 (rlhf.models.spec_families.vllm_refusal): gpt_oss (its weight sync keeps the old experts and sinks),
    MLA in fp32 on CPU; DeepSeek passes where vLLM runs it."""
    from rlhf.models.spec_families import vllm_refusal

    assert "Failed to load weights" in vllm_refusal(spec_from_hf_config(GPT_OSS), 8, "bfloat16", True)
    ds = spec_from_hf_config(DEEPSEEK_V3)
    assert "bf16" in vllm_refusal(ds, 1, "float32", False)
    assert vllm_refusal(ds, 1, "bfloat16", False) is None and vllm_refusal(ds, 1, "float32", True) is None
    assert vllm_refusal(spec_from_hf_config(GLM45), 8, "float32", False) is None
