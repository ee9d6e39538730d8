import json
import random

import pytest

WORDS = "apple banana cherry delta echo golf hotel india juliet kilo lima mike oscar papa romeo tango".split()


@pytest.fixture(scope="session")
def sft_setup(tmp_path_factory):
    """A tiny Llama and 64 'repeat: a b c = a b c' rows: a few SFT steps take about a second."""
    from rlhf.models.tiny import make_tiny_hf

    work = tmp_path_factory.mktemp("launch")
    model = make_tiny_hf(str(work / "model"), "llama", seed=0, num_hidden_layers=2, hidden_size=64,
                         intermediate_size=128)
    rng = random.Random(0)
    data = work / "sft.jsonl"
    with open(data, "w") as f:
        for _ in range(64):
            ws = rng.sample(WORDS, 3)
            f.write(json.dumps({"input": "repeat: " + " ".join(ws) + " =", "output": " " + " ".join(ws)}) + "\n")
    return {"work": work, "model": model, "data": str(data)}

