"""Runs of untrusted Python programs, isolated with Linux's own parts (docs/code_rl.md has the threat model and the
tests that observe each layer).

``run_batch(runs, cfg)`` runs several programs (a reply's tests) one after another in one sandbox, each a fresh
``python -I -S -B main.py`` with its own stdin, limits and verdict; ``run_program`` is a batch of one. Layers, each
named in the result's ``isolation`` (a machine without one refuses the run, naming what is missing, unless
``allow_weaker``; namespaces and the launcher's own checks are the floor):

* ``namespaces``: bubblewrap (``bwrap``, Debian's ``bubblewrap``) in new user, PID, network, mount, IPC, UTS and
  cgroup namespaces, every capability dropped, no further user namespaces, a new session, an empty environment.
  The file system is a fresh root, read-only, holding /usr and the Python install read-only, a read-only /proc
  (its /proc/sys too) and /dev, and sized tmpfs at /tmp, /dev/shm and /sandbox (the working folder). No network:
  the net namespace has only its own loopback. The sandbox's first process is ``rlhf.sandbox.supervisor``.
* ``uid``: run as root, the programs run as a host uid of their own (``rlhf.sandbox.uids``: 65534 inside, mapped by
  bubblewrap's unprivileged path from a uid that owns nothing on the host), dropped to by ``setpriv`` after the
  cgroup join: no root-owned inode, device node or kernel knob is theirs.
* ``seccomp``: ``rlhf.sandbox.seccomp`` (an allow-list of socket families; ptrace, mounts, namespaces, modules,
  keyrings, eBPF, io_uring, SysV shared memory, memfd... fail).
* ``cgroup``: ``rlhf.sandbox.cgroup`` (v1 or v2: processes and threads, memory with swap, CPU rate; CPU time and
  OOM kills counted; everything killed at the end).
* ``rlimits``: per process: CPU seconds (soft below hard: SIGXCPU, a timeout), address space, file size, open files,
  no core dumps; for the run's uid: processes (``RLIMIT_NPROC``).

The host keeps every verdict: ``timeout`` from the wall-clock limit, a process's CPU-time limit or the CPU budget of
the test's processes together; ``memory`` only from the cgroup's OOM kills; ``refused`` only from the launcher
(a missing layer, or a sandbox that never started). Nothing a program prints or returns can produce them."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

from rlhf.sandbox.records import BUDGET_GRACE_S, LAYERS, STATUSES, Run, SandboxConfig, SandboxResult

__all__ = ["BUDGET_GRACE_S", "LAYERS", "STATUSES", "Run", "SandboxConfig", "SandboxResult", "probe", "run_batch",
           "run_program"]

# --------------------------------------------------------------------------------------------------- probing
_probe_cache: dict = {}


def probe() -> dict[str, str]:
    """Each layer -> "" when this machine provides it, else why not. Runs the real command line once per process
    (and cgroup choice, ``RLHF_SANDBOX_CGROUP``): a program printing ``ok`` with every layer the machine has and
    the flags a run passes, so a bubblewrap or kernel that refuses one of them leaves the namespaces layer missing,
    in bubblewrap's words."""
    key = os.environ.get("RLHF_SANDBOX_CGROUP", "")
    if key not in _probe_cache:
        from rlhf.sandbox.launch import tools

        out = tools()
        if not out["namespaces"]:
            cfg = SandboxConfig(timeout_s=30, memory_mb=256, allow_weaker=True)
            r = _run_batch([Run("print('ok')")], cfg, out)[0]
            if r.status != "ok" or r.stdout != "ok\n":
                out["namespaces"] = (f"the sandbox's command line fails here: {r.status}: {r.reason} "
                                     f"{r.stderr.strip()}")[:500]
        _probe_cache[key] = out
    return dict(_probe_cache[key])


# ------------------------------------------------------------------------------------------------------ runs
def run_program(program: str, stdin: str = "", cfg: SandboxConfig | None = None,
                files: dict[str, str] | None = None) -> SandboxResult:
    """Run ``program`` (Python source) with ``stdin`` under ``cfg``'s limits; ``files``: more files for its working
    folder (name -> text). Never raises for what the program does."""
    return run_batch([Run(program, stdin, files)], cfg)[0]


def run_batch(runs: list[Run], cfg: SandboxConfig | None = None) -> list[SandboxResult]:
    """Run each of ``runs`` in one sandbox, one after another, each with ``cfg``'s limits and a verdict of its own.
    A machine missing a layer gives status ``refused`` to each (unless ``cfg.allow_weaker``)."""
    cfg = cfg or SandboxConfig()
    for run in runs:
        for name in (run.files or {}):
            if os.path.basename(name) != name or name in ("", ".", "..", "main.py"):
                raise ValueError(f"sandbox file name {name!r}: a plain file name other than main.py is expected")
    layers = probe()
    missing = {k: v for k, v in layers.items() if v}
    if "namespaces" in missing:  # nothing to run in: the floor even with allow_weaker
        return [SandboxResult("refused", None, "", "", reason=f"namespaces: {missing['namespaces']}") for _ in runs]
    if missing and not cfg.allow_weaker:
        why = "; ".join(f"{k}: {v}" for k, v in missing.items()) + " (--allow_weaker runs without them)"
        return [SandboxResult("refused", None, "", "", reason=why) for _ in runs]
    return _run_batch(runs, cfg, layers)


def _run_batch(runs: list[Run], cfg: SandboxConfig, layers: dict[str, str]) -> list[SandboxResult]:
    from rlhf.sandbox import cgroup, launch, session
    from rlhf.sandbox.uids import UidLease

    missing = {k for k, v in layers.items() if v}
    t0 = time.monotonic()
    lease = UidLease() if "uid" not in missing else None
    uid = lease.__enter__() if lease else None
    host = tempfile.mkdtemp(prefix=f"rlhf-sbx-{os.getpid()}-")  # whose run: the pid
    cg = None
    try:
        os.chmod(host, 0o711)  # the run's uid passes through to its read-only files, lists nothing
        launch.stage(host, runs)
        kind = cgroup.backend()[0]
        if kind:  # a partial v2 subtree too (allow_weaker): its kill and CPU time still count
            cg = cgroup.make(kind, cfg.max_processes + 2, cfg.memory_mb << 20, cfg.cpus)
        elif uid is not None:
            cg = cgroup.UidAccounting(uid)
        argv, fds, isolation = launch.command(cfg, host, uid, cg, missing, len(runs))
        results = session.execute(argv, fds, runs, cfg, cg)
    finally:
        try:
            if cg is not None:
                cg.remove()
            if uid is not None:
                from rlhf.sandbox.uids import kill_uid

                left = kill_uid(uid)  # anything of the run outside its cgroup: none, unless a layer failed
                if left and cg is not None and cg.kind != "none":
                    import logging

                    logging.getLogger(__name__).warning("sandbox: %d process(es) of uid %d outlived the run's "
                                                        "cgroup %s and were killed", len(left), uid, cg.kind)
        finally:
            shutil.rmtree(host, ignore_errors=True)
            if lease:
                lease.__exit__(None, None, None)
    seconds = round(time.monotonic() - t0, 4)
    for r in results:
        r.isolation = list(isolation)
        r.seconds = r.seconds or seconds
    return results


