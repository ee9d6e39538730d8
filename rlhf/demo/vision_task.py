"""A visual task a tiny vision-language model learns on a CPU (docs/vlm.md, examples/vlm/run.py): 112 x 112
images of one to three filled shapes (squares or discs) of one colour on a white ground, and one of two questions:
how many shapes there are (answer ``1``, ``2`` or ``3``) or what colour they are (``red``, ``green``, ``blue`` or
``yellow``). Answers are checked exactly (``shape_reward``): the reply's first word, lower-cased, against the
record's ``answer``. Chance is 1/3 for counts and 1/4 for colours.

    python -m rlhf.demo.vision_task --out data/shapes --seed 0   # train.jsonl, heldout.jsonl, sft.jsonl, images/

Records, in the peers' layout (OpenRLHF's and verl's image prompts): ``{"prompt": [{"role": "user", "content":
"<image>How many shapes are there?"}], "images": ["images/train_00012.png"], "answer": "2"}``; ``sft.jsonl`` adds
``"response"`` (the answer). Held-out images are drawn from their own seed: none is shown in training.
"""
from __future__ import annotations

import argparse
import json
import os
import random

from rlhf.demo.arith_task import TaskDataPart

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
QUESTIONS = {"count": "How many shapes are there? Answer with one number.",
             "colour": "What colour are the shapes? Answer with one word."}
SIZE = 112


def draw(rng: random.Random):
    """(PIL image, number of shapes, colour name): shapes that do not overlap."""
    from PIL import Image, ImageDraw

    n = rng.randint(1, 3)
    colour = rng.choice(sorted(COLOURS))
    img = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    d = ImageDraw.Draw(img)
    boxes: list[tuple[int, int, int, int]] = []
    while len(boxes) < n:
        s = rng.randint(18, 30)
        x, y = rng.randint(2, SIZE - s - 2), rng.randint(2, SIZE - s - 2)
        box = (x, y, x + s, y + s)
        if any(not (box[2] + 4 < b[0] or b[2] + 4 < box[0] or box[3] + 4 < b[1] or b[3] + 4 < box[1]) for b in boxes):
            continue
        boxes.append(box)
        (d.rectangle if rng.random() < 0.5 else d.ellipse)(box, fill=COLOURS[colour])
    return img, n, colour


def make_split(out_dir: str, name: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    records = []
    for i in range(n):
        img, count, colour = draw(rng)
        rel = f"images/{name}_{i:05d}.png"
        img.save(os.path.join(out_dir, rel))
        kind = "count" if i % 2 == 0 else "colour"
        answer = str(count) if kind == "count" else colour
        records.append({"prompt": [{"role": "user", "content": "<image>" + QUESTIONS[kind]}], "images": [rel],
                        "answer": answer, "kind": kind})
    return records


def write(out_dir: str, seed: int = 0, n_train: int = 512, n_heldout: int = 64,
          n_sft: int | None = None) -> dict[str, str]:
    """train.jsonl (prompts for GRPO), sft.jsonl (the same kind of records with their answer as ``response``, from
    other images), heldout.jsonl; their paths by name."""
    os.makedirs(out_dir, exist_ok=True)
    splits = {"train": make_split(out_dir, "train", n_train, seed * 3 + 1),
              "sft": make_split(out_dir, "sft", n_train if n_sft is None else n_sft, seed * 3 + 2),
              "heldout": make_split(out_dir, "heldout", n_heldout, seed * 3 + 3)}
    for r in splits["sft"]:
        r["response"] = r["answer"]
    paths = {}
    for name, records in splits.items():
        paths[name] = os.path.join(out_dir, f"{name}.jsonl")
        with open(paths[name], "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return paths


def corpus() -> list[str]:
    """Texts for the tiny model's tokenizer: the questions, the answers and the chat roles."""
    return [q for q in QUESTIONS.values()] * 50 + [" ".join(COLOURS)] * 50 + ["1 2 3 user assistant"] * 50


def shape_reward(prompts, responses, labels=None, **kwargs):
    """1.0 when the reply's first word (lower-cased, trailing punctuation dropped) is the answer, else 0.0."""
    out = []
    for r, label in zip(responses, labels or [None] * len(responses)):
        words = r.strip().split()
        first = words[0].lower().strip(".,!;:") if words else ""
        out.append(1.0 if label is not None and first == str(label).lower() else 0.0)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    TaskDataPart.add_args(p)
    a = p.parse_args(argv)
    print(json.dumps(write(a.out, a.seed, a.n_train, a.n_heldout)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
