"""HF config validation: supported fields map, unsupported ones raise naming the field."""
import pytest

from rlhf.models.spec import check_parallel_fit, padded_vocab_size, spec_from_hf_config

BASE = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=64,
            intermediate_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)


def cfg(**kw):
    c = dict(BASE)
    c.update(kw)
    return c


def test_llama_fields():
    s = spec_from_hf_config(cfg(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rms_norm_eps=1e-5,
                                tie_word_embeddings=True))
    assert (s.head_dim, s.num_kv_heads, s.rope_theta, s.rms_norm_eps, s.tie_word_embeddings, s.qkv_bias) == \
        (8, 2, 5e5, 1e-5, True, False)
    assert spec_from_hf_config(cfg(rope_theta=1e4)).rope_theta == 1e4  # transformers 4 style


def test_qwen2_has_qkv_bias_and_seq_cls():
    s = spec_from_hf_config(cfg(model_type="qwen2", architectures=["Qwen2ForSequenceClassification"],
                                num_labels=1, use_sliding_window=False))
    assert s.qkv_bias and s.is_seq_cls


def test_mistral_sliding_window():
    assert spec_from_hf_config(cfg(model_type="mistral", sliding_window=64)).sliding_window == 64
    assert spec_from_hf_config(cfg(model_type="mistral", sliding_window=None)).sliding_window is None


@pytest.mark.parametrize("bad,field", [
    (dict(model_type="gpt2"), "model_type"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(some_new_field=1), "some_new_field"),
    (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window"),
    (dict(architectures=["LlamaForSequenceClassification"], num_labels=3), "num_labels"),
])
def test_unsupported_fields_raise_naming_them(bad, field):
    with pytest.raises(ValueError, match=field):
        spec_from_hf_config(cfg(**bad))


def test_missing_required_field():
    c = cfg()
    del c["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        spec_from_hf_config(c)


def test_parallel_fit():
    s = spec_from_hf_config(cfg())
    check_parallel_fit(s, 2, 2, padded_vocab_size(1000))
    check_parallel_fit(s, 4, 1, 1024)  # TP 4 over 2 KV heads: each KV head replicated on 2 ranks
    check_parallel_fit(s, 8, 1, 1024)
    with pytest.raises(ValueError, match=r"--tp 6 and num_key_value_heads=4: one must divide the other"):
        check_parallel_fit(spec_from_hf_config(cfg(num_attention_heads=12, num_key_value_heads=4,
                                                   hidden_size=96)), 6, 1, 1536)
    with pytest.raises(ValueError, match="num_attention_heads=8"):
        check_parallel_fit(spec_from_hf_config(cfg(num_key_value_heads=8)), 3, 1, 1536)
    with pytest.raises(ValueError, match="vocab size 1004"):
        check_parallel_fit(spec_from_hf_config(cfg(num_key_value_heads=8)), 8, 1, 1004)
    with pytest.raises(ValueError, match="num_hidden_layers=4"):
        check_parallel_fit(s, 1, 3, 1024)
    assert padded_vocab_size(49152) == 49152 and padded_vocab_size(259) == 384


MIXTRAL = dict(BASE, model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=8,
               num_experts_per_tok=2, router_jitter_noise=0.0, output_router_logits=False, router_aux_loss_coef=0.02)
QWEN3_MOE = dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[], head_dim=16)


def test_moe_fields():
    m = spec_from_hf_config(MIXTRAL)
    assert (m.num_experts, m.moe_topk, m.moe_ffn_hidden_size, m.moe_norm_topk, m.qk_norm) == (8, 2, 128, True, False)
    q = spec_from_hf_config(QWEN3_MOE)
    assert (q.num_experts, q.moe_topk, q.moe_ffn_hidden_size, q.moe_norm_topk, q.qk_norm) == (8, 2, 32, True, True)
    assert spec_from_hf_config({**QWEN3_MOE, "norm_topk_prob": False}).moe_norm_topk is False
    check_parallel_fit(m, 2, 2, 1024, ep=4)
    h, e, f = 64, 8, 128  # 4 layers of attention + router + 8 experts (gate, up, down), embeddings, norms, head
    attn = h * (h + 2 * 2 * 8) + h * h
    assert m.num_params == 4 * (attn + e * (3 * h * f + h) + 2 * h) + 1000 * h + h + 1000 * h


@pytest.mark.parametrize("cfg,needle", [
    ({**MIXTRAL, "router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ({**QWEN3_MOE, "shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size=64"),
    ({**QWEN3_MOE, "decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({**QWEN3_MOE, "mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
    ({**MIXTRAL, "num_experts_per_tok": 1}, "num_experts_per_tok=1 with renormalised routing"),
    ({**MIXTRAL, "num_experts_per_tok": 9}, "num_experts_per_tok=9 must be in [1, 8]"),
    ({**{k: v for k, v in QWEN3_MOE.items() if k != "moe_intermediate_size"}}, "'moe_intermediate_size'"),
    ({**BASE, "num_local_experts": 8}, "num_local_experts=8 for model_type='llama'"),
])
def test_unsupported_moe_options_refused_by_name(cfg, needle):
    with pytest.raises(ValueError) as e:
        spec_from_hf_config(cfg)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_expert_parallel_fit():
    from rlhf.distributed.mesh import validate_layout

    m = spec_from_hf_config(MIXTRAL)
    with pytest.raises(ValueError, match=r"--expert_model_parallel_size 3 does not divide num_experts=8"):
        check_parallel_fit(m, 1, 1, 1024, ep=3)
    with pytest.raises(ValueError, match=r"--expert_model_parallel_size 2: llama is not a mixture-of-experts"):
        check_parallel_fit(spec_from_hf_config(BASE), 1, 1, 1024, ep=2)
    assert validate_layout(8, 2, 1, ep=4) == 4
    with pytest.raises(ValueError, match=r"--expert_model_parallel_size 4 must be >= 1 and divide the "
                                         r"data-parallel size 2 \(world 8 / tp 2 / pp 2\)"):
        validate_layout(8, 2, 2, ep=4)


def test_moe_training_limits_refused_before_weights():
    """LoRA on MoE is refused by the engine before any weight is read; an MoE model trains at TP > 1 (sequence
    parallelism, rlhf.models.sequence_parallel); dense models ignore --ep."""
    from types import SimpleNamespace

    from rlhf.runtime.role import _check_moe

    m = spec_from_hf_config(MIXTRAL)
    mesh = SimpleNamespace(tp=2, ep=2, is_rank0=False)
    assert _check_moe(m, mesh, "ref", trained=False, lora=False) == 2
    assert _check_moe(m, mesh, "actor", trained=True, lora=False) == 2
    with pytest.raises(ValueError, match=r"--lora_rank with an MoE model"):
        _check_moe(m, SimpleNamespace(tp=1, ep=2, is_rank0=False), "actor", trained=True, lora=True)
    assert _check_moe(spec_from_hf_config(BASE), mesh, "reward", trained=True, lora=False) == 1
