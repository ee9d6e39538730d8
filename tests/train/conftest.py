import json
import os
import random

import pytest

WORDS = "apple banana cherry delta echo golf hotel india juliet kilo lima mike oscar papa romeo tango".split()


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def sft_rows(n, seed):
    """'repeat: w1 w2 w3' -> 'w1 w2 w3': learnable by a tiny model in a few dozen steps."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ws = rng.sample(WORDS, 3)
        rows.append({"input": "repeat: " + " ".join(ws) + " =", "output": " " + " ".join(ws)})
    return rows


def rm_rows(n, seed):
    """Chosen answers are sorted, rejected ones reversed-sorted: a preference a tiny RM learns quickly."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ws = rng.sample(WORDS, 3)
        rows.append({"prompt": "sort: " + " ".join(ws) + " =", "chosen": " " + " ".join(sorted(ws)),
                     "rejected": " " + " ".join(sorted(ws, reverse=True))})
    return rows


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
