import os

import pytest
from ppo_common import DIMS, write_prompts


@pytest.fixture
def no_models(monkeypatch):
    """Model construction fails loudly (each check must come before any model), the test folder is importable
    (its rule rewards), and the checks see rank 0 of a 2-rank job: they all run before the process group exists."""
    import rlhf.runtime.role

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(rlhf.runtime.role.ModelRole, "__init__", boom)
    monkeypatch.syspath_prepend(os.path.dirname(os.path.abspath(__file__)))
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="session")
def ppo_setup(tmp_path_factory):
    """A tiny actor, an ordinary tiny sequence-classification reward model (its score head scaled to a unit spread:
    a target the policy can move) and 64 prompts."""
    from helpers import make_seq_cls_rm
    from rlhf.models.tiny import make_tiny_hf

    work = tmp_path_factory.mktemp("ppo")
    actor = make_tiny_hf(os.path.join(work, "actor"), "llama", seed=0, **DIMS)
    rm = make_seq_cls_rm(os.path.join(work, "rm"), actor, seed=1, **DIMS)
    # Tied embeddings (as SmolLM2): vLLM's CPU backend keeps a prepacked LM head that a reload must refresh.
    tied = make_tiny_hf(os.path.join(work, "actor_tied"), "llama", seed=2, tokenizer_dir=actor,
                        tie_word_embeddings=True, **DIMS)
    return {"work": work, "actor": actor, "rm": rm, "actor_tied": tied,
            "prompts": write_prompts(work / "prompts.jsonl", 64)}


@pytest.fixture(scope="session")
def reward_pair(ppo_setup):
    """Two ordinary tiny reward models (different seeds) whose config.json carries
    rlhf.reward_mean/reward_std, as launch/rm.py saves them: for multi-RM PPO and rejection sampling."""
    import json

    from helpers import make_seq_cls_rm

    out = []
    for name, seed, mean, std in (("rm_a", 1, 0.1, 0.8), ("rm_b", 5, -0.2, 1.5)):
        path = make_seq_cls_rm(os.path.join(ppo_setup["work"], name), ppo_setup["actor"], seed=seed, **DIMS)
        cfg_path = os.path.join(path, "config.json")
        cfg = json.load(open(cfg_path))
        cfg["rlhf"] = {"reward_mean": mean, "reward_std": std}
        json.dump(cfg, open(cfg_path, "w"), indent=2)
        out.append(path)
    return out


@pytest.fixture(scope="session")
def family_actors(ppo_setup):
    """Actors of the newer families, with the base actor's tokenizer. The prompts (about 25 tokens) run past
    both original contexts (16), so the scaled frequencies matter.

    qwen3_yarn_kv1: Qwen3 (q/k norms, head_dim 64 != hidden / heads = 32), YaRN RoPE, ONE KV head (replicated
                    over TP 2 in megatron and in vLLM)
    llama3_rope:    Llama with Llama-3.1-style RoPE scaling
    mixtral:        4 experts, top 2, renormalised (spread over 2 EP ranks by the tests)
    qwen3_moe:      4 experts, top 2, not renormalised (norm_topk_prob=False)"""
    from rlhf.models.tiny import make_tiny_hf

    work, tok = ppo_setup["work"], ppo_setup["actor"]
    dims = {**DIMS, "max_position_embeddings": 64}
    qwen3 = make_tiny_hf(os.path.join(work, "qwen3_yarn_kv1"), "qwen3", seed=6, tokenizer_dir=tok,
                         **{**dims, "num_key_value_heads": 1, "head_dim": 64, "tie_word_embeddings": False},
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    llama3 = make_tiny_hf(os.path.join(work, "llama3_rope"), "llama", seed=7, tokenizer_dir=tok, **dims,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.25,
                                        "high_freq_factor": 2.0, "original_max_position_embeddings": 16})
    mixtral = make_tiny_hf(os.path.join(work, "mixtral"), "mixtral", seed=8, tokenizer_dir=tok,
                           **{**dims, "intermediate_size": 64, "tie_word_embeddings": False},
                           num_local_experts=4, num_experts_per_tok=2)
    qwen3_moe = make_tiny_hf(os.path.join(work, "qwen3_moe"), "qwen3_moe", seed=9, tokenizer_dir=tok,
                             **{**dims, "tie_word_embeddings": False}, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=64, norm_topk_prob=False)
    return {"qwen3_yarn_kv1": qwen3, "llama3_rope": llama3, "mixtral": mixtral, "qwen3_moe": qwen3_moe}


@pytest.fixture(scope="session")
def moe_family_actors(ppo_setup):
    """Tiny actors of the 2026 families (rlhf.models.tiny.TINY_FAMILIES: DeepSeek-V3 with MLA, its sigmoid router,
    expert-bias correction, groups, a shared expert, a dense first layer and one MTP layer's tensors; GLM-4.5;
    GPT-OSS at the released swiglu_limit 7, the one vLLM 0.32 computes), with the base actor's tokenizer."""
    from rlhf.models.tiny import make_tiny_family

    work, tok = ppo_setup["work"], ppo_setup["actor"]
    extra = {"gpt_oss": {"swiglu_limit": 7.0}}
    names = ("deepseek_v3", "glm4_moe", "gpt_oss")
    return {name: make_tiny_family(os.path.join(work, name), name, seed=20 + i, tokenizer_dir=tok,
                                   **extra.get(name, {})) for i, name in enumerate(names)}


@pytest.fixture(scope="session")
def hybrid_actors(ppo_setup):
    """Tiny Gated DeltaNet hybrids (rlhf.models.tiny.TINY_HYBRIDS: Qwen3-Next dense and MoE, Qwen3.5's text model;
    dt_bias, the (1 + w) norms and the gated norm drawn non-zero), with the base actor's tokenizer."""
    from rlhf.models.tiny import TINY_HYBRIDS, make_tiny_hybrid

    work, tok = ppo_setup["work"], ppo_setup["actor"]
    return {name: make_tiny_hybrid(os.path.join(work, name), name, seed=30 + i, tokenizer_dir=tok)
            for i, name in enumerate(TINY_HYBRIDS)}
