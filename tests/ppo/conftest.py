import os

import pytest
from ppo_common import DIMS, write_prompts


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
