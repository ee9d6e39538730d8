"""The heartbeat thread of one rank (``Watchdog``): it publishes this rank's phase and step to the job's store and
watches two neighbours', ending the job when one stalls, dies or loses its launcher. ``rlhf.distributed.watchdog``
starts and stops it; the module docstring there says what it adds to the distributed stack."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass

from rlhf.distributed import rank_state

EXIT_PEER_LOST = 75
"""Exit code of a rank that ended the job because a peer died, stalled, or its launcher went away."""

DONE = "done"
"""The phase a rank publishes when it ends normally (``finish_watchdog``)."""

DIAGNOSE_SLACK_S = 1.0
"""How much longer than its own wait a failing rank gives the store to say what its peers did."""


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
    """The heartbeat thread of one rank (``rlhf.distributed.watchdog``'s docstring says what it does).
    ``start_watchdog`` builds it."""

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
        now = rank_state.current_phase()
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
                    return f"rank {r} (pid {hb['pid']}) died in {rank_state.where((hb['phase'], hb['step']))}", None
                continue
            if now - since > self.cfg.timeout_s:
                return (f"rank {r} has not answered for {now - since:.0f} s (--dist_timeout_s "
                        f"{self.cfg.timeout_s:g}); it was last in {rank_state.where((hb['phase'], hb['step']))}", hb)
        return None

    def end_job(self, what: str, stalled: dict | None) -> None:
        if rank_state.failed.is_set():  # the main thread is already reporting (and exiting)
            return
        rank_state.failed.set()
        line = (f"error: rank {self.rank}: {what}; ending the job (this rank was in "
                f"{rank_state.where(rank_state.current_phase())})")
        if stalled is not None and kill_if_local(stalled, self.host):
            line += f"; killed the stalled process (pid {stalled['pid']}) on this host"
        rank_state.emit(line)
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
                    out.append(f"rank {r} (pid {hb['pid']}) died in {rank_state.where((hb['phase'], hb['step']))}")
                elif r in self.seen and hb["seq"] == self.seen[r][0] \
                        and time.monotonic() - self.seen[r][1] > 4 * self.cfg.interval_s:
                    out.append(f"rank {r} silent for {time.monotonic() - self.seen[r][1]:.0f} s since "
                               f"{rank_state.where((hb['phase'], hb['step']))}")
                    silent.append(hb)
        except Exception:
            pass
        return "; ".join(out), silent


def kill_if_local(hb: dict, host: str) -> bool:
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
