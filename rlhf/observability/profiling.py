"""An opt-in torch profiler over chosen training steps, for finding what bounds a step on a GPU (the MFU check).

``RLHF_PROFILE_STEPS=3-5`` profiles steps 3 to 5 (1-based, inclusive) of a supervised run and writes, on rank 0,
``profile_steps_3-5.txt`` (the operators and kernels by total device time, then by host time) into
``RLHF_PROFILE_DIR`` (default: the run's ``--save_path``). Unset, nothing is imported or wrapped."""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

log = logging.getLogger(__name__)


def profile_range() -> tuple[int, int] | None:
    """``RLHF_PROFILE_STEPS`` as (first, last), or None; a malformed value is a ValueError naming it."""
    spec = os.environ.get("RLHF_PROFILE_STEPS", "").strip()
    if not spec:
        return None
    try:
        first, _, last = spec.partition("-")
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"RLHF_PROFILE_STEPS={spec!r}: expected a step or a range of steps, e.g. 3-5") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"RLHF_PROFILE_STEPS={spec!r}: expected 1 <= first <= last")
    return lo, hi


class StepProfiler:
    """Wraps the steps in ``profile_range()``; ``step(n)`` is entered around step ``n`` (1-based)."""

    def __init__(self, out_dir: str, is_rank0: bool) -> None:
        self.range, self.is_rank0, self.prof = profile_range(), is_rank0, None
        self.out_dir = os.environ.get("RLHF_PROFILE_DIR") or out_dir

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        if self.range is None or not self.range[0] <= n <= self.range[1]:
            yield
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self.prof is None:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
        yield
        if n == self.range[1]:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.write()

    def write(self) -> None:
        if not self.is_rank0:
            return
        lo, hi = self.range
        path = os.path.join(self.out_dir, f"profile_steps_{lo}-{hi}.txt")
        os.makedirs(self.out_dir, exist_ok=True)
        avg = self.prof.key_averages()
        device = "cuda" if any(getattr(e, "device_time_total", 0) for e in avg) else "cpu"
        with open(path, "w") as f:
            if device == "cuda":
                f.write(f"# steps {lo}-{hi}, by device time\n")
                f.write(avg.table(sort_by="device_time_total", row_limit=40, max_name_column_width=70) + "\n")
            f.write(f"# steps {lo}-{hi}, by host time\n")
            f.write(avg.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70) + "\n")
        log.info("profile of steps %d-%d written to %s", lo, hi, path)
