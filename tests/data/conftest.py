import pytest


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The tiny byte-level BPE tokenizer (pad <pad>=0, bos <s>=1, eos </s>=2, a 'role: content' chat template)."""
    from rlhf.models.tiny import make_tokenizer

    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))
