"""The calculator-tool task (``rlhf.demo.calc_agent``): products of a two-digit and a one- or two-digit number,
which SmolLM2-135M-Instruct rarely gets right in its head but can with the calculator. Each prompt is a
conversation (``--apply_chat_template``): a system line saying how to call the calculator, one worked exchange
(question, ``<calc>12*34</calc>``, the calculator's answer, the number), then the question. Measured here with
``transformers``' generate at temperature 1, 24 new tokens: SmolLM2-135M-Instruct called the calculator in 19
of 48 replies with this prompt, and in 0 of 48 with the instruction alone in one user message. ``answer`` is
checked by the agent.

    python -m rlhf.demo.calc_task --out data/calc --seed 0     # train.jsonl (512) and heldout.jsonl (64)
"""
from __future__ import annotations

import argparse
import random

SYSTEM = ("You answer arithmetic questions with a calculator: write <calc>a*b</calc>, read the result, then give "
          "the number.")
SHOT = [{"role": "user", "content": "What is 12 times 34?"}, {"role": "assistant", "content": "<calc>12*34</calc>"},
        {"role": "user", "content": "Calculator: 408"}, {"role": "assistant", "content": "408"}]


def make_split(seed: int, n_train: int = 512, n_heldout: int = 64) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records ``{"prompt", "answer"}``, distinct products, none shared between the splits."""
    rng = random.Random(seed)
    seen: set = set()
    out: list[list[dict]] = [[], []]
    for split, n in ((1, n_heldout), (0, n_train)):
        while len(out[split]) < n:
            a, b = rng.randint(11, 99), rng.randint(3, 99)
            if (min(a, b), max(a, b)) in seen:
                continue
            seen.add((min(a, b), max(a, b)))
            convo = [{"role": "system", "content": SYSTEM}, *SHOT, {"role": "user", "content": f"What is {a} times {b}?"}]
            out[split].append({"prompt": convo, "answer": str(a * b)})
    return out[0], out[1]


def write(out_dir: str, seed: int, n_train: int = 512, n_heldout: int = 64) -> dict[str, str]:
    from rlhf.demo.arith_task import write_splits

    return write_splits(out_dir, make_split(seed, n_train, n_heldout))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(write(a.out, a.seed))
