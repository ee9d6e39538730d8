"""Resumable jsonl output for the offline jobs (batch inference, offline evaluation): work goes in chunks, rank 0
appends each finished chunk and fsyncs it, and a relaunch keeps the complete chunks already written (a torn or
partial chunk of a killed run is cut) and continues after them."""
from __future__ import annotations

import json
import logging
import os

import torch.distributed as dist

log = logging.getLogger("rlhf")


def resume_point(path: str, rows_per_chunk: int) -> int:
    """Rank 0: the chunks already complete in ``path``; the file is cut back to them (a torn or partial chunk
    from a killed run goes). Returns the number of complete chunks."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")[:-1]  # the last element is what follows the last newline: torn or empty
    done = len(lines) // rows_per_chunk
    keep = b"".join(ln + b"\n" for ln in lines[: done * rows_per_chunk])
    if len(keep) != len(data):
        with open(path, "wb") as f:
            f.write(keep)
            f.flush()
            os.fsync(f.fileno())
    return done


def append_rows(path: str, rows: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def agreed(value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def chunks(n: int, size: int, done: int, stop_after: int):
    """``(k, lo, hi)`` of the chunks of ``n`` items after the ``done`` first; ``stop_after`` >= 0 stops (as if
    killed) after that many."""
    for k, lo in enumerate(range(0, n, size)):
        if k < done:
            continue
        if 0 <= stop_after <= k - done:
            log.info("stopping after %d chunks (--stop_after_chunks)", stop_after)
            return
        yield k, lo, min(lo + size, n)
