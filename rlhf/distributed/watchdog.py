"""A job that never hangs: one rank's death, stall or lost launcher ends the job within ``--dist_timeout_s``, with
one line naming the rank and the phase it was in.

What the distributed stack sees by itself, and what this module adds (docs/reliability.md has the measured times):

- **A rank that exits** (an exception, SIGKILL, the OOM killer). torchrun's worker monitor (0.1 s) stops the
  other ranks (mpirun and srun do the same), and a peer blocked in a gloo collective gets "connection closed" at
  once. Here: the failing rank's exception becomes one ``error:`` line naming its rank, phase and step
  (``failure_line``), and every rank leaves through ``os._exit`` once it has failed, so interpreter teardown
  (gloo's threads, vLLM) cannot hang a dying job.
- **A rank that stops answering** (SIGSTOP, a hung device, a livelock). Its peers' collectives time out after
  the process-group timeout, which is ``--dist_timeout_s`` for the default group and megatron's groups
  (``rlhf.distributed.mesh``); NCCL's own watchdog aborts on CUDA (``TORCH_NCCL_ASYNC_ERROR_HANDLING``). A peer
  that is not inside a collective (local work, a file-system wait, a rank-0-only phase) sees nothing. Here: each
  rank's ``Watchdog`` thread publishes a heartbeat (its phase and step) to the job's rendezvous store and watches
  two neighbours' (ranks r+1 and r+2, so the store serves O(world) requests however large the job). A neighbour
  whose heartbeat has not moved for ``--dist_timeout_s`` ends the job: one line naming it, its last phase and
  step; the stalled process is killed if it runs on this host (torchrun would wait 30 s for a stopped process to
  answer its SIGTERM), then this rank exits.
- **A rank whose launcher is gone** (torchrun or mpirun killed). Nothing in the stack ends it: a worker whose
  parent died and whose peers are gone waits in its next collective until the timeout, or forever in a
  checkpoint writer that was forked from it. Here: every rank, and every child forked from a rank's main thread
  (dist_checkpointing's writers), gets ``PR_SET_PDEATHSIG = SIGKILL`` (Linux), and the watchdog also checks that
  its parent is still the one it started with.

Phases are set by the loops (``phase("update")``, ``set_step(k)``); the PPO phase timer sets them too. The modules
below this one: ``rank_state`` (the phase, the step, whether the rank is failing), ``heartbeat`` (the ``Watchdog``
thread), ``failures`` (a failing rank's report and exit) and ``faults`` (fault injection for the tests,
``RLHF_FAULT_INJECT``, so the tested path is the one a real fault takes). This one starts and stops them.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
from typing import Iterator

from rlhf.distributed import failures, faults, rank_state
from rlhf.distributed.heartbeat import DIAGNOSE_SLACK_S, DONE, EXIT_PEER_LOST, Watchdog, WatchdogConfig, host_id
from rlhf.distributed.rank_state import current_phase, set_step, watchdog_running

__all__ = ["DEFAULT_TIMEOUT_S", "DIAGNOSE_SLACK_S", "DONE", "EXIT_PEER_LOST", "WATCHDOG_ENV", "Watchdog",
           "WatchdogConfig", "current_phase", "default_timeout_s", "finish_watchdog", "host_id", "long_barrier",
           "phase", "resolve_timeout_s", "set_phase", "set_step", "start_watchdog", "watchdog_running"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = {"cuda": 300.0, "cpu": 180.0}
"""``--dist_timeout_s`` when not given. A collective that waits longer than this for a peer ends the job, so the
value bounds the longest legitimate wait of one rank for another (an uneven rollout, rank 0 alone writing a
manifest): a few minutes on CUDA, shorter on CPU, where the tested jobs are small. Long rank-0-only work (the HF
export's conversion) waits in ``long_barrier``, which the heartbeats guard instead."""

WATCHDOG_ENV = "RLHF_WATCHDOG"
"""``RLHF_WATCHDOG=0`` turns the heartbeats, the parent-death signal and the SIGTERM report off (the tests' negative
controls; process-group timeouts stay)."""


# ------------------------------------------------------------------------------------------------ phases
def set_phase(name: str) -> None:
    """What this rank is doing now (``rollout``, ``update``, ``checkpoint_save``, ...): reported with any failure
    and published in the next heartbeat (the watchdog thread is woken for it; the main thread never waits)."""
    rank_state.set_phase_name(name)
    dog = rank_state.running_watchdog()
    if dog is not None:
        dog.wake.set()
    if faults.armed():
        faults.fault_point("enter-" + name)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """``set_phase(name)`` for the block, then the enclosing phase again. An exception leaves the phase as it was
    where it was raised: the failure is reported in the innermost phase."""
    prev = current_phase()[0]
    set_phase(name)
    yield
    set_phase(prev)


def default_timeout_s(device_type: str) -> float:
    return DEFAULT_TIMEOUT_S["cuda" if device_type == "cuda" else "cpu"]


def resolve_timeout_s(value: float | None, device_type: str) -> float:
    """``--dist_timeout_s`` (validated) or its default for the device."""
    if value is None:
        return default_timeout_s(device_type)
    if not value > 0:
        raise ValueError(f"--dist_timeout_s must be > 0, got {value}")
    return float(value)


def start_watchdog(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> None:
    """Heartbeats for a job of more than one rank (after the process group is up), and for every launched rank,
    one-rank jobs included, a parent-death signal (it dies with its launcher). The store is the job's own
    rendezvous store (torchrun's agent hosts it; under mpirun/srun rank 0's process group does), reached by a
    connection of its own, so that the main thread's store calls never delay a heartbeat. Without a store
    the watchdog is off, logged once."""
    if rank_state.running_watchdog() is not None:
        return
    if os.environ.get(WATCHDOG_ENV, "1") == "0":
        if rank == 0:
            log.warning("watchdog off (%s=0): a stalled rank ends the job only at a collective's timeout, a rank whose "
                        "launcher died lives on", WATCHDOG_ENV)
        return
    import torch.distributed as dist

    from rlhf.distributed.parent_death import die_with_parent

    # Every launched rank dies with its launcher, a job's only rank too: it has no neighbour whose heartbeat would
    # notice, and nothing else ends it when torchrun is killed.
    die_with_parent()
    if world_size < 2:
        return
    cfg = WatchdogConfig.for_timeout(timeout_s)
    try:
        store = dist.TCPStore(master_addr, master_port, world_size=None, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        run = os.environ.get("TORCHELASTIC_RUN_ID", "job")
        store = dist.PrefixStore(f"rlhf_watchdog/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
                                 store)
    except Exception as e:
        log.warning("watchdog off: cannot reach the rendezvous store at %s:%d (%s); a stalled rank ends the job "
                    "only at a collective's timeout", master_addr, master_port, e)
        return
    dog = Watchdog(rank, world_size, store, cfg)
    rank_state.set_running_watchdog(dog)
    dog.beat()
    dog.start()
    global _fork_hooked
    if not _fork_hooked:  # a forked child has no heartbeat thread; the store connection and SIGTERM are the rank's
        _fork_hooked = True
        os.register_at_fork(after_in_child=_forget_in_child)
    import atexit

    atexit.register(finish_watchdog)  # a rank whose interpreter ends normally is done, not dead
    if threading.current_thread() is threading.main_thread():
        failures.watch_sigterm(rank)
    if rank == 0:
        log.info("watchdog: --dist_timeout_s %g (collectives, and heartbeats every %.1f s to neighbours r+1, r+2)",
                 timeout_s, cfg.interval_s)


_fork_hooked = False


def _forget_in_child() -> None:
    rank_state.set_running_watchdog(None)
    failures.release_in_forked_child()


def finish_watchdog() -> None:
    """The end of a job that went well: stop the heartbeats and publish that this rank is done, so that its
    neighbours do not take its exit for a death. Idempotent."""
    wd = rank_state.running_watchdog()
    rank_state.set_running_watchdog(None)
    if wd is None:
        return
    wd.stopped.set()
    wd.wake.set()
    if wd is not threading.current_thread():
        wd.join(timeout=2 * wd.cfg.interval_s + 1)
    rank_state.set_phase_name(DONE)
    try:
        wd.beat()
    except Exception:  # the store went first (its host finished): the neighbours are finishing too
        pass


def long_barrier(hours: float = 6.0) -> None:
    """A barrier for rank-0-only work that may outlast ``--dist_timeout_s`` (the HF export's conversion of a large
    model): gloo's ``monitored_barrier`` with a long timeout of its own. A peer that dies closes its connection
    at once, and one that stalls is caught by the heartbeats, so the long timeout bounds only a livelock."""
    import torch.distributed as dist

    timeout = datetime.timedelta(hours=hours)
    dist.monitored_barrier(group=_gloo_group(), timeout=timeout, wait_all_ranks=True)


_GLOO_GROUP: list = []


def _gloo_group():
    """The group ``monitored_barrier`` runs on: the default group where it is gloo alone (a CPU job), else a gloo group
    of every rank made once (a CUDA job's default group is ``cpu:gloo,cuda:nccl``, which torch's
    ``monitored_barrier`` refuses: "only implemented for GLOO backend", first seen on an H200). Every rank reaches
    ``long_barrier`` at the same point, so the ``new_group`` collective is entered by all of them."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    if not _GLOO_GROUP or _GLOO_GROUP[0][0] is not dist.group.WORLD:
        _GLOO_GROUP[:] = [(dist.group.WORLD, dist.new_group(backend="gloo"))]
    return _GLOO_GROUP[0][1]
