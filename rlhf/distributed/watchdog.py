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

Phases are set by the loops (``phase("update")``, ``set_step(k)``); the PPO phase timer sets them too. A failing
rank's report and exit are ``rlhf.distributed.failures``; fault injection for the tests (``RLHF_FAULT_INJECT``) is
``rlhf.distributed.faults``, so the tested path is the one a real fault takes.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Iterator

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = {"cuda": 300.0, "cpu": 180.0}
"""``--dist_timeout_s`` when not given. A collective that waits longer than this for a peer ends the job, so the
value bounds the longest legitimate wait of one rank for another (an uneven rollout, rank 0 alone writing a
manifest): a few minutes on CUDA, shorter on CPU, where the tested jobs are small. Long rank-0-only work (the HF
export's conversion) waits in ``long_barrier``, which the heartbeats guard instead."""

WATCHDOG_ENV = "RLHF_WATCHDOG"
"""``RLHF_WATCHDOG=0`` turns the heartbeats, the parent-death signal and the SIGTERM report off (the tests' negative
controls; process-group timeouts stay)."""

EXIT_PEER_LOST = 75
"""Exit code of a rank that ended the job because a peer died, stalled, or its launcher went away."""

DONE = "done"
"""The phase a rank publishes when it ends normally (``finish_watchdog``)."""

DIAGNOSE_SLACK_S = 1.0
"""How much longer than its own wait a failing rank gives the store to say what its peers did."""

_phase: tuple[str, int | None] = ("setup", None)
_watchdog: "Watchdog | None" = None
_failed = threading.Event()


# ------------------------------------------------------------------------------------------------ phases
def set_phase(name: str) -> None:
    """What this rank is doing now (``rollout``, ``update``, ``checkpoint_save``, ...): reported with any failure
    and published in the next heartbeat (the watchdog thread is woken for it; the main thread never waits)."""
    global _phase
    _phase = (name, _phase[1])
    wd = _watchdog
    if wd is not None:
        wd.wake.set()
    from rlhf.distributed import faults

    if faults.armed():
        faults.fault_point("enter-" + name)


def set_step(step: int | None) -> None:
    """The step being computed (1-based, as the progress lines count)."""
    global _phase
    _phase = (_phase[0], step)


def current_phase() -> tuple[str, int | None]:
    return _phase


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """``set_phase(name)`` for the block, then the enclosing phase again. An exception leaves the phase as it was
    where it was raised: the failure is reported in the innermost phase."""
    prev = _phase[0]
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


def _where(p: tuple[str, int | None]) -> str:
    return f"phase '{p[0]}'" + (f" (step {p[1]})" if p[1] is not None else "")


