import os

import pytest

from _train_testlib import rm_rows, sft_rows, write_jsonl


@pytest.fixture(scope="session")
def train_setup(tmp_path_factory):
    from rlhf.models.tiny import make_tiny_hf

    work = tmp_path_factory.mktemp("train")
    make_tiny_hf(os.path.join(work, "actor"), "llama", seed=0, num_hidden_layers=2, hidden_size=64)
    return {
        "work": work,
        "model": os.path.join(work, "actor"),
        "sft": write_jsonl(work / "sft.jsonl", sft_rows(256, 0)),
        "sft_eval": write_jsonl(work / "sft_eval.jsonl", sft_rows(32, 1)),
        "rm": write_jsonl(work / "rm.jsonl", rm_rows(256, 2)),
        "rm_eval": write_jsonl(work / "rm_eval.jsonl", rm_rows(64, 3)),
    }
