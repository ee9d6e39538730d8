"""One cgroup per sandboxed run: a bound on its processes and threads, on its memory (swap included), on its CPU rate;
its CPU time and OOM kills counted; everything in it killed at the end. Standard library only.

* ``V1Cgroup``: cgroup v1 (``pids``, ``memory``, ``freezer`` required; ``cpu`` and ``cpuacct`` where mounted) under
  ``/sys/fs/cgroup/<controller>/rlhf-sandbox/``; the kill freezes the run first, so that nothing forks between the
  listing and the kill.
* ``V2Cgroup``: cgroup v2 (``pids.max``, ``memory.max``, ``memory.swap.max``, ``cpu.max``, ``cgroup.kill``, OOM kills
  from ``memory.events``) under a folder this process may write: ``/sys/fs/cgroup`` on a cgroup-v2 host run as
  root, or the delegated subtree named by ``RLHF_SANDBOX_CGROUP``. A controller the subtree does not have is a bound
  named missing (``missing``), never a silent one.
* ``UidAccounting``: no cgroup at all (``--allow_weaker``): the run's processes found by its own host uid
  (``rlhf.sandbox.uids``), their CPU time summed from /proc, all killed at the end; processes and memory are then
  bounded by rlimits only.

``select()`` picks the backend: ``RLHF_SANDBOX_CGROUP`` = ``v1``, ``v2``, ``none`` or a v2 folder; else v2 where
``/sys/fs/cgroup`` is a cgroup-v2 mount, v1 where the v1 hierarchies are."""
from __future__ import annotations

import os
import signal
import time
import uuid

ROOT = "/sys/fs/cgroup"
PARENT = "rlhf-sandbox"
V1_REQUIRED = ("pids", "memory", "freezer")
V1_OPTIONAL = ("cpu", "cpuacct")
CPU_PERIOD_US = 100_000


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _rmdir(d: str) -> None:
    for _ in range(200):  # the kernel drops the last task asynchronously after it is reaped
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005)


class RunCgroup:
    """The interface both cgroup versions and ``UidAccounting`` give the sandbox."""

    kind = ""
    missing: tuple[str, ...] = ()
    """bounds this backend could not set (named in the result's ``isolation``)"""

    def join_paths(self) -> list[str]:
        """``cgroup.procs`` files a launcher writes its own pid to, to join (empty: nothing to join)."""
        return []

    def pids(self) -> list[int]:
        raise NotImplementedError

    def oom_kills(self) -> int | None:
        """OOM kills in the run so far (None: this backend cannot tell)."""
        return None

    def cpu_seconds(self) -> float:
        """CPU time the run's processes used so far (ended ones included)."""
        raise NotImplementedError

    def kill_all(self) -> list[int]:
        raise NotImplementedError

    def remove(self) -> None:
        self.kill_all()

    def describe(self) -> str:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------------- v1
def v1_available(root: str = ROOT) -> str:
    """"" when a v1 run cgroup can be made here, else why not."""
    for c in V1_REQUIRED:
        d = os.path.join(root, c)
        if not os.path.isdir(d) or os.path.exists(os.path.join(d, "cgroup.controllers")):
            return f"no cgroup v1 '{c}' hierarchy at {d}"
        if not os.access(d, os.W_OK):
            return f"{d} is not writable (cgroups need root)"
    return ""


