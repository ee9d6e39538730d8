"""A host uid of its own for each sandboxed run.

Run as root, the sandbox runs its program as a uid that owns nothing on the host, one per run at a time: the
kernel's per-uid bounds then count the run alone (``RLIMIT_NPROC``, the pipe-buffer quota), no root-owned file,
device node or kernel knob is writable or changeable by it, and the host finds every process of the run by its
uid. The uids are ``RLHF_SANDBOX_UID_BASE`` (default 0x70000000) to ``+ RLHF_SANDBOX_UIDS`` (default 4096), none of
them in the host's passwd database; a run leases one with an ``flock`` on a file under ``/run/rlhf-sandbox`` (the
kernel drops the lock when the process holding it dies) and takes only a uid no process has."""
from __future__ import annotations

import fcntl
import os
import signal
import time

DEFAULT_BASE = 0x70000000
DEFAULT_COUNT = 4096
LOCK_DIRS = ("/run/rlhf-sandbox", "/tmp/rlhf-sandbox-uids")


def uid_range() -> tuple[int, int]:
    """(first uid, how many)."""
    base = int(os.environ.get("RLHF_SANDBOX_UID_BASE", DEFAULT_BASE))
    count = int(os.environ.get("RLHF_SANDBOX_UIDS", DEFAULT_COUNT))
    if base < 1000 or count < 1 or base + count > 0xFFFFFFFE:
        raise ValueError(f"RLHF_SANDBOX_UID_BASE={base}, RLHF_SANDBOX_UIDS={count}: expected a range of uids "
                         "above 1000 below 2^32 - 1")
    return base, count


def _lock_dir() -> str:
    for d in LOCK_DIRS:
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            st = os.lstat(d)
            if st.st_uid == 0 and not (st.st_mode & 0o022) and os.path.isdir(d) and not os.path.islink(d):
                return d
        except OSError:
            continue
    raise OSError(f"no root-owned folder for the sandbox's uid leases among {', '.join(LOCK_DIRS)}")


def processes_of(uid: int) -> list[int]:
    """Every process whose real uid is ``uid`` on the host (from /proc/<pid>/status: a non-dumpable process's
    /proc folder belongs to root, whoever runs it)."""
    out = []
    with os.scandir("/proc") as it:
        for e in it:
            if e.name.isdigit():
                if _real_uid(e.name) == uid:
                    out.append(int(e.name))
    return out


def _real_uid(pid) -> int | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            data = f.read(2048)
    except OSError:
        return None
    i = data.find(b"\nUid:")
    return int(data[i + 5:].split()[0]) if i >= 0 else None


def kill_uid(uid: int, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process of ``uid`` until none is left (through a pidfd, checked to still be ``uid``'s, so a
    pid reused by another process between the listing and the kill is never signalled). Returns the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        pids = processes_of(uid)
        if not pids:
            return killed
        if time.monotonic() > deadline:
            raise RuntimeError(f"sandbox: processes {pids} of uid {uid} survived SIGKILL for {timeout:g} s")
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if _real_uid(pid) == uid:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    killed.append(pid)
            except OSError:
                pass
            finally:
                os.close(fd)
        time.sleep(0.005)


class UidLease:
    """``with UidLease() as uid:`` a uid of the range that no other run holds and no process has."""

    _next = 0

    def __init__(self):
        self.uid: int | None = None
        self._fd: int | None = None

    def __enter__(self) -> int:
        base, count = uid_range()
        d = _lock_dir()
        start = (os.getpid() * 7919 + UidLease._next) % count
        UidLease._next += 1
        for k in range(count):
            slot = (start + k) % count
            fd = os.open(os.path.join(d, f"uid-{base + slot}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            if processes_of(base + slot):  # left by a run whose holder died before its end: not reused
                os.close(fd)
                continue
            self.uid, self._fd = base + slot, fd
            return self.uid
        raise RuntimeError(f"sandbox: all {count} uids from {base} are in use (RLHF_SANDBOX_UIDS)")

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
