"""What this rank is doing (its phase and step), whether it is failing, and its running heartbeat thread: the
state that the heartbeat (``rlhf.distributed.heartbeat``), a failing rank's report (``rlhf.distributed.failures``)
and the fault points (``rlhf.distributed.faults``) read. It imports none of them. The loops set the phase through
``rlhf.distributed.watchdog.set_phase``, which also wakes the heartbeat and fires the phase's fault point."""
from __future__ import annotations

import sys
import threading
from typing import Any

_phase: tuple[str, int | None] = ("setup", None)
_watchdog: Any = None
"""The running heartbeat thread (``rlhf.distributed.heartbeat.Watchdog``), or None."""
failed = threading.Event()
"""Set once this rank has failed (or a peer's failure ends it): whoever reports first reports alone."""


def set_phase_name(name: str) -> None:
    """The phase part of the state alone (``rlhf.distributed.watchdog.set_phase`` is what the loops call)."""
    global _phase
    _phase = (name, _phase[1])


def set_step(step: int | None) -> None:
    """The step being computed (1-based, as the progress lines count)."""
    global _phase
    _phase = (_phase[0], step)


def current_phase() -> tuple[str, int | None]:
    return _phase


def where(p: tuple[str, int | None]) -> str:
    return f"phase '{p[0]}'" + (f" (step {p[1]})" if p[1] is not None else "")


def running_watchdog() -> Any:
    """The running heartbeat thread, or None."""
    return _watchdog


def set_running_watchdog(dog: Any) -> None:
    global _watchdog
    _watchdog = dog


def watchdog_running() -> bool:
    return _watchdog is not None


def emit(line: str) -> None:
    """One line to stderr (every rank's stderr reaches the launcher's), flushed before a hard exit."""
    try:
        sys.stdout.flush()
    except Exception:
        pass
    print(line, file=sys.stderr, flush=True)
