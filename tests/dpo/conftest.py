import os

import pytest


@pytest.fixture(scope="session")
def pref_setup(tmp_path_factory):
    """The bundled task's data (rlhf/demo/sort_task.py), small: preference pairs, held-out pairs from unseen (a, b)
    ranges, their KTO splits, and a tiny Llama on the task's tokenizer (no SFT: DPO/KTO start from it)."""
    from rlhf.demo.sort_task import corpus, make_all
    from rlhf.models.tiny import make_tiny_hf, make_tokenizer

    work = tmp_path_factory.mktemp("pref")
    tok = os.path.join(work, "tokenizer")
    make_tokenizer(tok, vocab_size=384, seed=0, texts=corpus())
    make_tiny_hf(os.path.join(work, "init"), "llama", seed=0, tokenizer_dir=tok, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    paths = make_all(os.path.join(work, "data"), seed=0, n_sft=64, n_pref=256, n_train_prompts=8,
                     n_eval_prompts=8, n_eval_pref=64)
    paths["model"] = os.path.join(work, "init")
    paths["work"] = work
    return paths