# ------------------------------------------------------------------------------------------------ heartbeats
def host_id() -> str:
    """This host: hostname and boot id (two containers may share a hostname, not a boot id and a hostname)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class WatchdogConfig:
    timeout_s: float
    """a watched neighbour silent this long ends the job (``--dist_timeout_s``)"""
    interval_s: float
    """heartbeat period"""
    neighbours: int = 2
    """each rank watches ranks r+1 .. r+neighbours (mod world)"""

    @classmethod
    def for_timeout(cls, timeout_s: float) -> "WatchdogConfig":
        return cls(timeout_s=timeout_s, interval_s=min(2.0, max(0.2, timeout_s / 20)))


def _proc_start_time(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # gone, or psutil missing
        return None


class Watchdog(threading.Thread):
    """The heartbeat thread of one rank (see the module docstring). ``start_watchdog`` builds it."""

    def __init__(self, rank: int, world_size: int, store, cfg: WatchdogConfig):
        super().__init__(name="rlhf-watchdog", daemon=True)
        self.rank, self.world, self.store, self.cfg = rank, world_size, store, cfg
        self.watched = sorted({(rank + i) % world_size for i in range(1, cfg.neighbours + 1)} - {rank})
        self.parent = os.getppid()
        self.host = host_id()
        self.me = {"pid": os.getpid(), "host": self.host, "ctime": _proc_start_time(os.getpid())}
        self.seq = 0
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (last seq, monotonic time it changed)
        self.last: dict[int, dict] = {}  # rank -> last heartbeat read
        self.gone: dict[int, float] = {}  # rank -> when its process was first seen gone (this host)
        self.stopped = threading.Event()
        self.wake = threading.Event()
        self.published: tuple[str, int | None] | None = None
        self.started_at = time.monotonic()

    def key(self, rank: int) -> str:
        return f"hb/{rank}"

    def beat(self) -> None:
        self.seq += 1
        now = _phase
        self.store.set(self.key(self.rank), json.dumps({"seq": self.seq, "phase": now[0], "step": now[1], **self.me}))
        self.published = now

    def read(self, rank: int) -> dict | None:
        k = self.key(rank)
        if not self.store.check([k]):
            return None
        return json.loads(self.store.get(k))

    def run(self) -> None:
        store_failing_since = None
        next_check = time.monotonic() + self.cfg.interval_s
        while not self.stopped.is_set():
            woke = self.wake.wait(max(0.0, next_check - time.monotonic()))
            self.wake.clear()
            if self.stopped.is_set():
                return
            if woke and time.monotonic() < next_check:  # a phase change: publish it, check on schedule
                try:
                    self.beat()
                except Exception:
                    pass
                continue
            next_check = time.monotonic() + self.cfg.interval_s
            try:
                problem = self.check()
                store_failing_since = None
            except Exception as e:  # the store is gone or does not answer: its host died or stalled
                if self.stopped.is_set():
                    return
                # Under mpirun/srun rank 0's process hosts the store, and a rank that finishes first takes it
                # with it: the others have a timeout's worth of time to finish before this counts as a failure.
                now = time.monotonic()
                store_failing_since = store_failing_since or now
                problem = None
                if now - store_failing_since > self.cfg.timeout_s:
                    problem = (f"the job's rendezvous store has not answered for {now - store_failing_since:.0f} s "
                               f"({type(e).__name__}: {str(e)[:200]}); its host (the launcher, or rank 0 under "
                               "mpirun/srun) is gone or stalled", None)
            if problem is not None and not self.stopped.is_set():
                self.end_job(*problem)
                return

    def check(self) -> tuple[str, dict | None] | None:
        """One tick: publish, then look at the parent and the watched neighbours. Returns (what is wrong, the
        stalled peer's heartbeat) or None."""
        if os.getppid() != self.parent:
            return f"its launcher (pid {self.parent}) is gone", None
        self.beat()
        now = time.monotonic()
        for r in self.watched:
            hb = self.read(r)
            if hb is None:
                if now - self.started_at > self.cfg.timeout_s:
                    return f"rank {r} never published a heartbeat in {self.cfg.timeout_s:g} s", None
                continue
            self.last[r] = hb
            if hb["phase"] == DONE:  # finished normally: nothing more to watch there
                continue
            seq, since = self.seen.get(r, (-1, now))
            if hb["seq"] != seq:
                self.seen[r] = (hb["seq"], now)
                continue
            if hb["host"] == self.host and not _alive(hb):
                # A rank that ends without publishing 'done' (a worker leaving through os._exit, or one whose
                # interpreter is being torn down) is gone a moment before this rank ends the same way: a death
                # counts once it has lasted a second.
                first = self.gone.setdefault(r, now)
                if now - first >= 1.0:
                    return f"rank {r} (pid {hb['pid']}) died in {_where((hb['phase'], hb['step']))}", None
                continue
            if now - since > self.cfg.timeout_s:
                return (f"rank {r} has not answered for {now - since:.0f} s (--dist_timeout_s "
                        f"{self.cfg.timeout_s:g}); it was last in {_where((hb['phase'], hb['step']))}", hb)
        return None

    def end_job(self, what: str, stalled: dict | None) -> None:
        if _failed.is_set():  # the main thread is already reporting (and exiting)
            return
        _failed.set()
        line = f"error: rank {self.rank}: {what}; ending the job (this rank was in {_where(_phase)})"
        if stalled is not None and _kill_if_local(stalled, self.host):
            line += f"; killed the stalled process (pid {stalled['pid']}) on this host"
        _emit(line)
        os._exit(EXIT_PEER_LOST)

    def diagnose(self, wait_s: float = 0.0) -> tuple[str, list[dict]]:
        """What the heartbeats say about the peers, for a failure of the main thread: peers on this host that
        died, and watched peers silent for more than four heartbeat periods (returned too: a stopped process
        would hold up the launcher's teardown). Empty if nothing is known. ``wait_s``: a peer's closed
        connection can arrive a moment before its process is gone; look again until something is found.

        Never longer than ``wait_s + DIAGNOSE_SLACK_S``: the store is read from a thread of its own, since a
        store call can block (its host stalled, or a connection that another process wrote to), and a dying
        rank must not wait on it (a rank that did waited out torchrun's 30 s before its SIGKILL)."""
        found: list[tuple[str, list[dict]]] = []

        def look() -> None:
            deadline = time.monotonic() + wait_s
            while True:
                got = self._diagnose()
                if got[0] or time.monotonic() >= deadline:
                    found.append(got)
                    return
                time.sleep(0.05)

        t = threading.Thread(target=look, name="rlhf-diagnose", daemon=True)
        t.start()
        t.join(wait_s + DIAGNOSE_SLACK_S)
        if found:
            return found[0]
        return f"the job's store did not answer in {wait_s + DIAGNOSE_SLACK_S:g} s; peers unknown", []

    def _diagnose(self) -> tuple[str, list[dict]]:
        out, silent = [], []
        try:
            for r in range(self.world):
                if r == self.rank:
                    continue
                hb = self.read(r)
                if hb is None or hb["phase"] == DONE:
                    continue
                if hb["host"] == self.host and not _alive(hb):
                    out.append(f"rank {r} (pid {hb['pid']}) died in {_where((hb['phase'], hb['step']))}")
                elif r in self.seen and hb["seq"] == self.seen[r][0] \
                        and time.monotonic() - self.seen[r][1] > 4 * self.cfg.interval_s:
                    out.append(f"rank {r} silent for {time.monotonic() - self.seen[r][1]:.0f} s since "
                               f"{_where((hb['phase'], hb['step']))}")
                    silent.append(hb)
        except Exception:
            pass
        return "; ".join(out), silent


def _kill_if_local(hb: dict, host: str) -> bool:
    """SIGKILL the process of heartbeat ``hb`` if it runs on ``host`` and is still the same process."""
    if hb["host"] != host or not _alive(hb):
        return False
    try:  # a stopped process answers neither SIGTERM nor its peers: torchrun would wait 30 s for it
        os.kill(hb["pid"], signal.SIGKILL)
        return True
    except OSError:
        return False


def _alive(hb: dict) -> bool:
    """The heartbeat's process still runs (not gone, not a zombie, not another process with its pid)."""
    try:
        import psutil

        p = psutil.Process(hb["pid"])
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return hb.get("ctime") is None or abs(p.create_time() - hb["ctime"]) < 1e-3
    except Exception:  # gone, or psutil missing
        return False


def _emit(line: str) -> None:
    """One line to stderr (every rank's stderr reaches the launcher's), flushed before a hard exit."""
    try:
        sys.stdout.flush()
    except Exception:
        pass
    print(line, file=sys.stderr, flush=True)


def start_watchdog(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> None:
    """Heartbeats for a job of more than one rank (after the process group is up), and for every launched rank,
    one-rank jobs included, a parent-death signal (it dies with its launcher). The store is the job's own
    rendezvous store (torchrun's agent hosts it; under mpirun/srun rank 0's process group does), reached by a
    connection of its own, so that the main thread's store calls never delay a heartbeat. Without a store
    the watchdog is off, logged once."""
    global _watchdog
    if _watchdog is not None:
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
    _watchdog = Watchdog(rank, world_size, store, cfg)
    _watchdog.beat()
    _watchdog.start()
    global _fork_hooked
    if not _fork_hooked:  # a forked child has no heartbeat thread; the store connection and SIGTERM are the rank's
        _fork_hooked = True
        os.register_at_fork(after_in_child=_forget_in_child)
    import atexit

    atexit.register(finish_watchdog)  # a rank whose interpreter ends normally is done, not dead
    if threading.current_thread() is threading.main_thread():
        from rlhf.distributed.failures import watch_sigterm

        watch_sigterm(rank)
    if rank == 0:
        log.info("watchdog: --dist_timeout_s %g (collectives, and heartbeats every %.1f s to neighbours r+1, r+2)",
                 timeout_s, cfg.interval_s)


_fork_hooked = False


def _forget_in_child() -> None:
    global _watchdog
    _watchdog = None
    from rlhf.distributed import failures

    failures.release_in_forked_child()


def finish_watchdog() -> None:
    """The end of a job that went well: stop the heartbeats and publish that this rank is done, so that its
    neighbours do not take its exit for a death. Idempotent."""
    global _watchdog, _phase
    wd, _watchdog = _watchdog, None
    if wd is None:
        return
    wd.stopped.set()
    wd.wake.set()
    if wd is not threading.current_thread():
        wd.join(timeout=2 * wd.cfg.interval_s + 1)
    _phase = (DONE, _phase[1])
    try:
        wd.beat()
    except Exception:  # the store went first (its host finished): the neighbours are finishing too
        pass


def long_barrier(hours: float = 6.0) -> None:
    """A barrier for rank-0-only work that may outlast ``--dist_timeout_s`` (the HF export's conversion of a large
    model): gloo's ``monitored_barrier`` with a long timeout of its own. A peer that dies closes its connection
    at once, and one that stalls is caught by the heartbeats, so the long timeout bounds only a livelock."""
    import torch.distributed as dist

    dist.monitored_barrier(timeout=datetime.timedelta(hours=hours), wait_all_ranks=True)


def watchdog_running() -> bool:
    return _watchdog is not None