class V1Cgroup(RunCgroup):
    """``pids.max`` = ``max_pids`` (threads count too), ``memory.limit_in_bytes`` (and ``memsw``) = ``memory_bytes``,
    ``cpu.cfs_quota_us`` = ``cpus`` cores (where the ``cpu`` controller is mounted)."""

    kind = "v1"

    def __init__(self, max_pids: int, memory_bytes: int, cpus: float, root: str = ROOT):
        self.name = f"{PARENT}/{os.getpid()}-{uuid.uuid4().hex[:10]}"
        present = list(V1_REQUIRED) + [c for c in V1_OPTIONAL if os.path.isdir(os.path.join(root, c))
                                       and os.access(os.path.join(root, c), os.W_OK)]
        self.dirs: dict[str, str] = {}
        real: dict[str, str] = {}  # cpu and cpuacct are one hierarchy on many hosts (cpu,cpuacct)
        for c in present:
            base = os.path.realpath(os.path.join(root, c))
            self.dirs[c] = os.path.join(base, self.name)
            real.setdefault(base, self.dirs[c])
        self._made = list(real.values())
        for d in self._made:
            os.makedirs(d, exist_ok=False)
        _write(os.path.join(self.dirs["pids"], "pids.max"), str(max_pids))
        mem = self.dirs["memory"]
        _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
        self.memsw = os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes"))
        if self.memsw:
            _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
        missing = [] if self.memsw else ["swap (memory.memsw: swap accounting is off)"]
        if "cpu" in self.dirs:
            _write(os.path.join(self.dirs["cpu"], "cpu.cfs_period_us"), str(CPU_PERIOD_US))
            _write(os.path.join(self.dirs["cpu"], "cpu.cfs_quota_us"), str(max(int(cpus * CPU_PERIOD_US), 1000)))
        else:
            missing.append("cpu rate (no v1 cpu controller)")
        if "cpuacct" not in self.dirs:
            missing.append("cpu time (no v1 cpuacct controller)")
        self.missing = tuple(missing)
        self.max_pids, self.memory_bytes, self.cpus = max_pids, memory_bytes, cpus

    def join_paths(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self._made]

    def pids(self) -> list[int]:
        return [int(x) for x in _read(os.path.join(self.dirs["pids"], "cgroup.procs")).split()]

    def oom_kills(self) -> int | None:
        """``oom_kill`` of ``memory.oom_control`` (Linux >= 4.13), else the limit's failure count."""
        mem = self.dirs["memory"]
        try:
            for line in _read(os.path.join(mem, "memory.oom_control")).splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
            return int(_read(os.path.join(mem, "memory.failcnt")))
        except OSError:
            return None

    def cpu_seconds(self) -> float:
        if "cpuacct" not in self.dirs:
            return 0.0
        return int(_read(os.path.join(self.dirs["cpuacct"], "cpuacct.usage"))) / 1e9

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
            time.sleep(0.005)

    def remove(self) -> None:
        """Kill what is left and remove the run's cgroups (they must be empty)."""
        self.kill_all()
        for d in self._made:
            _rmdir(d)

    def describe(self) -> str:
        cpu = f", cpu={self.cpus:g} cores" if "cpu" in self.dirs else ""
        return (f"cgroup v1(pids.max={self.max_pids}, memory={self.memory_bytes >> 20}MB"
                f"{' incl. swap' if self.memsw else ''}{cpu})")


# ------------------------------------------------------------------------------------------------------- v2
def v2_root() -> str | None:
    """The cgroup-v2 folder runs are made under: ``RLHF_SANDBOX_CGROUP`` when it names a folder, else
    ``/sys/fs/cgroup`` when that is a v2 mount."""
    env = os.environ.get("RLHF_SANDBOX_CGROUP", "")
    if env.startswith("/"):
        return env
    if os.path.exists(os.path.join(ROOT, "cgroup.controllers")):
        return ROOT
    return None


def v2_available(root: str | None = None) -> str:
    root = root or v2_root()
    if not root or not os.path.exists(os.path.join(root, "cgroup.controllers")):
        return f"no cgroup v2 folder (at {root or ROOT}; RLHF_SANDBOX_CGROUP names a delegated one)"
    if not os.access(root, os.W_OK) or not os.access(os.path.join(root, "cgroup.subtree_control"), os.W_OK):
        return f"{root} is not writable (root, or a subtree delegated to this user, is needed)"
    return ""


class V2Cgroup(RunCgroup):
    kind = "v2"
    CONTROLLERS = ("pids", "memory", "cpu")

    def __init__(self, max_pids: int, memory_bytes: int, cpus: float, root: str | None = None):
        root = root or v2_root()
        why = v2_available(root)
        if why:
            raise OSError(why)
        parent = os.path.join(root, PARENT)
        have = set(_read(os.path.join(root, "cgroup.controllers")).split())
        wanted = [c for c in self.CONTROLLERS if c in have]
        _enable(root, wanted)
        os.makedirs(parent, exist_ok=True)
        wanted = [c for c in wanted if c in _read(os.path.join(parent, "cgroup.controllers")).split()]
        _enable(parent, wanted)
        self.dir = os.path.join(parent, f"{os.getpid()}-{uuid.uuid4().hex[:10]}")
        os.makedirs(self.dir, exist_ok=False)
        self.name = os.path.relpath(self.dir, root)
        on = set(_read(os.path.join(self.dir, "cgroup.controllers")).split())
        missing = []
        if "pids" in on:
            _write(os.path.join(self.dir, "pids.max"), str(max_pids))
        else:
            missing.append("processes (no v2 pids controller in the subtree)")
        if "memory" in on:
            _write(os.path.join(self.dir, "memory.max"), str(memory_bytes))
            if os.path.exists(os.path.join(self.dir, "memory.swap.max")):
                _write(os.path.join(self.dir, "memory.swap.max"), "0")
            else:
                missing.append("swap (memory.swap.max: swap accounting is off)")
        else:
            missing.append("memory (no v2 memory controller in the subtree)")
        if "cpu" in on:
            _write(os.path.join(self.dir, "cpu.max"), f"{max(int(cpus * CPU_PERIOD_US), 1000)} {CPU_PERIOD_US}")
        else:
            missing.append("cpu rate (no v2 cpu controller in the subtree)")
        self.on, self.missing = on, tuple(missing)
        self.max_pids, self.memory_bytes, self.cpus = max_pids, memory_bytes, cpus

    def join_paths(self) -> list[str]:
        return [os.path.join(self.dir, "cgroup.procs")]

    def pids(self) -> list[int]:
        return [int(x) for x in _read(os.path.join(self.dir, "cgroup.procs")).split()]

    def oom_kills(self) -> int | None:
        if "memory" not in self.on:
            return None
        for line in _read(os.path.join(self.dir, "memory.events")).splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def cpu_seconds(self) -> float:
        for line in _read(os.path.join(self.dir, "cpu.stat")).splitlines():  # there without the cpu controller
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
        return 0.0

    def kill_all(self, timeout: float = 10.0) -> list[int]:
        """``cgroup.kill`` (Linux >= 5.14: the kernel kills the whole subtree, forks in flight included), else
        frozen, killed, thawed; until the cgroup is empty."""
        killed: list[int] = []
        kill = os.path.join(self.dir, "cgroup.kill")
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return killed
            if time.monotonic() > deadline:
                raise RuntimeError(f"sandbox: processes {pids} of {self.name} survived SIGKILL for {timeout:g} s")
            killed += pids
            if os.path.exists(kill):
                _write(kill, "1")
            else:
                _write(os.path.join(self.dir, "cgroup.freeze"), "1")
                for pid in self.pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                _write(os.path.join(self.dir, "cgroup.freeze"), "0")
            time.sleep(0.005)

    def remove(self) -> None:
        self.kill_all()
        _rmdir(self.dir)

    def describe(self) -> str:
        parts = []
        if "pids" in self.on:
            parts.append(f"pids.max={self.max_pids}")
        if "memory" in self.on:
            parts.append(f"memory.max={self.memory_bytes >> 20}MB, swap 0")
        if "cpu" in self.on:
            parts.append(f"cpu.max={self.cpus:g} cores")
        return f"cgroup v2({', '.join(parts) or 'no controllers: kill and cpu time only'})"


