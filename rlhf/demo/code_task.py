"""A small code task set for RL on code (docs/code_rl.md, examples/code_rl/run.py): write one short Python function,
graded by hidden test cases in MBPP's ``test_list`` form (three ``assert f(x) == y``), which the code reward runs as
call tests (the expected values never enter the sandbox). Made here, from the templates below (this project's own,
no dataset's text; the repository's license); a template with a parameter gives one task per value.

    python -m rlhf.demo.code_task --out data/code --seed 0     # train.jsonl and heldout.jsonl

Held-out tasks come from templates and parameter values no training task uses. Each record: ``{"prompt",
"tests"}`` with ``tests`` a JSON string ``{"test_list": [...]}``.
"""
from __future__ import annotations

import argparse
import json
import os
import random

from rlhf.demo.arith_task import TaskDataPart

INSTRUCTION = " Reply with the function only, in a ```python code block."

# (name, description with {k}, reference (k) -> function, arguments (rng, k) -> args tuple, k values or None)
TEMPLATES = [
    ("add_k", "Write a Python function add_k(x) that returns x plus {k}.", lambda k: lambda x: x + k,
     lambda r, k: (r.randint(-50, 50),), range(1, 41)),
    ("times_k", "Write a Python function times_k(x) that returns x multiplied by {k}.", lambda k: lambda x: x * k,
     lambda r, k: (r.randint(-20, 20),), range(2, 22)),
    ("divisible", "Write a Python function divisible(x) that returns True if x is divisible by {k}, else False.",
     lambda k: lambda x: x % k == 0, lambda r, k: (r.randint(0, 100),), range(2, 22)),
    ("repeat_word", "Write a Python function repeat_word(s) that returns the string s repeated {k} times.",
     lambda k: lambda s: s * k, lambda r, k: (r.choice(["ab", "cat", "x", "hi!"]),), range(2, 12)),
    ("count_char", "Write a Python function count_char(s) that returns how many times the letter '{k}' occurs in the "
     "string s.", lambda k: lambda s: s.count(k),
     lambda r, k: ("".join(r.choice("abcdefghij") for _ in range(10)),), "abcdefghij"),
    ("first_n", "Write a Python function first_n(lst) that returns a list of the first {k} elements of the list "
     "lst.", lambda k: lambda lst: lst[:k], lambda r, k: ([r.randint(0, 9) for _ in range(9)],), range(1, 9)),
    ("power_k", "Write a Python function power_k(x) that returns x to the power {k}.", lambda k: lambda x: x ** k,
     lambda r, k: (r.randint(-5, 5),), range(2, 5)),
    ("greater_than", "Write a Python function greater_than(x) that returns True if x is greater than {k}, else False.",
     lambda k: lambda x: x > k, lambda r, k: (r.randint(-10, 50),), range(0, 40)),
    ("contains_k", "Write a Python function contains_k(lst) that returns True if the list lst contains the number "
     "{k}, else False.", lambda k: lambda lst: k in lst, lambda r, k: ([r.randint(0, 30) for _ in range(5)],),
     range(0, 30)),
    ("starts_with", "Write a Python function starts_with(s) that returns True if the string s starts with the "
     "letter '{k}', else False.", lambda k: lambda s: s.startswith(k),
     lambda r, k: (r.choice([k, "z", "q"]) + "bc",), "abcdefghijklmnoprstu"),
    ("plus_len", "Write a Python function plus_len(s) that returns the length of the string s plus {k}.",
     lambda k: lambda s: len(s) + k, lambda r, k: ("x" * r.randint(0, 9),), range(1, 32)),
    ("sum_list", "Write a Python function sum_list(lst) that returns the sum of the numbers in the list lst.",
     lambda k: sum, lambda r, k: ([r.randint(-9, 9) for _ in range(r.randint(1, 6))],), None),
    ("max_of", "Write a Python function max_of(lst) that returns the largest number in the list lst.",
     lambda k: max, lambda r, k: ([r.randint(-9, 9) for _ in range(r.randint(1, 6))],), None),
    ("min_of", "Write a Python function min_of(lst) that returns the smallest number in the list lst.",
     lambda k: min, lambda r, k: ([r.randint(-9, 9) for _ in range(r.randint(1, 6))],), None),
    ("reverse_string", "Write a Python function reverse_string(s) that returns the string s reversed.",
     lambda k: lambda s: s[::-1], lambda r, k: ("".join(r.choice("abcxyz") for _ in range(5)),), None),
    ("square", "Write a Python function square(x) that returns x squared.", lambda k: lambda x: x * x,
     lambda r, k: (r.randint(-12, 12),), None),
    ("is_even", "Write a Python function is_even(x) that returns True if x is even, else False.",
     lambda k: lambda x: x % 2 == 0, lambda r, k: (r.randint(0, 50),), None),
    ("count_words", "Write a Python function count_words(s) that returns the number of words in the string s.",
     lambda k: lambda s: len(s.split()), lambda r, k: (" ".join(["w"] * r.randint(1, 5)),), None),
    ("to_upper", "Write a Python function to_upper(s) that returns the string s in upper case.",
     lambda k: lambda s: s.upper(), lambda r, k: ("".join(r.choice("abcxyz") for _ in range(4)),), None),
    ("absolute", "Write a Python function absolute(x) that returns the absolute value of x.",
     lambda k: abs, lambda r, k: (r.randint(-30, 30),), None),
    ("list_length", "Write a Python function list_length(lst) that returns the number of elements in the list lst.",
     lambda k: len, lambda r, k: ([0] * r.randint(0, 7),), None),
    ("last_char", "Write a Python function last_char(s) that returns the last character of the string s.",
     lambda k: lambda s: s[-1], lambda r, k: ("".join(r.choice("abcxyz") for _ in range(4)),), None),
    ("subtract_k", "Write a Python function subtract_k(x) that returns x minus {k}.", lambda k: lambda x: x - k,
     lambda r, k: (r.randint(-50, 50),), range(1, 21)),
    ("mod_k", "Write a Python function mod_k(x) that returns the remainder of x divided by {k}.",
     lambda k: lambda x: x % k, lambda r, k: (r.randint(0, 100),), range(2, 10)),
]
HELDOUT_TEMPLATES = ("subtract_k", "mod_k", "last_char", "list_length", "absolute")
"""templates only in the held-out split (a task the policy never trained on)"""


