"""A rank dies with its launcher: ``PR_SET_PDEATHSIG = SIGKILL`` (Linux) for every rank and for every child forked by
a rank's main thread (dist_checkpointing's writers), and for the subprocesses a rank starts that ask for it (the HF
export's converter, through ``DIE_WITH_PARENT_ENV``). A worker whose torchrun or mpirun was killed otherwise waits
in its next collective until the timeout, or forever in a checkpoint writer forked from it."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

EXIT_ORPHAN = 75
"""Exit code of a rank (or forked child) that found its parent already gone."""
_PR_SET_PDEATHSIG = 1
_fork_from_main = False


DIE_WITH_PARENT_ENV = "RLHF_DIE_WITH_PARENT"
"""Set for the subprocesses a rank starts (the HF export's converter), which call ``die_with_parent_if_asked``."""


def die_with_parent_if_asked() -> None:
    """At the start of a tool a rank runs as a subprocess: die with that rank (``DIE_WITH_PARENT_ENV``)."""
    if os.environ.get(DIE_WITH_PARENT_ENV) == "1":
        die_with_parent()


def _set_pdeathsig() -> bool:
    """SIGKILL this process when its parent (the thread that forked it) dies. Linux only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _before_fork() -> None:
    global _fork_from_main
    _fork_from_main = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    # Only a child forked by the main thread: PDEATHSIG fires when the forking *thread* ends, and the main thread
    # lives as long as the rank. (dist_checkpointing forks its writers from the main thread.)
    if _fork_from_main and _set_pdeathsig() and os.getppid() == 1:
        os._exit(EXIT_ORPHAN)  # the parent died before the signal was armed


_guarded = False


def die_with_parent() -> None:
    """Arm parent-death SIGKILL for this rank and for the children its main thread forks. Idempotent."""
    global _guarded
    if _guarded:
        return
    _guarded = True
    parent = os.getppid()
    if not _set_pdeathsig():
        log.info("watchdog: PR_SET_PDEATHSIG is not available here; a rank whose launcher dies ends at its next "
                 "collective's timeout or at the watchdog's parent check")
        return
    if parent == 1 or os.getppid() != parent:
        os._exit(EXIT_ORPHAN)
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
