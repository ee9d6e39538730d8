"""A budget of ranks shared by the suite's xdist workers: the multi-rank jobs the tests start run at most
``RANK_BUDGET`` ranks at a time on the machine, first come first served.

On a 2-core machine two workers each running a job of 4 ranks (or one of 4 beside one of 2) made every rank wait
for a core: the context-parallel fixture took 660-670 s beside another job against 139 s alone, and the suite ran
39-40 minutes. A job of one rank is not counted (it takes the core its idle worker leaves), nor is any job outside
an xdist run (one worker runs one job at a time anyway). A job wider than the budget runs alone. The grant is
re-entrant within one worker: a test that holds ranks and starts another job gets it at once, so a test can never
wait for itself. The state is a JSON file beside an flock, named after xdist's run id; holders and waiters whose
process died are dropped, so a killed worker cannot hold ranks for ever."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import tempfile
import time

RANK_BUDGET = 4
"""Ranks at once across the workers: two 2-rank jobs side by side, or one job of 3 or 4 ranks alone."""
POLL_S = 0.2
WAIT_CAP_S = 600.0
"""A waiter that waited this long takes its ranks anyway, over the budget (and says so on stderr): a leaked holder
(a job a test never waited for) may slow the suite, never hang it."""

_HELD = {"ranks": 0}  # what this process holds now (nested grants included)


def _state_path() -> str | None:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return os.path.join(tempfile.gettempdir(), f"rlhf-rank-budget-{run}.json") if run else None


def _alive(pid: int) -> bool:
    """A process that runs (a zombie, killed but not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def _state(path: str):
    """The shared state under its lock: ``{"holders": {pid: ranks}, "queue": [pid, ...]}``, the dead pruned;
    written back when the block ends."""
    fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, ValueError):
            state = {"holders": {}, "queue": []}
        state["holders"] = {p: n for p, n in state["holders"].items() if _alive(int(p))}
        state["queue"] = [p for p in state["queue"] if _alive(p)]
        yield state
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
    finally:
        os.close(fd)


def _fits(state: dict, ranks: int) -> bool:
    used = sum(state["holders"].values())
    return used == 0 or used + ranks <= RANK_BUDGET


def _grant(state: dict, key: str, ranks: int) -> int:
    state["holders"][key] = state["holders"].get(key, 0) + ranks
    _HELD["ranks"] += ranks
    return ranks


def acquire(ranks: int) -> int:
    """Wait for ``ranks`` ranks of the budget; returns what was taken (0: not counted), for ``release``."""
    path = _state_path()
    if ranks < 2 or path is None:
        return 0
    me = os.getpid()
    key = str(me)
    with _state(path) as state:
        if _HELD["ranks"] or (not state["queue"] and _fits(state, ranks)):
            return _grant(state, key, ranks)
        state["queue"].append(me)
    deadline = time.monotonic() + WAIT_CAP_S
    try:
        while True:
            time.sleep(POLL_S)
            with _state(path) as state:
                late = time.monotonic() >= deadline
                if late or (state["queue"] and state["queue"][0] == me and _fits(state, ranks)):
                    if late:
                        print(f"rank_budget: waited {WAIT_CAP_S:g} s for {ranks} ranks; taking them over the budget "
                              f"(holders: {state['holders']})", file=sys.stderr, flush=True)
                    state["queue"] = [p for p in state["queue"] if p != me]
                    return _grant(state, key, ranks)
    except BaseException:  # pytest-timeout's interrupt while waiting: leave the queue
        with _state(path) as state:
            state["queue"] = [p for p in state["queue"] if p != me]
        raise


def release(ranks: int) -> None:
    path = _state_path()
    if not ranks or path is None:
        return
    key = str(os.getpid())
    with _state(path) as state:
        left = state["holders"].get(key, 0) - ranks
        if left > 0:
            state["holders"][key] = left
        else:
            state["holders"].pop(key, None)
    _HELD["ranks"] = max(0, _HELD["ranks"] - ranks)


@contextlib.contextmanager
def ranks_of_budget(ranks: int):
    taken = acquire(ranks)
    try:
        yield
    finally:
        release(taken)


def ranks_in(cmd: list[str]) -> int:
    """The ranks a launch command starts: its ``--nproc_per_node`` (or ``-np``, mpirun's), else 1."""
    for flag in ("--nproc_per_node", "--nproc-per-node", "-np"):
        if flag in cmd[:-1]:
            try:
                return int(cmd[cmd.index(flag) + 1])
            except ValueError:
                return 1
    return 1