def tasks(seed: int) -> list[dict]:
    """Every task: ``{"template", "k", "prompt", "tests"}`` (three asserts on seeded arguments)."""
    rng = random.Random(seed)
    out = []
    for name, desc, ref, args, ks in TEMPLATES:
        for k in (list(ks) if ks is not None else [None]):
            fn = ref(k)
            calls = []
            for _ in range(3):
                a = args(rng, k)
                calls.append(f"assert {name}({', '.join(repr(x) for x in a)}) == {fn(*a)!r}")
            out.append({"template": name, "k": k, "prompt": desc.format(k=k) + INSTRUCTION,
                        "tests": json.dumps({"test_list": calls})})
    return out


def make_split(seed: int, n_heldout: int = 48) -> tuple[list[dict], list[dict]]:
    """(train, held-out): the held-out templates' tasks, then parameter values of the others drawn aside."""
    rng = random.Random(seed + 1)
    all_tasks = tasks(seed)
    held = [t for t in all_tasks if t["template"] in HELDOUT_TEMPLATES]
    rest = [t for t in all_tasks if t["template"] not in HELDOUT_TEMPLATES]
    rng.shuffle(held)
    held = held[:n_heldout]
    rng.shuffle(rest)
    return [{"prompt": t["prompt"], "tests": t["tests"]} for t in rest], \
        [{"prompt": t["prompt"], "tests": t["tests"]} for t in held]


def write(out: str, seed: int = 0) -> dict[str, str]:
    os.makedirs(out, exist_ok=True)
    train, held = make_split(seed)
    paths = {"train": os.path.join(out, "train.jsonl"), "heldout": os.path.join(out, "heldout.jsonl")}
    for split, rows in (("train", train), ("heldout", held)):
        with open(paths[split], "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    TaskDataPart.add_args(p, only=("out", "seed"))
    a = p.parse_args(argv)
    paths = write(a.out, a.seed)
    print(json.dumps(paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
