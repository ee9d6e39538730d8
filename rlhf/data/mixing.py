"""Deterministic mixing of several datasets (``--dataset_probs``, ``--max_samples``, ``--seed``).

The rule, exactly:

1. ``N = sum(sizes)``; the mixed set has ``T = min(N, max_samples)`` records (``max_samples=None``: ``T = N``).
2. Probabilities default to the sizes' proportions ``sizes[i] / N``. The per-dataset quotas ``q[i]`` are
   ``probs[i] * T`` apportioned by largest remainder: floors first, then one extra to the largest fractional
   parts (ties: lower dataset index), so ``sum(q) == T`` and ``|q[i] - probs[i] * T| < 1``.
3. Dataset ``i`` contributes ``q[i]`` records taken without replacement in the order of a permutation seeded by
   ``(seed, i)``; only if ``q[i] > sizes[i]`` (a small dataset given a large probability) does it wrap around
   into a fresh permutation (logged as upsampling).
4. The concatenation is shuffled with a permutation seeded by ``seed``.

With no probabilities and no cap every record appears exactly once, in a seeded random order.
"""
from __future__ import annotations

import logging
import math
from typing import Sequence

import numpy as np

log = logging.getLogger(__name__)

PROBS_TOLERANCE = 1e-3
_PER_SOURCE_STREAM, _SHUFFLE_STREAM = 0, 1  # keep the seeded streams of steps 3 and 4 independent


def parse_probs(value: str | Sequence[float] | None, num_datasets: int) -> list[float] | None:
    """Parse ``--dataset_probs``; ``None``/empty means proportional to sizes. Validates count, sign and sum."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        probs = [float(p) for p in value.split(",")] if isinstance(value, str) else [float(p) for p in value]
    except ValueError:
        raise ValueError(f"--dataset_probs must be comma-separated numbers, got {value!r}") from None
    if len(probs) != num_datasets:
        raise ValueError(f"--dataset_probs {value!r} has {len(probs)} values but --dataset has {num_datasets} "
                         f"entries; give one probability per dataset")
    if any(not math.isfinite(p) or p < 0 for p in probs):
        raise ValueError(f"--dataset_probs {value!r}: probabilities must be finite and >= 0")
    if abs(sum(probs) - 1.0) > PROBS_TOLERANCE:
        raise ValueError(f"--dataset_probs {value!r} sums to {sum(probs):.6g}; it must sum to 1 "
                         f"(within {PROBS_TOLERANCE})")
    return probs


def quotas(sizes: Sequence[int], probs: Sequence[float] | None, max_samples: int | None) -> list[int]:
    """How many records each dataset contributes (steps 1-2 of the module rule); sums to ``min(N, max_samples)``."""
    n = sum(sizes)
    total = n if max_samples is None else min(n, max_samples)
    if probs is None:
        probs = [s / n for s in sizes]
    s = sum(probs)
    raw = [p / s * total for p in probs]  # renormalise: probs are only ~1 (PROBS_TOLERANCE)
    q = [math.floor(r) for r in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: (-(raw[i] - q[i]), i))
    for i in by_remainder[: total - sum(q)]:
        q[i] += 1
    return q


def _take(size: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` indices into ``range(size)``: a permutation, wrapping into fresh permutations only if needed."""
    parts, left = [], count
    while left > 0:
        parts.append(rng.permutation(size)[: min(left, size)])
        left -= size
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def mix(sizes: Sequence[int], probs: Sequence[float] | None, max_samples: int | None,
        seed: int) -> list[tuple[int, int]]:
    """The mixed, shuffled order as ``(dataset_index, record_index)`` pairs (the module rule, steps 1-4)."""
    if any(s <= 0 for s in sizes):
        raise ValueError(f"every dataset must have records, got sizes {list(sizes)}")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"--max_samples must be >= 1, got {max_samples}")
    q = quotas(sizes, probs, max_samples)
    pairs = []
    for i, (size, count) in enumerate(zip(sizes, q, strict=True)):
        if count > size:
            log.warning("dataset %d has %d records but its probability asks for %d: repeating records", i, size,
                        count)
        idx = _take(size, count, np.random.default_rng([seed, _PER_SOURCE_STREAM, i]))
        pairs.extend((i, int(j)) for j in idx)
    order = np.random.default_rng([seed, _SHUFFLE_STREAM]).permutation(len(pairs))
    return [pairs[k] for k in order]
