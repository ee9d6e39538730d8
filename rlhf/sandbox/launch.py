"""The command line of one sandbox: the launcher (``/bin/sh``, as root) joins the run's cgroup, makes the Python
install reachable in a mount namespace of its own, drops to the run's uid (``setpriv``), sets the rlimits
(``prlimit``) and execs bubblewrap with the namespaces layer's flags and the seccomp filter; bubblewrap's first
process is the supervisor (``rlhf.sandbox.supervisor``). Also the staging folder, and what each layer needs from
this machine (``tools``)."""
from __future__ import annotations

import os
import shutil
import sys

INNER_UID = 65534
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
"""the host device nodes bubblewrap's --dev binds (each read-only here, as is /dev)"""


def tools() -> dict[str, str]:
    """Each layer -> "" when its tools are here, else why not (no run yet)."""
    from rlhf.sandbox import cgroup, seccomp

    root = os.geteuid() == 0
    need = [t for t in ("bwrap", "unshare", "mount") if not shutil.which(t)] if root else \
        ([] if shutil.which("bwrap") else ["bwrap"])
    out = {"namespaces": "" if not need else
           f"{', '.join(need)} not installed (apt install bubblewrap util-linux mount)",
           "uid": "" if root and shutil.which("setpriv") else
           ("setpriv (util-linux) is not installed" if root else
            f"not root: the programs run as this process's own uid {os.getuid()}"),
           "seccomp": seccomp.available(),
           "cgroup": cgroup.backend()[1],
           "rlimits": "" if shutil.which("prlimit") else "prlimit (util-linux) is not installed"}
    return out


def python(cfg) -> tuple[str, str]:
    """(interpreter, its install prefix to mount read-only)."""
    exe = os.path.realpath(cfg.python or getattr(sys, "_base_executable", sys.executable))
    prefix = os.path.realpath(sys.base_prefix) if not cfg.python else os.path.dirname(os.path.dirname(exe))
    return exe, prefix


_SUPERVISOR: list[str] = []


def supervisor_source() -> str:
    if not _SUPERVISOR:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervisor.py")) as f:
            _SUPERVISOR.append(f.read())
    return _SUPERVISOR[0]


def stage(host: str, runs: list) -> None:
    """``host/in/run_<i>/`` holds each program's files (read-only to the run), ``host/py`` is the mount point of the
    Python install in the launcher's private mount namespace."""
    os.makedirs(os.path.join(host, "py"), mode=0o755)
    for i, run in enumerate(runs):
        d = os.path.join(host, "in", f"run_{i}")
        os.makedirs(d, mode=0o755)
        for name, text in {"main.py": run.program, **(run.files or {})}.items():
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
            os.chmod(os.path.join(d, name), 0o644)
    os.chmod(os.path.join(host, "in"), 0o755)


# The launcher: joins the run's cgroup(s) as root, makes the Python install reachable in a mount namespace of its
# own (it may sit under a folder only root may enter), drops to the run's uid, sets the rlimits, execs bubblewrap.
# Its own failures go to the status pipe (fd $1, through /proc: dash redirects only fds 0-9), which no program can
# write: they make the verdict ``refused``.
_LAUNCH = r'''
fd=$1; prefix=$2; mnt=$3; unshare=$4; mount=$5; shift 5
for f in "$@"; do
  shift
  [ "$f" = -- ] && break
  echo $$ > "$f" || { echo "launcher: could not join the run's cgroup ($f)" > "/proc/self/fd/$fd"; exit 1; }
done
if [ -n "$mnt" ]; then
  exec "$unshare" --mount --propagation private -- /bin/sh -c '
    "$4" --bind "$2" "$3" || { echo "launcher: could not bind $2 on $3" > "/proc/self/fd/$1"; exit 1; }
    shift 4; exec "$@"' rlhf-sandbox-mount "$fd" "$prefix" "$mnt" "$mount" "$@"
fi
exec "$@"
'''