def _enable(d: str, controllers: list[str]) -> None:
    """Enable ``controllers`` for ``d``'s children (those already on are left as they are)."""
    on = set(_read(os.path.join(d, "cgroup.subtree_control")).split())
    for c in controllers:
        if c not in on:
            try:
                _write(os.path.join(d, "cgroup.subtree_control"), f"+{c}")
            except OSError:  # a folder with processes of its own cannot pass controllers on (v2's rule)
                pass


# ------------------------------------------------------------------------------------------ no cgroup at all
class UidAccounting(RunCgroup):
    """No cgroup: the run is every process of its own host uid."""

    kind = "none"
    missing = ("processes (rlimit only)", "memory (address space per process only)", "cpu rate")

    def __init__(self, uid: int):
        self.uid = uid

    def pids(self) -> list[int]:
        from rlhf.sandbox.uids import processes_of

        return processes_of(self.uid)

    def cpu_seconds(self) -> float:
        """utime + stime of the run's live processes and of the children they reaped (an ended child's time is
        in its parent's cutime/cstime once reaped; the sandbox's init reaps orphans)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in self.pids():
            try:
                fields = _read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()
                total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime (fields 14-17)
            except (OSError, IndexError, ValueError):
                pass
        return total / tick

    def kill_all(self) -> list[int]:
        from rlhf.sandbox.uids import kill_uid

        return kill_uid(self.uid)

    def describe(self) -> str:
        return f"no cgroup(the run's processes by host uid {self.uid})"


# ------------------------------------------------------------------------------------------------- choosing
def backend() -> tuple[str, str]:
    """(kind, why the layer is incomplete): kind "v1", "v2" or "" (none can be made); why "" when the run's
    processes and memory are both bounded. A v2 subtree without the pids or memory controller gives ("v2", why):
    ``--allow_weaker`` still uses it for the kill and the CPU time."""
    env = os.environ.get("RLHF_SANDBOX_CGROUP", "")
    if env == "none":
        return "", "RLHF_SANDBOX_CGROUP=none"
    if env == "v1" or not (env == "v2" or env.startswith("/") or v2_root() == ROOT):
        why = v1_available()
        return ("v1", "") if not why else ("", why)
    root = v2_root()
    why = v2_available(root) if root else "no cgroup v2 folder (RLHF_SANDBOX_CGROUP names a delegated one)"
    if why:
        return "", why
    have = set(_read(os.path.join(root, "cgroup.controllers")).split())
    lack = [c for c in ("pids", "memory") if c not in have]
    return "v2", (f"cgroup v2 at {root} lacks the {' and '.join(lack)} controller{'s' if len(lack) > 1 else ''}"
                  if lack else "")


def make(kind: str, max_pids: int, memory_bytes: int, cpus: float) -> RunCgroup:
    return (V1Cgroup if kind == "v1" else V2Cgroup)(max_pids, memory_bytes, cpus)


def bounds(cg: RunCgroup | None) -> tuple[bool, bool]:
    """(processes bounded, memory bounded) by ``cg``."""
    if cg is None or cg.kind == "none":
        return False, False
    return (not any(m.startswith("processes") for m in cg.missing),
            not any(m.startswith("memory") for m in cg.missing))
