"""The calculator-tool task (``rlhf.demo.calc_agent``): products of a two-digit and a one- or two-digit number,
which SmolLM2-135M-Instruct rarely gets right in its head but can with the calculator. Each prompt is a
conversation (``--apply_chat_template``): a system line saying how to call the calculator, one worked exchange
(question, ``<calc>12*34</calc>``, the calculator's answer, the number), then the question. Measured here with
``transformers``' generate at temperature 1, 24 new tokens: SmolLM2-135M-Instruct called the calculator in 19
of 48 replies with this prompt, and in 0 of 48 with the instruction alone in one user message. ``answer`` is
checked by the agent.

The tiny-model form (``--tiny``) has no chat template and no instruction: the prompt is ``"23 times 45 ="``, and
a small SFT corpus (``tiny_sft_rows``) gives the bundled tiny model its habits: it calls the calculator
(`` <calc>23*45</calc>``) in ``TOOL_FRACTION`` of its first replies and otherwise writes a wrong guess (the product
off by 1-99), and after ``"\nCalculator: 1035\n"`` it copies the number. So the SFT model is right about as often
as it calls the tool, and RL has to raise that rate; the tool, not the model, does the multiplication.

    python -m rlhf.demo.calc_task --out data/calc --seed 0     # train.jsonl (512) and heldout.jsonl (64)
    python -m rlhf.demo.calc_task --out data/calc --tiny       # the same for the tiny model, plus sft.jsonl
"""
from __future__ import annotations

import argparse
import random

from rlhf.demo.arith_task import TaskDataPart, write_splits

SYSTEM = ("You answer arithmetic questions with a calculator: write <calc>a*b</calc>, read the result, then give "
          "the number.")
SHOT = [{"role": "user", "content": "What is 12 times 34?"}, {"role": "assistant", "content": "<calc>12*34</calc>"},
        {"role": "user", "content": "Calculator: 408"}, {"role": "assistant", "content": "408"}]


TOOL_FRACTION = 0.25  # of the tiny model's SFT first replies


def chat_prompt(a: int, b: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *SHOT, {"role": "user", "content": f"What is {a} times {b}?"}]


def tiny_prompt(a: int, b: int) -> str:
    return f"{a} times {b} ="


def tiny_call(a: int, b: int) -> str:
    return f" <calc>{a}*{b}</calc>"


def tiny_sft_rows(seed: int, n: int = 3000, eos: str = "</s>") -> list[dict]:
    """The tiny model's SFT corpus ``{"input", "output"}``: for each of ``n`` random questions, a first reply (the
    tool call in ``TOOL_FRACTION`` of them, else a wrong guess) and the answer after the calculator's reply. The
    second row's input is the trajectory's text up to there: the call, ``eos`` (the turn's end, kept in the
    context as generated) and the feedback the agent appends in plain mode."""
    rng = random.Random(10_000 + seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(11, 99), rng.randint(3, 99)
        if rng.random() < TOOL_FRACTION:
            first = tiny_call(a, b)
        else:
            first = f" {a * b + rng.choice([-1, 1]) * rng.randint(1, 99)}"
        rows.append({"input": tiny_prompt(a, b), "output": first})
        rows.append({"input": f"{tiny_prompt(a, b)}{tiny_call(a, b)}{eos}\nCalculator: {a * b}\n",
                     "output": str(a * b)})
    return rows


def tiny_corpus() -> list[str]:
    """Text for training the tiny model's tokenizer (digits stay single characters: merges go to the words)."""
    return [f"{tiny_prompt(a, b)}{tiny_call(a, b)}\nCalculator: {a * b}\n{a * b}" for a in (12, 47, 90)
            for b in (3, 58, 99)] * 20


def make_split(seed: int, n_train: int = 512, n_heldout: int = 64, prompt=chat_prompt) -> tuple[list[dict], list[dict]]:
    """(train, held-out) records ``{"prompt", "answer"}``, distinct products, none shared between the splits;
    ``prompt(a, b)`` makes the prompt (the chat form, or ``tiny_prompt``)."""
    rng = random.Random(seed)
    seen: set = set()
    out: list[list[dict]] = [[], []]
    for split, n in ((1, n_heldout), (0, n_train)):
        while len(out[split]) < n:
            a, b = rng.randint(11, 99), rng.randint(3, 99)
            if (min(a, b), max(a, b)) in seen:
                continue
            seen.add((min(a, b), max(a, b)))
            out[split].append({"prompt": prompt(a, b), "answer": str(a * b)})
    return out[0], out[1]


def write(out_dir: str, seed: int, n_train: int = 512, n_heldout: int = 64, tiny: bool = False) -> dict[str, str]:
    """train.jsonl and heldout.jsonl under ``out_dir`` (and sft.jsonl for ``tiny``); their paths by name."""
    import json

    paths = write_splits(out_dir, make_split(seed, n_train, n_heldout, tiny_prompt if tiny else chat_prompt))
    if tiny:
        paths["sft"] = f"{out_dir}/sft.jsonl"
        with open(paths["sft"], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in tiny_sft_rows(seed))
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    TaskDataPart.add_args(p, only=("out", "seed"))
    p.add_argument("--tiny", action="store_true", help="the tiny model's form (plain prompts, an SFT corpus)")
    a = p.parse_args(argv)
    print(write(a.out, a.seed, tiny=a.tiny))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
