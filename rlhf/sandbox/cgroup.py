"""One cgroup (v1: ``pids``, ``memory``, ``freezer``) per sandboxed run: a process and thread count limit, a memory
limit (swap included where ``memory.memsw`` exists), and a race-free kill of everything in it (frozen first, so that
nothing forks between the listing and the kill). Root and writable hierarchies under ``/sys/fs/cgroup`` are needed;
``available()`` says whether this machine has them. Standard library only."""
from __future__ import annotations

import os
import signal
import time
import uuid

ROOT = "/sys/fs/cgroup"
PARENT = "rlhf-sandbox"
CONTROLLERS = ("pids", "memory", "freezer")


def available(root: str = ROOT) -> str:
    """"" when a run's cgroup can be made here, else why not (the reason the sandbox names)."""
    for c in CONTROLLERS:
        d = os.path.join(root, c)
        if not os.path.isdir(d):
            return f"no cgroup v1 '{c}' hierarchy at {d}"
        if not os.access(d, os.W_OK):
            return f"{d} is not writable (cgroups need root)"
    return ""


class RunCgroup:
    """``pids.max`` = ``max_pids`` (threads count too), ``memory.limit_in_bytes`` (and ``memsw``) = ``memory_bytes``.
    ``procs_file``: where a launcher writes its own pid to join (one per controller: ``join_paths``)."""

    def __init__(self, max_pids: int, memory_bytes: int, root: str = ROOT):
        self.root, self.name = root, f"{PARENT}/{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.dirs = {c: os.path.join(root, c, self.name) for c in CONTROLLERS}
        for d in self.dirs.values():
            os.makedirs(d, exist_ok=False)
        _write(os.path.join(self.dirs["pids"], "pids.max"), str(max_pids))
        mem = self.dirs["memory"]
        _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
        self.memsw = os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes"))
        if self.memsw:
            _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))

    def join_paths(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def pids(self) -> list[int]:
        with open(os.path.join(self.dirs["pids"], "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]

    def oom_killed(self) -> bool:
        """The memory limit killed a process of the run (``oom_kill`` of ``memory.oom_control``, Linux >= 4.13;
        else the limit's failure count)."""
        mem = self.dirs["memory"]
        try:
            for line in open(os.path.join(mem, "memory.oom_control")):
                if line.startswith("oom_kill "):
                    return int(line.split()[1]) > 0
            return int(open(os.path.join(mem, "memory.failcnt")).read()) > 0
        except OSError:
            return False

    def peak_bytes(self) -> int:
        try:
            return int(open(os.path.join(self.dirs["memory"], "memory.max_usage_in_bytes")).read())
        except OSError:
            return 0

    def kill_all(self, timeout: float = 10.0) -> list[int]:
        """SIGKILL every process of the run: frozen first (nothing forks in between), killed, thawed (a frozen
        process dies only once thawed), until the cgroup is empty. Returns the pids killed."""
        freezer = os.path.join(self.dirs["freezer"], "freezer.state")
        killed: list[int] = []
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return killed
            if time.monotonic() > deadline:
                raise RuntimeError(f"sandbox: processes {pids} of {self.name} survived SIGKILL for {timeout:g} s")
            _write(freezer, "FROZEN")
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            _write(freezer, "THAWED")
            time.sleep(0.01)

    def remove(self) -> None:
        """Kill what is left and remove the run's cgroups (they must be empty)."""
        self.kill_all()
        for d in self.dirs.values():
            for _ in range(100):  # the kernel drops the last task asynchronously after it is reaped
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)
