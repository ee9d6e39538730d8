"""vLLM's files that outlive a process (vLLM 0.32.0): the CPU all-reduce's shared-memory segments, named the same by
every job, and its broadcasters' ZMQ socket files, left in the temporary folder by a process that ends with
``os._exit``. Imported only when a vLLM engine is built."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import uuid
import zlib

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
_SHM_TAG_ENV = "RLHF_VLLM_SHM_TAG"


# vLLM 0.32.0 (CPU, TP > 1): under external_launcher every job's shared-memory segments get one fixed name.
def unique_cpu_shm_names(tag: str) -> None:
    """vLLM's CPU all-reduce names its /dev/shm segments from ``VLLM_DIST_IDENT``, which ``external_launcher``
    (init method ``env://``) leaves constant, so a second job on the machine, or the relaunch of a job that was
    killed (SIGKILL leaves the segments behind), fails with "create shm in SHMManager failed. errno: 17". The
    names get this job's ``tag`` (the same on every rank) in front."""
    from vllm.distributed.device_communicators import cpu_communicator as cc

    cls = cc._CPUSHMDistributed
    orig = getattr(cls.make_group_name, "_rlhf_orig", cls.make_group_name)

    def make_group_name(communicator) -> str:
        # shm_open accepts '/' only in front of a name: vLLM's "//-tp:0-..." keeps working only there.
        return f"{os.environ.get(_SHM_TAG_ENV, '')}{orig(communicator).lstrip('/')}"

    make_group_name._rlhf_orig = orig
    cls.make_group_name = staticmethod(make_group_name)
    os.environ[_SHM_TAG_ENV] = tag


def _host_id() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()) & 0xffff:04x}"


def new_shm_tag() -> str:
    """``rlhf<pid>h<host>x<random>-``: the creating process and its machine (to find leftovers of dead jobs) and a
    random part."""
    return f"rlhf{os.getpid()}h{_host_id()}x{uuid.uuid4().hex[:8]}-"


def remove_dead_shm(shm_dir: str = SHM_DIR) -> list[str]:
    """Delete the vLLM segments of jobs whose tagging process ran on this machine and no longer exists: what a
    SIGKILLed job left behind. Returns the names removed."""
    removed = []
    for name in _left_by_dead(shm_dir, r"rlhf(\d+)h([0-9a-f]{4})x[0-9a-f]+-.*-cpushm.*"):
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("removed %d shared-memory segment(s) left by killed vLLM jobs from %s", len(removed), shm_dir)
    return removed


def _left_by_dead(folder: str, pattern: str) -> list[str]:
    """The names in ``folder`` that match ``pattern`` (groups: the pid, the host id) and were made by a process of
    this machine that no longer exists."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    dead = []
    for name in names:
        m = re.fullmatch(pattern, name)
        if m is not None and m.group(2) == _host_id() and not _pid_alive(int(m.group(1))):
            dead.append(name)
    return dead


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# vLLM 0.32.0: the ZMQ sockets of its shared-memory broadcaster are files that outlive a process ended by os._exit.
IPC_ENV = "VLLM_RPC_BASE_PATH"
_IPC_PREFIX = "rlhf-ipc-"
_IPC_DIRS: set[str] = set()  # this process's folders, each with its atexit handler
_TOO_LONG: set[str] = set()  # the folders not used because a socket's path would not fit (warned once each)
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux (zmq.IPC_PATH_MAX_LEN)


def private_ipc_dir() -> str | None:
    """A folder of this process's own for vLLM's socket files, removed when the process exits.

    vLLM binds the ZMQ sockets of every group's shared-memory broadcaster (``MessageQueue`` in
    ``vllm/distributed/device_communicators/shm_broadcast.py``: two ``ipc://`` sockets per rank of a group of two or
    more) as files under ``VLLM_RPC_BASE_PATH``, by default the temporary folder, and libzmq unlinks such a file only
    when the socket is closed. A rank ends with ``os._exit`` (``rlhf.distributed.failures.exit_process``) after its
    ``atexit`` handlers, so every job left two socket files a rank in /tmp (512 after a day of test runs). This
    returns ``<tmp>/rlhf-ipc-<pid>h<host>``, created once, with an ``atexit`` handler of this process that removes it
    (a killed process's folder is removed by the next engine started on the machine, ``remove_dead_ipc``); None
    where the user set ``VLLM_RPC_BASE_PATH`` (kept). Build the engine inside ``ipc_env`` with it."""
    import atexit
    import shutil
    import tempfile

    if os.environ.get(IPC_ENV):
        return None
    path = os.path.join(tempfile.gettempdir(), f"{_IPC_PREFIX}{os.getpid()}h{_host_id()}")
    if len(path) + 37 > _SUN_PATH_MAX:  # vLLM adds "/<uuid4>"; a longer path fails to bind where vLLM's own works
        if path not in _TOO_LONG:
            _TOO_LONG.add(path)
            log.warning("vLLM's socket files stay in %s: %s/<uuid> would pass the %d bytes of a Unix socket's path",
                        tempfile.gettempdir(), path, _SUN_PATH_MAX)
        return None
    os.makedirs(path, mode=0o700, exist_ok=True)
    if path not in _IPC_DIRS:
        _IPC_DIRS.add(path)
        pid = os.getpid()

        def remove() -> None:
            if os.getpid() == pid:  # not in a child forked after this (its exit would remove the parent's sockets)
                shutil.rmtree(path, ignore_errors=True)

        atexit.register(remove)
    return path


@contextlib.contextmanager
def ipc_env(path: str | None):
    """``VLLM_RPC_BASE_PATH=path`` inside the block (vLLM binds its broadcasters' sockets while the engine is built),
    the environment as it was after it: jobs and tests started later from this process do not inherit it."""
    if path is None:
        yield
        return
    old = os.environ.get(IPC_ENV)
    os.environ[IPC_ENV] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(IPC_ENV, None)
        else:
            os.environ[IPC_ENV] = old


def remove_dead_ipc(base: str | None = None) -> list[str]:
    """Delete the ``private_ipc_dir`` folders of processes that ran on this machine and no longer exist (a
    SIGKILLed job's). Returns the names removed."""
    import shutil
    import tempfile

    base = base or tempfile.gettempdir()
    removed = _left_by_dead(base, re.escape(_IPC_PREFIX) + r"(\d+)h([0-9a-f]{4})")
    for name in removed:
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    if removed:
        log.info("removed %d vLLM socket folder(s) left by killed jobs from %s", len(removed), base)
    return removed
