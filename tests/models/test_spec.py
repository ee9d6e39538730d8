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
