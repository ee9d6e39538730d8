"""One run of an untrusted Python program, isolated with Linux's own parts (docs/code_rl.md has the threat model).

Layers, each named in the result's ``isolation`` (a machine without one refuses the run, naming what is missing,
unless ``allow_weaker``):

* ``namespaces``: bubblewrap (``bwrap``, Debian's ``bubblewrap``) runs the program in new user, PID, network, mount,
  IPC, UTS and cgroup namespaces, as uid/gid 65534, every capability dropped, a new session, an empty environment
  (PATH, HOME, LANG only). The file system is a fresh root holding /usr (and its /bin, /lib links) and the Python
  install read-only, a new /proc and /dev, a size-limited tmpfs at /tmp and a fresh size-limited tmpfs at
  /sandbox (the working folder, holding only the program's own files): nothing of the trainer, its data or its
  checkpoints is there. No network at all: the net namespace has its own loopback, so even the host's loopback
  services are out of reach. When the program ends, bubblewrap's PID 1 ends and the kernel kills every process
  left in the namespace (double-forked, ``setsid`` children included).
* ``seccomp``: ``rlhf.sandbox.seccomp`` (ptrace, mounts, namespaces, modules, keyrings, eBPF, raw sockets... fail).
* ``cgroup``: ``rlhf.sandbox.cgroup`` (a process/thread limit, a memory limit, and the kill of everything in the
  run's cgroup at the end, whatever happened).
* ``rlimits``: CPU seconds, address space, file size, open files, no core dumps (``prlimit``, util-linux).

The program is run as ``python -I -S -B main.py`` (isolated mode, no site-packages: the standard library only).
"""
from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