def command(cfg, host: str, uid: int | None, cg, missing: set, n_runs: int):
    """(argv, fds to pass: {name: (read_end, write_end)}, isolation lines)."""
    from rlhf.sandbox import cgroup

    exe, prefix = python(cfg)
    size = str(cfg.max_file_mb << 20)
    status_r, status_w = os.pipe()
    fds = {"status": (status_r, status_w)}
    as_mb = as_mb_for(cfg, cg)
    cpu = int(cfg.cpu_budget_s + 0.999)
    b = [shutil.which("bwrap"), "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--clearenv",
         "--cap-drop", "ALL", "--disable-userns", "--as-pid-1", "--uid", str(INNER_UID), "--gid", str(INNER_UID),
         "--hostname", "sandbox", "--json-status-fd", str(status_w),
         "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
         "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin"]
    root = os.geteuid() == 0
    if not prefix.startswith("/usr/"):
        b += ["--ro-bind", os.path.join(host, "py") if root else prefix, prefix]
    b += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--remount-ro", "/proc",
          "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
    for dev in DEVICES:
        b += ["--remount-ro", dev]
    b += ["--remount-ro", "/dev", "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/sandbox",
          "--ro-bind", os.path.join(host, "in"), "/.in", "--remount-ro", "/"]
    iso = ["namespaces(user, pid, net, mount, ipc, uts, cgroup; no capabilities; no new user namespaces; empty "
           f"environment; read-only root, /usr, Python, /proc, /proc/sys and /dev; tmpfs /sandbox, /tmp, /dev/shm of "
           f"{cfg.max_file_mb} MB each; no network)"]
    if uid is not None:
        iso.append(f"uid(host uid {uid}, a uid of the run's own that owns nothing on the host; {INNER_UID} inside)")
    if "seccomp" not in missing:
        bpf_r, bpf_w = os.pipe()
        fds["seccomp"] = (bpf_r, bpf_w)
        b += ["--seccomp", str(bpf_r)]
        iso.append("seccomp(sockets: AF_UNIX only, low 32 bits compared; EPERM: ptrace, mount, namespaces, modules, "
                   "keys, bpf, io_uring, SysV shm/msg, memfd, ...)")
    b += ["--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/sandbox", "--setenv", "LANG", "C.UTF-8",
          "--chdir", "/sandbox", "--", exe, "-I", "-S", "-B", "-c", supervisor_source()]
    limits = []
    if "rlimits" not in missing:
        # + bubblewrap and the supervisor; looser than a cgroup that bounds processes (so that its limit acts)
        n = (2 * cfg.max_processes if cgroup.bounds(cg)[0] else cfg.max_processes) + 2
        nproc = [f"--nproc={n}"] if uid is not None else []
        sup_cpu = n_runs * (cpu + 2) + 10
        limits = [shutil.which("prlimit"), *nproc, f"--cpu={sup_cpu}", f"--as={as_mb << 20}", f"--fsize={cfg.max_file_mb << 20}",
                  "--nofile=256", "--core=0", "--"]
        iso.append(f"rlimits(cpu={cpu}s soft, {cpu + 1}s hard, as={as_mb}MB, fsize={cfg.max_file_mb}MB, nofile=256, "
                   f"core=0{f', nproc={n} for the uid' if nproc else ''})")
    drop = [shutil.which("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--"] if uid is not None else []
    join = cg.join_paths() if cg is not None else []
    if cg is not None:
        iso.append(cg.describe())
        iso += [f"missing: {m}" for m in cg.missing]
    iso.append(f"cpu budget({cfg.cpu_budget_s:g}s across a program's processes"
               f"{'' if cg is not None else ': not counted, no cgroup and no uid of its own'})")
    mnt = os.path.join(host, "py") if root and not prefix.startswith("/usr/") else ""
    tools = [shutil.which("unshare") or "unshare", shutil.which("mount") or "mount"]  # the host's, found here
    argv = ["/bin/sh", "-c", _LAUNCH, "rlhf-sandbox", str(status_w), prefix, mnt, *tools, *join, "--", *drop,
            *limits, *b]
    return argv, fds, iso


def as_mb_for(cfg, cg) -> int:
    """The address-space rlimit: looser than a cgroup that holds memory (so the cgroup's limit on resident pages
    acts, and its OOM kill gives the verdict), else the memory limit itself (the only bound left)."""
    from rlhf.sandbox.cgroup import bounds

    return cfg.memory_mb * 2 + 512 if bounds(cg)[1] else cfg.memory_mb
