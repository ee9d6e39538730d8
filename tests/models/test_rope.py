"""RoPE scaling: our frequencies (rlhf.models.rope, float64) equal transformers' own rope init functions, and
the rope types we do not implement are refused by name before any weight is read. The logits of scaled-RoPE
models at positions beyond the original context are compared with transformers in test_parallel_equivalence."""
import pytest
import torch

from rlhf.models import rope
from rlhf.models.spec import spec_from_hf_config

BASE = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=512,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=131072, rope_theta=500000.0)
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3.1": LLAMA31,
    "llama3.2": {**LLAMA31, "factor": 32.0},
    "yarn-qwen2.5": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn-attention_factor": {"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.8, "beta_fast": 16,
                              "beta_slow": 2, "original_max_position_embeddings": 4096},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                    "original_max_position_embeddings": 4096, "truncate": False},
}


def hf_rope(cfg):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = dict(cfg)
    c.pop("architectures"), c.pop("model_type")
    config = transformers.LlamaConfig(**c)
    kind = config.rope_parameters["rope_type"]
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu")


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("case", list(CASES))
def test_frequencies_equal_transformers(case, field):
    cfg = {**BASE, field: dict(CASES[case])}
    spec = spec_from_hf_config(cfg)
    assert spec.rope_scaling["rope_type"] == CASES[case].get("rope_type", CASES[case].get("type"))
    ours = rope.inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)
    ref, ref_factor = hf_rope(cfg)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape == (spec.head_dim // 2,)
    assert torch.allclose(ours, ref.float(), rtol=2e-6, atol=0), (ours - ref).abs().max()
    assert rope.attention_factor(spec.rope_scaling) == pytest.approx(ref_factor, rel=1e-12)
    plain = rope.inv_freq(spec.head_dim, spec.rope_theta, None)
    assert not torch.allclose(ours, plain)  # the case can fail: scaling changed the frequencies


def test_plain_rope_untouched():
    spec = spec_from_hf_config({**BASE, "rope_scaling": {"rope_type": "default", "rope_theta": 1e6}})
    assert spec.rope_scaling is None and spec.rope_theta == 1e6
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(**{k: v for k, v in BASE.items() if k not in ("architectures", "model_type")},
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    ref, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    assert torch.allclose(rope.inv_freq(spec.head_dim, 1e6, None), ref, rtol=2e-6) and factor == 1.0


@pytest.mark.parametrize("block,needle", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type='dynamic'"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "rope_scaling.rope_type='longrope'"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, "['low_freq_factor']"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "rope_scaling.high_freq_factor is required"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 4096}, "rope_scaling.factor is required"),
])
def test_unsupported_rope_refused_by_name(block, needle):
    with pytest.raises(ValueError) as e:
        spec_from_hf_config({**BASE, "rope_scaling": block})
    assert needle in str(e.value) and "\n" not in str(e.value)
