"""A verifiable task for RL on a real small model (launch/rlvr_example.sh): short arithmetic questions whose answer
is one number, checked by ``rlhf.rewards.verifiers:math_reward`` against the record's ``answer``.

Sums of two numbers up to 30 (40%), sums up to 99 (40%) and products up to 12 x 12 (20%). SmolLM2-135M-Instruct
answered single-digit sums 31%, two-digit sums 8% and single-digit products 8% right at temperature 1 with 24 new
tokens (measured here, 12 questions x 4 samples each): often right but buried in a ramble whose last number is
something else, so there is room to learn both the arithmetic and to end on the answer.

    python -m rlhf.demo.arith_task --out data/arith --seed 0     # train.jsonl (512) and heldout.jsonl (64)

The held-out questions share no (kind, a, b) with the training ones.
"""
from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass

from rlhf.config.part import Part, flag

INSTRUCTION = " Answer with the number only."


def question(kind: str, a: int, b: int) -> tuple[str, int]:
    if kind == "mul":
        return f"What is {a} times {b}?", a * b
    return f"What is {a} + {b}?", a + b


KINDS = (("add", 2, 30, 0.4), ("add", 10, 99, 0.4), ("mul", 2, 12, 0.2))
"""(operation, smallest operand, largest operand, share): about 400 + 4000 + 66 distinct questions."""


def draw(rng: random.Random) -> tuple[str, int, int]:
    op, lo, hi, _ = rng.choices(KINDS, weights=[k[3] for k in KINDS])[0]
    return op, rng.randint(lo, hi), rng.randint(lo, hi)


def make_split(seed: int, n_train: int = 512, n_heldout: int = 64) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records ``{"prompt", "answer"}``; distinct questions, none shared between the splits."""
    rng = random.Random(seed)
    seen: set = set()
    out: list[list[dict]] = [[], []]
    for split, n in ((1, n_heldout), (0, n_train)):  # held-out first: its questions are never trained on
        while len(out[split]) < n:
            op, a, b = draw(rng)
            key = (op, min(a, b), max(a, b))
            if key in seen:
                continue
            seen.add(key)
            text, answer = question(op, a, b)
            out[split].append({"prompt": text + INSTRUCTION, "answer": str(answer)})
    return out[0], out[1]


def write(out_dir: str, seed: int, n_train: int = 512, n_heldout: int = 64) -> dict[str, str]:
    return write_splits(out_dir, make_split(seed, n_train, n_heldout))


@dataclass
class TaskDataPart(Part):
    """The command line of the bundled tasks' data makers (``python -m rlhf.demo.<task>_task``); each takes the
    flags it has (``add_args(p, only=...)``)."""

    out: str = flag(required=True, default=None)
    """(--out) the folder the records are written to"""
    seed: int = flag(type=int, default=0)
    """(--seed)"""
    n_train: int = flag(type=int, default=512)
    """(--n_train) training records"""
    n_heldout: int = flag(type=int, default=64)
    """(--n_heldout) held-out records"""


def write_splits(out_dir: str, splits: tuple[list[dict], list[dict]]) -> dict[str, str]:
    """(train, held-out) records to ``out_dir``/train.jsonl and heldout.jsonl; their paths by name."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for name, rows in zip(("train", "heldout"), splits):
        paths[name] = os.path.join(out_dir, f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    TaskDataPart.add_args(p)
    args = p.parse_args(argv)
    for name, path in write(args.out, args.seed, args.n_train, args.n_heldout).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
