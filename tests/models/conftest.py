import os

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny llama/qwen2/mistral HF folders (CausalLM and SequenceClassification) sharing one tokenizer."""
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
    return work
