"""Bundled task: list four words that lie alphabetically between two given words, in ascending order.

    prompt   "between delta and papa ="
    reply    " golf india kilo mike"          (gold 1.0: delta < golf < india < kilo < mike < papa)

The gold reward is a rule: 0 unless the reply has exactly four words, else the fraction of the five links
``a < r1 < r2 < r3 < r4 < b`` that hold strictly (a repeated word or one outside the range breaks a link). It is
used only to label preference pairs (with label noise) and to measure; PPO optimizes the *learned* reward model.

The SFT corpus is mediocre on purpose: replies use the right words (four distinct words from the range) but in a
random order, sorted only 15% of the time. So the SFT model gets the format and the range, and orders by
chance; preferences carry the ordering. Held-out prompts use (a, b) pairs never seen in training.

Why not "sort the prompt's words": a tiny reward model learns order quickly but not set membership (a reply
with a duplicated or foreign word but sorted order looked good to it), and PPO found and exploited that blind spot
(gold fell while RM reward rose). Here every constraint is an order comparison between neighbours.
"""
from __future__ import annotations

import json
import os
import random
from typing import Sequence

WORDS = ("apple banana cherry delta echo golf hotel india juliet kilo lima mike oscar papa romeo tango").split()
N_REPLY = 4
SORTED_FRACTION = 0.15  # of the SFT replies
LABEL_NOISE = 0.1  # training preference labels flipped at random
CORRUPT_FRACTION = 0.4  # preference pairs whose rejected side breaks a rule other than the order


def prompt_of(a: str, b: str) -> str:
    return f"between {a} and {b} ="


def bounds_of_prompt(prompt: str) -> tuple[str, str]:
    parts = prompt.split()
    return parts[1], parts[3]


def gold_reward(prompt: str, reply: str) -> float:
    """In [0, 1]: 0 unless exactly four words; else the fraction of strict links a < r1 < ... < r4 < b."""
    a, b = bounds_of_prompt(prompt)
    got = reply.split()
    if len(got) != N_REPLY:
        return 0.0
    chain = [a, *got, b]
    return sum(x < y for x, y in zip(chain, chain[1:])) / (len(chain) - 1)


def gold_rewards(prompts: Sequence[str], replies: Sequence[str]) -> list[float]:
    return [gold_reward(p, r) for p, r in zip(prompts, replies)]


def all_pairs() -> list[tuple[str, str]]:
    """(a, b) with at least four words strictly between them."""
    return [(WORDS[i], WORDS[j]) for i in range(len(WORDS)) for j in range(i + N_REPLY + 1, len(WORDS))]


def inside(a: str, b: str) -> list[str]:
    return [w for w in WORDS if a < w < b]


def sft_reply(a: str, b: str, rng: random.Random) -> list[str]:
    w = rng.sample(inside(a, b), N_REPLY)
    return sorted(w) if rng.random() < SORTED_FRACTION else w


def corrupt(words: list[str], a: str, b: str, rng: random.Random) -> list[str]:
    """Break a rule other than the order: repeat a word, use one outside (a, b), or change the length."""
    w = list(words)
    i = rng.randrange(len(w))
    kind = rng.choices(range(4), weights=(0.35, 0.35, 0.15, 0.15))[0]
    if kind == 0:
        w[i] = w[(i + 1) % len(w)]
    elif kind == 1:
        w[i] = rng.choice([x for x in WORDS if not a < x < b])
    elif kind == 2:
        del w[i]
    else:
        w.insert(i, rng.choice(WORDS))
    return w


def _reply(words: Sequence[str]) -> str:
    return " " + " ".join(words)


def make_all(out: str, seed: int = 0, n_sft: int = 2000, n_pref: int = 4000, n_train_prompts: int = 512,
             n_eval_prompts: int = 64, n_eval_pref: int = 1000, held_out_fraction: float = 0.2) -> dict[str, str]:
    """Write sft.jsonl, pref.jsonl, pref_eval.jsonl (noise-free labels), prompts.jsonl and prompts_eval.jsonl,
    and KTO's unpaired kto_train.jsonl / kto_eval.jsonl (``kto_rows`` of the two preference files)."""
    rng = random.Random(seed)
    os.makedirs(out, exist_ok=True)
    pairs = all_pairs()
    rng.shuffle(pairs)
    n_held = max(2, int(len(pairs) * held_out_fraction))
    held, train = pairs[:n_held], pairs[n_held:]

    def write(name: str, rows: list[dict]) -> str:
        path = os.path.join(out, name)
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        return path

    sft = []
    for _ in range(n_sft):
        a, b = rng.choice(train)
        sft.append({"input": prompt_of(a, b), "output": _reply(sft_reply(a, b, rng))})

    def pref_rows(n: int, source: list[tuple[str, str]], noise: float) -> list[dict]:
        rows = []
        while len(rows) < n:
            a, b = rng.choice(source)
            p = prompt_of(a, b)
            x, y = sft_reply(a, b, rng), sft_reply(a, b, rng)
            if rng.random() < CORRUPT_FRACTION:
                y = corrupt(sorted(y) if rng.random() < 0.5 else y, a, b, rng)
            gx, gy = gold_reward(p, _reply(x)), gold_reward(p, _reply(y))
            if gx == gy:
                continue
            chosen, rejected = (x, y) if gx > gy else (y, x)
            if rng.random() < noise:
                chosen, rejected = rejected, chosen
            rows.append({"prompt": p, "chosen": _reply(chosen), "rejected": _reply(rejected)})
        return rows

    pref, pref_eval = pref_rows(n_pref, train, LABEL_NOISE), pref_rows(n_eval_pref, held, 0.0)
    return {
        "sft": write("sft.jsonl", sft),
        "pref": write("pref.jsonl", pref),
        "pref_eval": write("pref_eval.jsonl", pref_eval),
        "prompts": write("prompts.jsonl", [{"prompt": prompt_of(*rng.choice(train))} for _ in range(n_train_prompts)]),
        "prompts_eval": write("prompts_eval.jsonl", [{"prompt": prompt_of(*held[i % len(held)])}
                                                     for i in range(n_eval_prompts)]),
        "kto": write("kto_train.jsonl", kto_rows(pref)),
        "kto_eval": write("kto_eval.jsonl", kto_rows(pref_eval)),
    }


def kto_rows(pairs: Sequence[dict]) -> list[dict]:
    """Unpaired KTO samples from preference pairs: each pair gives its chosen reply as desirable and its rejected
    reply as undesirable (``{"prompt", "completion", "label"}``). Uses no randomness, so it adds nothing to the
    generator's stream: the other files are the same as without it."""
    return [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"} for r in pairs
            for k in ("chosen", "rejected")]


def corpus() -> list[str]:
    """Text for training the demo tokenizer: every word becomes one token."""
    rng = random.Random(1)
    lines = []
    for _ in range(3000):
        a, b = rng.choice(all_pairs())
        lines.append(prompt_of(a, b) + _reply(sorted(rng.sample(inside(a, b), N_REPLY))))
    return lines
