"""Data helpers shared by the tests/train tests (a module of its own: ``from conftest import`` resolves to
whichever conftest was imported last)."""
import json
import random

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
