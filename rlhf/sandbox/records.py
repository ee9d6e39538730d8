"""The sandbox's records: the limits of a run (``SandboxConfig``), a program of a batch (``Run``), and what became
of it (``SandboxResult``). Standard library only."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

STATUSES = ("ok", "timeout", "memory", "output_limit", "error", "refused")
LAYERS = ("namespaces", "uid", "seccomp", "cgroup", "rlimits")
BUDGET_GRACE_S = 0.5
"""the host kills a program's processes this long past their CPU budget: a process alone meets its CPU-time rlimit
first (SIGXCPU), the budget is for many processes together"""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one run (in a batch: of each of its programs)."""

    timeout_s: float = 10.0
    """wall-clock limit of one program (its interpreter's start included)"""
    memory_mb: int = 512
    """memory of the sandbox (cgroup, swap included; the address-space rlimit is looser where a cgroup holds
    memory, and is the only memory bound without one)"""
    max_processes: int = 64
    """processes and threads of the run (the cgroup's pids.max and the run's uid's RLIMIT_NPROC)"""
    max_output_bytes: int = 1 << 20
    """stdout and stderr are each cut here; a run that writes more is stopped (status output_limit)"""
    max_file_mb: int = 16
    """the largest file a program may write, and the size of each of /sandbox, /tmp and /dev/shm"""
    cpus: float = 1.0
    """CPU rate of the run's processes together, in cores (the cgroup's cpu controller)"""
    cpu_s: float = 0.0
    """CPU time one program's processes may use together (0: ``timeout_s``); a process alone is also held to it
    by its CPU-time rlimit"""
    python: str = ""
    """the interpreter (default: this process's own base interpreter)"""
    allow_weaker: bool = False
    """run with the layers this machine has when some are missing (named in the result), instead of refusing"""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout_s must be > 0, got {self.timeout_s}")
        if self.memory_mb < 16:
            raise ValueError(f"--memory_mb must be >= 16, got {self.memory_mb}")
        if self.max_processes < 1 or self.max_output_bytes < 1 or self.max_file_mb < 1:
            raise ValueError("max_processes, max_output_bytes and max_file_mb must be >= 1")
        if not 0.01 <= self.cpus <= 1024:
            raise ValueError(f"--cpus must be in [0.01, 1024], got {self.cpus}")
        if self.cpu_s < 0:
            raise ValueError(f"--cpu_s must be >= 0, got {self.cpu_s}")

    @property
    def cpu_budget_s(self) -> float:
        return self.cpu_s or self.timeout_s


@dataclass
class SandboxResult:
    status: str
    """one of ``STATUSES``"""
    exit_code: int | None
    """the program's exit status; a signal N that ended it as -N; None when it never ran or was stopped"""
    stdout: str
    stderr: str
    stdout_cut: int = 0
    """bytes of stdout read past ``max_output_bytes`` and dropped (at least: reading stops at the limit)"""
    stderr_cut: int = 0
    seconds: float = 0.0
    isolation: list[str] = field(default_factory=list)
    """the layers that ran (``LAYERS``, with their details), then the bounds missing where a layer was weaker"""
    reason: str = ""
    """why a run was refused, or what ended it (timeout, memory, output)"""
    cpu_s: float | None = None
    """CPU seconds the program's processes used together (from the cgroup, or the run's uid; None: not counted)"""

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass(frozen=True)
class Run:
    """One program of a batch: its source (``main.py``), its standard input, more files for its working folder."""

    program: str
    stdin: str = ""
    files: dict | None = None
