import os

import pytest


# The families and options beyond the base three: scaled RoPE (original contexts shorter than the test's
# 24-token sequences; llama3's factors put its frequencies in all three bands), qwen3 (q/k norms, head_dim 32
# != hidden / heads = 16), a single KV head (replicated at TP 2) and two MoE models.
EXTRA_MODELS = {
    "llama-llama3": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 0.25,
                                                 "high_freq_factor": 2.0, "original_max_position_embeddings": 16})),
    "llama-linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2-yarn": ("qwen2", dict(tie_word_embeddings=False, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                          "original_max_position_embeddings": 8},
                                 max_position_embeddings=32)),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3-cls": ("qwen3", dict(head_dim=32)),
    "llama-kv1": ("llama", dict(num_key_value_heads=1)),
    # MoE: 4 experts, top 2; mixtral renormalises the top-k weights, this qwen3_moe does not (norm_topk_prob)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                                tie_word_embeddings=False)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32,
                                    norm_topk_prob=False, tie_word_embeddings=False)),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny llama/qwen2/mistral HF folders (CausalLM and SequenceClassification) sharing one tokenizer, plus
    ``EXTRA_MODELS``."""
    from rlhf.models.tiny import make_tiny_hf, make_tokenizer

    work = tmp_path_factory.mktemp("tiny")
    tok = os.path.join(work, "tok")
    make_tokenizer(tok)
    for arch in ("llama", "qwen2", "mistral"):
        for cls in (False, True):
            kw = {}
            if arch == "mistral":  # a window shorter than the test sequences, and tied embeddings
                kw = dict(sliding_window=8, tie_word_embeddings=not cls)
            if arch == "qwen2":
                kw = dict(tie_word_embeddings=False)
            make_tiny_hf(os.path.join(work, "hf", arch + ("-cls" if cls else "")), arch, cls, seed=3,
                         tokenizer_dir=tok, **kw)
    for name, (arch, kw) in EXTRA_MODELS.items():
        make_tiny_hf(os.path.join(work, "hf", name), arch, name.endswith("-cls"), seed=4, tokenizer_dir=tok, **kw)
    return work


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """Tiny HF folders of the newer families (transformers' own classes, biases, sinks and the expert-bias
    correction drawn non-zero; DeepSeek with one MTP layer's tensors) and a 2-layer mixtral: WORK/hf/NAME."""
    from rlhf.models.tiny import make_tiny_family, make_tiny_hf, make_tokenizer

    work = tmp_path_factory.mktemp("families")
    tok = os.path.join(work, "tok")
    make_tokenizer(tok)
    from rlhf.models.tiny import TINY_FAMILIES

    for i, name in enumerate(TINY_FAMILIES):
        make_tiny_family(os.path.join(work, "hf", name), name, seed=10 + i, tokenizer_dir=tok)
    make_tiny_hf(os.path.join(work, "hf", "mixtral"), "mixtral", seed=4, tokenizer_dir=tok, num_hidden_layers=2,
                 num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, tie_word_embeddings=False)
    return work
