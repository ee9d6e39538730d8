"""Fault injection for the tests: ``RLHF_FAULT_INJECT`` makes one rank fail at a named place, through the same
paths a real fault takes (``rlhf.distributed.watchdog``, ``rlhf.distributed.failures``). Free when unset."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from rlhf.distributed import rank_state

log = logging.getLogger(__name__)
FAULT_ENV = "RLHF_FAULT_INJECT"
FAULT_KINDS = ("raise", "kill", "stop", "hang", "pause")
PAUSE_S = 2.0
"""``pause``: how long the rank sleeps before it goes on."""


@dataclass(frozen=True)
class Fault:
    kind: str
    site: str
    rank: int
    step: int | None = None
    restart: int = 0


def parse_faults(spec: str) -> list[Fault]:
    """``kind:site:rank[:step[:restart]]``, comma-separated: ``raise:checkpoint_save:1:2`` raises on rank 1 in
    the middle of the checkpoint save of step 2; ``stop:update:0`` sends SIGSTOP to rank 0 at its first update;
    ``kill`` is SIGKILL; ``hang`` sleeps forever with the watchdog's heartbeat still going (a livelock); ``pause``
    sleeps ``PAUSE_S`` and goes on (a window in which a test's own SIGKILL of the job lands: the crash harness's
    mid-export kill, where a tiny model's export may otherwise end before the kill comes).
    ``restart``: torchrun's restart count the fault applies to (``TORCHELASTIC_RESTART_COUNT``, default 0).

    Sites: ``update`` (between an update's backward and its metrics' all-reduce), ``collective`` (before a
    data-parallel collective), ``weight_sync``, ``checkpoint_save`` (after the first role's shards are
    written), ``export`` (the megatron copy is written; rank 0 converts it, the others wait for it), and
    ``enter-<phase>`` at the start of any phase (``enter-rollout``, ``enter-actor_update``, ...)."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if len(parts) < 3 or parts[0] not in FAULT_KINDS:
            raise ValueError(f"{FAULT_ENV}: {item!r} is not kind:site:rank[:step[:restart]] with kind in "
                             f"{FAULT_KINDS}")
        out.append(Fault(parts[0], parts[1], int(parts[2]), int(parts[3]) if len(parts) > 3 and parts[3] else None,
                         int(parts[4]) if len(parts) > 4 else 0))
    return out


_faults: list[Fault] | None = None


def _load() -> list[Fault]:
    global _faults
    if _faults is None:
        _faults = parse_faults(os.environ.get(FAULT_ENV, ""))
    return _faults


def armed() -> bool:
    """Any fault left to inject in this process (cheap: the variable is read once)."""
    return bool(_load())


class InjectedFault(RuntimeError):
    pass


def fault_point(site: str) -> None:
    """A place where a test can make this rank fail (``RLHF_FAULT_INJECT``); free when the variable is unset."""
    faults = _load()
    if not faults:
        return
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("SLURM_PROCID", 0))))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    now = rank_state.current_phase()
    for f in faults:
        if f.site == site and f.rank == rank and f.restart == restart and f.step in (None, now[1]):
            faults.remove(f)
            log.warning("fault injection: %s at %s in %s on rank %d", f.kind, site, rank_state.where(now), rank)
            rank_state.emit(f"fault injection: {f.kind} at {site} in {rank_state.where(now)} on rank {rank}")
            dog = rank_state.running_watchdog()
            if dog is not None and f.kind in ("kill", "stop"):  # as if the fault came a moment into the phase:
                deadline = time.monotonic() + 2.0               # its heartbeat names the phase
                while dog.published != rank_state.current_phase() and time.monotonic() < deadline:
                    dog.wake.set()
                    time.sleep(0.01)
            if f.kind == "raise":
                raise InjectedFault(f"injected fault at {site}")
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if f.kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if f.kind == "hang":
                threading.Event().wait()
            if f.kind == "pause":
                time.sleep(PAUSE_S)