STATUSES = ("ok", "timeout", "memory", "output_limit", "error", "refused")
LAYERS = ("namespaces", "seccomp", "cgroup", "rlimits")


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one run."""

    timeout_s: float = 10.0
    """wall-clock limit (the CPU-time limit is the same number of seconds, rounded up)"""
    memory_mb: int = 512
    """memory (cgroup, swap included) and address-space limit"""
    max_processes: int = 64
    """processes and threads of the run (the cgroup's pids.max)"""
    max_output_bytes: int = 1 << 20
    """stdout and stderr are each cut here; a run that writes more is stopped (status output_limit)"""
    max_file_mb: int = 16
    """the largest file the program may write, and the size of its working folder and of /tmp"""
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


@dataclass
class SandboxResult:
    status: str
    """one of ``STATUSES``"""
    exit_code: int | None
    """the program's exit status; a signal N that ended it as -N; None when it never ran"""
    stdout: str
    stderr: str
    stdout_cut: int = 0
    """bytes of stdout read past ``max_output_bytes`` and dropped (at least: reading stops at the limit)"""
    stderr_cut: int = 0
    seconds: float = 0.0
    isolation: list[str] = field(default_factory=list)
    """the layers that ran (``LAYERS``, with their details)"""
    reason: str = ""
    """why a run was refused, or what ended it (timeout, memory, output)"""

    def to_json(self) -> str:
        return json.dumps(asdict(self))


# --------------------------------------------------------------------------------------------------- probing
_probe_cache: dict = {}


def probe() -> dict[str, str]:
    """Each layer -> "" when this machine can provide it, else why not (cached)."""
    if _probe_cache:
        return dict(_probe_cache)
    from rlhf.sandbox import cgroup, seccomp

    bwrap = shutil.which("bwrap")
    out = {"namespaces": "" if bwrap else "bubblewrap (bwrap) is not installed (apt install bubblewrap)",
           "seccomp": seccomp.available(), "cgroup": cgroup.available(),
           "rlimits": "" if shutil.which("prlimit") else "prlimit (util-linux) is not installed"}
    if bwrap and not out["namespaces"]:
        p = subprocess.run([bwrap, "--unshare-all", "--ro-bind", "/", "/", "true"], capture_output=True, text=True,
                           timeout=30)
        if p.returncode != 0:
            out["namespaces"] = f"bubblewrap cannot create namespaces here: {p.stderr.strip()[:200]}"
    _probe_cache.update(out)
    return dict(out)


def _python(cfg: SandboxConfig) -> tuple[str, str]:
    """(interpreter, its install prefix to mount read-only)."""
    exe = os.path.realpath(cfg.python or getattr(sys, "_base_executable", sys.executable))
    prefix = os.path.realpath(sys.base_prefix) if not cfg.python else os.path.dirname(os.path.dirname(exe))
    return exe, prefix


# ------------------------------------------------------------------------------------------------------ a run
def run_program(program: str, stdin: str = "", cfg: SandboxConfig | None = None,
                files: dict[str, str] | None = None) -> SandboxResult:
    """Run ``program`` (Python source) with ``stdin`` under ``cfg``'s limits and every isolation layer; ``files``:
    more files for its working folder (name -> text). Never raises for what the program does; a machine missing a
    layer gives status ``refused`` (unless ``cfg.allow_weaker``)."""
    cfg = cfg or SandboxConfig()
    layers = probe()
    missing = {k: v for k, v in layers.items() if v}
    if "namespaces" in missing:  # nothing to run in: the floor even with allow_weaker
        return SandboxResult("refused", None, "", "", reason=f"namespaces: {missing['namespaces']}")
    if missing and not cfg.allow_weaker:
        return SandboxResult("refused", None, "", "", reason="; ".join(f"{k}: {v}" for k, v in missing.items())
                             + " (--allow_weaker runs without them)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"rlhf-sbx-{os.getpid()}-") as host:  # whose run: the pid
        staging = os.path.join(host, "files")
        os.makedirs(staging)
        for name, text in {"main.py": program, **(files or {})}.items():
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise ValueError(f"sandbox file name {name!r}: a plain file name is expected")
            with open(os.path.join(staging, name), "w") as f:
                f.write(text)
        cg = None
        isolation = []
        try:
            if "cgroup" not in missing:
                from rlhf.sandbox.cgroup import RunCgroup

                cg = RunCgroup(cfg.max_processes, cfg.memory_mb << 20)
                isolation.append(f"cgroup(pids.max={cfg.max_processes}, memory={cfg.memory_mb}MB"
                                 f"{' incl. swap' if cg.memsw else ''})")
            cmd, iso = _command(cfg, host, staging, missing)
            isolation = iso + isolation
            result = _execute(cmd, stdin, cfg, cg)
        finally:
            if cg is not None:
                cg.remove()
    result.isolation = isolation
    result.seconds = round(time.monotonic() - t0, 4)
    return result


def _command(cfg: SandboxConfig, host: str, staging: str, missing: dict) -> tuple[list[str], list[str]]:
    exe, prefix = _python(cfg)
    size = str(cfg.max_file_mb << 20)
    b = ["bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL",
         "--uid", "65534", "--gid", "65534", "--hostname", "sandbox", "--disable-userns",
         "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
         "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
         "--ro-bind", prefix, prefix, "--proc", "/proc", "--dev", "/dev",
         "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/sandbox"]
    iso = ["namespaces(user, pid, net, mount, ipc, uts, cgroup; uid 65534; no capabilities; empty environment; "
           f"fresh root; working folder and /tmp tmpfs of {cfg.max_file_mb} MB; no network)"]
    if "seccomp" not in missing:
        from rlhf.sandbox.seccomp import write_filter

        bpf = os.path.join(host, "filter.bpf")
        write_filter(bpf)
        b += ["--seccomp", "3"]  # the launcher opens the BPF on fd 3
        iso.append("seccomp(EPERM: ptrace, mount, namespaces, modules, keys, bpf, raw/net sockets, ...)")
    b += ["--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/sandbox", "--setenv", "LANG", "C.UTF-8",
          "--chdir", "/sandbox", "--", exe, "-I", "-S", "-B", "main.py"]
    # The fresh /sandbox tmpfs is filled by a copy inside the sandbox (from a read-only view of the staging folder)
    # before the program starts: the program's own files end up writable, in its size-limited folder.
    copy = ("import os,shutil;[shutil.copy(os.path.join('/.in',n),n) for n in os.listdir('/.in')];"
            f"os.execv({exe!r},[{exe!r},'-I','-S','-B','main.py'])")
    b = b[:b.index("--chdir")] + ["--ro-bind", staging, "/.in"] + b[b.index("--chdir"):]
    b = b[:b.index("--") + 1] + [exe, "-I", "-S", "-B", "-c", copy]
    cpu = int(cfg.timeout_s + 0.999) + 1
    limits = []
    if "rlimits" not in missing:
        limits = ["prlimit", f"--cpu={cpu}", f"--as={cfg.memory_mb << 20}", f"--fsize={cfg.max_file_mb << 20}",
                  "--nofile=256", "--core=0", "--"]
        iso.append(f"rlimits(cpu={cpu}s, as={cfg.memory_mb}MB, fsize={cfg.max_file_mb}MB, nofile=256, core=0)")
    seccomp_fd = ["3<", os.path.join(host, "filter.bpf")] if "seccomp" not in missing else []
    return _shell(limits + b, seccomp_fd), iso


def _shell(argv: list[str], seccomp_fd: list[str]) -> list[str]:
    """``sh -c`` that joins the run's cgroups (paths in "$@" before ``--``), opens the BPF on fd 3, then execs."""
    import shlex

    redirect = f" {seccomp_fd[0]}{shlex.quote(seccomp_fd[1])}" if seccomp_fd else ""
    script = ('for f in "$@"; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; done; '
              f"exec {' '.join(shlex.quote(a) for a in argv)}{redirect}")
    return ["/bin/sh", "-c", script, "sandbox-launcher"]


def _execute(cmd: list[str], stdin: str, cfg: SandboxConfig, cg) -> SandboxResult:
    """Start the launcher (joining ``cg``), feed stdin, read both outputs up to the cap until the end or the wall
    deadline, then kill whatever is left of the run. The verdict: timeout, memory, output_limit, error or ok."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # the launcher's (and bubblewrap's) own: nothing inherited
    proc = subprocess.Popen(cmd + (cg.join_paths() if cg else []) + ["--"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
                            cwd="/")  # nothing of the trainer's working folder in bubblewrap's environment (PWD)
    feeder = threading.Thread(target=_feed, args=(proc.stdin, stdin.encode()), daemon=True)
    feeder.start()
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    cut = {proc.stdout: 0, proc.stderr: 0}
    sel = selectors.DefaultSelector()
    for pipe in bufs:
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ)
    deadline = time.monotonic() + cfg.timeout_s
    reason = ""
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            reason = f"wall-clock limit of {cfg.timeout_s:g} s"
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            data = key.fileobj.read(65536)
            if not data:
                sel.unregister(key.fileobj)
                continue
            room = cfg.max_output_bytes - len(bufs[key.fileobj])
            bufs[key.fileobj] += data[:max(room, 0)]
            cut[key.fileobj] += max(len(data) - max(room, 0), 0)
        if any(cut.values()):
            reason = f"output over {cfg.max_output_bytes} bytes"
            break
    _kill(proc, cg)
    code = proc.wait()
    for pipe in bufs:
        pipe.close()
    sel.close()
    oom = cg.oom_killed() if cg is not None else False
    err = bufs[proc.stderr].decode(errors="replace")
    if code >= 128 and code - 128 < 65:  # bubblewrap reports a signal-ended program as 128 + N
        code = -(code - 128)
    if reason.startswith("wall"):
        status = "timeout"
    elif reason.startswith("output"):
        status = "output_limit"
    elif code == -signal.SIGXCPU:
        status, reason = "timeout", "CPU-time limit"
    elif oom or (code != 0 and "MemoryError" in err[-2000:]):
        status, reason = "memory", f"memory limit of {cfg.memory_mb} MB"
    elif code == 125 and not err:
        status, reason = "refused", "the launcher could not join the run's cgroup"
    else:
        status = "ok" if code == 0 else "error"
    return SandboxResult(status, code, bufs[proc.stdout].decode(errors="replace"), err, cut[proc.stdout],
                         cut[proc.stderr], reason=reason)


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, ValueError, OSError):  # the program ended (or closed stdin) before reading it all
        pass


def _kill(proc: subprocess.Popen, cg) -> None:
    """Everything of the run: the cgroup's processes (frozen, then killed), and the launcher's process group."""
    if cg is not None:
        cg.kill_all()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
