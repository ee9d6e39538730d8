import os

import pytest
from ppo_common import DIMS, write_prompts


@pytest.fixture(scope="session")
def ppo_setup(tmp_path_factory):
    """A tiny actor, a synthetic last-token reward model (a learnable target) and 64 prompts."""
    from rlhf.models.tiny import make_last_token_rm, make_tiny_hf

    work = tmp_path_factory.mktemp("ppo")
    actor = make_tiny_hf(os.path.join(work, "actor"), "llama", seed=0, **DIMS)
    rm = make_last_token_rm(os.path.join(work, "rm"), actor, seed=1, **DIMS)
    # Tied embeddings (as SmolLM2): vLLM's CPU backend keeps a prepacked LM head that a reload must refresh.
    tied = make_tiny_hf(os.path.join(work, "actor_tied"), "llama", seed=2, tokenizer_dir=actor,
                        tie_word_embeddings=True, **DIMS)
    return {"work": work, "actor": actor, "rm": rm, "actor_tied": tied,
            "prompts": write_prompts(work / "prompts.jsonl", 64)}
