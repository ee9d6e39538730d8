"""Start-up health checks that run once the process group is up, before any model is loaded.

Every rank of an SPMD job parses its own command line. A rank that got a different flag (a stale script on one
node, an environment variable expanded differently, a hand-edited hostfile line) otherwise trains a different
job in lockstep with the others, or hangs in a collective 20 minutes later. ``check_config_consistency``
all-gathers one hash of the parsed flags; if any rank disagrees, every rank raises the same ``ValueError`` naming
the first differing flag and its value on each rank, so the whole job stops at once.

The process-group rendezvous itself has a timeout with an error that names MASTER_ADDR and MASTER_PORT
(``rlhf.distributed.mesh.init_process_group``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
from typing import Any, Iterable

import torch.distributed as dist

# Flags that may legitimately differ between ranks (DeepSpeed-style launchers pass --local_rank per process).
RANK_LOCAL_FLAGS = ("local_rank",)


def _canonical(value: Any) -> str:
    """A stable text form of one flag value (json where possible, so 1e-3 and 0.001 agree)."""
    try:
        return json.dumps(value, sort_keys=True)
    except TypeError:
        return repr(value)


def config_fields(args: argparse.Namespace, exclude: Iterable[str] = RANK_LOCAL_FLAGS) -> dict[str, str]:
    """The flags as ``{name: canonical value}``, in the order argparse defined them."""
    skip = set(exclude)
    return {k: _canonical(v) for k, v in vars(args).items() if k not in skip}


def config_hash(fields: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def first_difference(per_rank: list[dict[str, str]]) -> tuple[str, list[str | None]] | None:
    """The first flag (in rank 0's order, then any flag only some ranks have) whose value differs, with each
    rank's value (None where the rank lacks the flag). None when all ranks agree. Pure."""
    names = list(per_rank[0])
    for fields in per_rank[1:]:
        names += [k for k in fields if k not in names]
    for name in names:
        values = [fields.get(name) for fields in per_rank]
        if any(v != values[0] for v in values):
            return name, values
    return None


def check_config_consistency(args: argparse.Namespace, group: Any = None,
                             exclude: Iterable[str] = RANK_LOCAL_FLAGS) -> str:
    """All-gather a hash of ``args`` over ``group`` (default: the world). Returns the hash when every rank agrees;
    otherwise every rank raises ``ValueError`` naming the first differing flag and each rank's value.

    Call it right after the process group is up: it costs one small all-gather (two on a mismatch)."""
    fields = config_fields(args, exclude)
    digest = config_hash(fields)
    n = dist.get_world_size(group)
    hashes: list = [None] * n
    dist.all_gather_object(hashes, digest, group=group)
    if all(h == digest for h in hashes):
        return digest
    # Every rank saw the same hashes, so every rank takes this branch and the second all-gather matches up.
    per_rank: list = [None] * n
    dist.all_gather_object(per_rank, fields, group=group)
    diff = first_difference(per_rank)
    ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(n)]
    if diff is None:  # same values, different hashes: cannot happen unless the hash itself differs across builds
        raise ValueError(f"the configuration hash differs across ranks ({sorted(set(hashes))}) although every "
                         "flag has the same value; are all ranks running the same code?")
    name, values = diff
    groups: dict[str | None, list[int]] = {}
    for r, v in zip(ranks, values):
        groups.setdefault(v, []).append(r)
    where = "; ".join(f"{_ranks(rs)} " + (_verb(rs, "lack", "lacks") + " it" if v is None else
                                           _verb(rs, "have", "has") + " " + v) for v, rs in groups.items())
    n_diff = sum(1 for k in set().union(*per_rank) if len({f.get(k) for f in per_rank}) > 1)
    more = f" ({n_diff - 1} more flag(s) differ)" if n_diff > 1 else ""
    raise ValueError(f"configuration differs across ranks: --{name}: {where}{more}. Every rank must be started "
                     "with the same flags")


def _verb(rs: list[int], plural: str, singular: str) -> str:
    return singular if len(rs) == 1 else plural


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {','.join(map(str, rs))}"
