"""The offline evaluation's metrics over n samples per prompt, each with a correctness (its reward at least the pass
threshold) and an extracted answer. Pure: lists in, floats out.

* ``pass@k``: the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code"):
  with ``c`` correct of ``n`` samples, ``1 - C(n - c, k) / C(n, k)``, the chance that k samples drawn without
  replacement from the n hold a correct one; averaged over prompts. Computed in exact integers.
* ``avg@k``: the mean correctness of each prompt's first k samples, averaged over prompts (``avg@n``: the accuracy
  over every sample).
* ``maj@k``: majority voting over each prompt's first k samples: the most frequent extracted answer (ties: the one
  seen first; samples without an answer do not vote) is right when the first sample that gave it is correct; no
  answer at all counts as wrong. Averaged over prompts.
"""
from __future__ import annotations

from collections import Counter
from fractions import Fraction
from math import comb
from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k for one prompt: ``1 - C(n - c, k) / C(n, k)`` (1 when fewer than k are wrong)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1 - Fraction(comb(n - c, k), comb(n, k)))


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Is the majority answer of these samples right (see the module's docstring)?"""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)  # ties: the first seen
    return bool(correct[list(answers).index(winner)])


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def evaluate_groups(correct: Sequence[Sequence[bool]], answers: Sequence[Sequence[str | None]],
                    rewards: Sequence[Sequence[float]], ks: Sequence[int]) -> dict[str, float]:
    """``pass@k``, ``avg@k`` and ``maj@k`` for each k in ``ks``, and ``mean_reward``, over prompts: each argument has
    one row per prompt of its n samples in sample order (every row the same n)."""
    if not correct:
        raise ValueError("no prompts to evaluate")
    n = len(correct[0])
    if any(len(row) != n for row in correct):
        raise ValueError(f"every prompt needs {n} samples")
    p = len(correct)
    out: dict[str, float] = {}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(map(bool, row)), k) for row in correct) / p
        out[f"avg@{k}"] = sum(sum(map(bool, row[:k])) / k for row in correct) / p
        out[f"maj@{k}"] = sum(majority_correct(a[:k], c[:k]) for a, c in zip(answers, correct)) / p
    out["mean_reward"] = sum(sum(r) for r in rewards) / (p * n)
    return out


def table(metrics: dict[str, float], ks: Sequence[int]) -> str:
    """A markdown table: one row per k, columns pass@k, avg@k, maj@k."""
    rows = ["| k | pass@k | avg@k | maj@k |", "| ---: | ---: | ---: | ---: |"]
    rows += [f"| {k} | {metrics[f'pass@{k}']:.4f} | {metrics[f'avg@{k}']:.4f} | {metrics[f'maj@{k}']:.4f} |"
             for k in ks]
    return "\n".join(rows)
