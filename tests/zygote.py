"""A pre-imported launcher for the suite's jobs: ``rlhf.distributed.forkrun`` without its imports paid per job.

forkrun forks a job's ranks from a launcher that imported torch, transformers, megatron-core and vLLM once; that
launcher still pays those imports (6-8 s of CPU here) at every job, and the suite runs well over a hundred jobs.
A zygote pays them once per pytest worker: a server process (``serve``) that imported forkrun's preload list and
then, for every job, forks a launcher that runs ``rlhf.distributed.forkrun``'s ``main`` with the job's command
line, environment, working folder and standard streams. The test starts a small client (``client``: the
standard library only, no site packages) in place of ``python -m rlhf.distributed.forkrun``; it hands its streams
to the zygote, relays SIGTERM/SIGINT/SIGHUP to the launcher and ends with the launcher's exit status (the same
signal, when a signal ended it).

What a job sees is what forkrun shows it, with these conditions (each one checked, else the client runs forkrun
itself, as before, and says why on stderr):
* The zygote's environment and the job's differ only in variables read at run time: ``RLHF_TEST_JOB_TAG``,
  ``PYTEST_*``, ``PYTHONPATH`` (its entries are put on ``sys.path`` as the interpreter would), ``PYTHONUNBUFFERED``
  and ``RLHF_*`` (rlhf's modules read none at import; ``RLHF_DEVICE`` excepted). torch, transformers, megatron-core
  and vLLM read others when imported (``OMP_NUM_THREADS``, ``HF_*``, ``VLLM_*``, ...), so those must be equal.
* The preload list is forkrun's own choice for the script (``default_preload``); one zygote per list.
* The zygote forks only with one OS thread and no CUDA context (forkrun's ``fork_unsafe_reason``).

Process identity: the launcher is the zygote's child, not the client's, and its /proc environment and command line
are the zygote's. Each launcher starts its own session; its pid is written to ``<registry>/<tag>`` so that
``helpers.job_processes`` finds the job (every process of that process group, plus those whose /proc environment
carries the tag, as before). A client that dies (SIGKILL included) takes its job with it: the zygote SIGKILLs the
launcher's process group when the client's connection closes before the launcher ended. The zygote ends with the
process that started it.
"""
from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys

FALLBACK_LOG = "RLHF_TEST_ZYGOTE_LOG"  # a file: one line per job whose client ran forkrun itself, with the reason
RUNTIME_ONLY = ("RLHF_TEST_JOB_TAG", "PYTHONPATH", "PYTHONUNBUFFERED")
RUNTIME_PREFIXES = ("PYTEST_", "RLHF_")
IMPORT_TIME = ("RLHF_DEVICE",)  # read by rlhf.compat.cuda when megatron's modules are prepared
_IMPORT_ENV: dict = {"set": {}, "unset": []}  # what the zygote's imports did to its environment
_BASE_PATH: list[str] = []  # the zygote's sys.path without its script's folder and PYTHONPATH's entries


def import_relevant(env: dict) -> dict:
    """The variables a preloaded import may have read: all but the run-time ones."""
    return {k: v for k, v in env.items()
            if k in IMPORT_TIME or not (k in RUNTIME_ONLY or k.startswith(RUNTIME_PREFIXES))}


def _send(conn: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = (json.dumps(obj) + "\n").encode()
    if fds:
        conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        conn.sendall(data)


class _Lines:
    """JSON lines from a socket, with the file descriptors that came with them."""

    def __init__(self, conn: socket.socket):
        self.conn, self.buf, self.fds = conn, b"", []

    def read(self) -> dict | None:
        while b"\n" not in self.buf:
            fds = array.array("i")
            data, anc, _, _ = self.conn.recvmsg(1 << 16, socket.CMSG_LEN(16 * fds.itemsize))
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(raw[:len(raw) - len(raw) % fds.itemsize])
            self.fds += list(fds)
            if not data:
                return None
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


# ------------------------------------------------------------------------------------------------------ client
def client(sock_path: str, argv: list[str]) -> None:
    """Run ``python -m rlhf.distributed.forkrun argv`` through the zygote at ``sock_path``; exits as the job did."""
    def fallback(why: str) -> None:
        print(f"zygote: not used ({why}); running forkrun in this process", file=sys.stderr, flush=True)
        log = os.environ.get(FALLBACK_LOG)
        if log:  # the suite's summary counts them (tests/conftest.py)
            try:
                fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.write(fd, (why.replace("\n", " ")[:500] + "\n").encode())
                os.close(fd)
            except OSError:
                pass
        os.execv(sys.executable, [sys.executable, "-u", "-m", "rlhf.distributed.forkrun", *argv])

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sock_path)
    except OSError as e:
        fallback(f"cannot reach {sock_path}: {e}")
    lines = _Lines(conn)
    hello = lines.read()  # sent once the zygote's imports are done
    if hello is None or hello.get("refuse"):
        fallback(hello.get("refuse") if hello else "the zygote closed the connection")
    mine = import_relevant(dict(os.environ))
    diff = sorted(k for k in set(mine) | set(hello["env"]) if mine.get(k) != hello["env"].get(k))
    if diff:
        conn.close()
        fallback("the environment differs from the zygote's in " + ", ".join(diff[:5]))
    _send(conn, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, [0, 1, 2])
    started = lines.read()
    if started is None:
        print("zygote: the zygote ended before starting the job", file=sys.stderr, flush=True)
        os._exit(1)
    pid = started["pid"]

    def relay(sig, _frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, relay)
    for fd in (0, 1, 2):  # the launcher holds the job's streams now; EOF on them comes when the job's writers end
        os.close(fd)
    ended = lines.read()
    if ended is None:  # the zygote died: the job cannot be waited for; end it
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os._exit(1)
    status = ended["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


# ------------------------------------------------------------------------------------------------------ server
def _launcher(req: dict, fds: list[int], registry: str) -> None:
    """The forked child: becomes ``python -u -m rlhf.distributed.forkrun argv`` in the job's place. Never returns."""
    try:
        os.setsid()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        env = req["env"]
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(_IMPORT_ENV["set"])
        for k in _IMPORT_ENV["unset"]:
            os.environ.pop(k, None)
        os.chdir(req["cwd"])
        new_pp = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *new_pp, *_BASE_PATH]  # as ``python -m`` in the job's folder with its PYTHONPATH
        tag = env.get("RLHF_TEST_JOB_TAG")
        if tag:
            with open(os.path.join(registry, tag + ".tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(registry, tag + ".tmp"), os.path.join(registry, tag))
        import random

        random.seed()
        from rlhf.distributed import forkrun

        sys.argv = [forkrun.__file__, *req["argv"]]
        forkrun.main_then_exit(req["argv"])  # ends the process as python -m rlhf.distributed.forkrun ends
    except BaseException:  # in the set-up above (or KeyboardInterrupt, which main_then_exit re-raises)
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(1)


def serve(sock_path: str, registry: str, modules: list[str]) -> None:
    import select

    parent = os.getppid()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(64)  # clients wait in the backlog while the imports run
    from rlhf.distributed.forkrun import fork_unsafe_reason, preload

    before = dict(os.environ)
    preload(modules)
    # what the imports did to the environment (vLLM and others set variables when imported): a job gets it on top of
    # its own, as forkrun's ranks inherit it from their launcher's imports
    _IMPORT_ENV["set"] = {k: v for k, v in os.environ.items() if before.get(k) != v}
    _IMPORT_ENV["unset"] = [k for k in before if k not in os.environ]
    refuse = fork_unsafe_reason()
    hello = {"env": import_relevant(before)} if refuse is None else {"refuse": refuse}
    print(f"zygote {os.getpid()}: {len(modules)} module(s) imported; {refuse or 'serving'}", flush=True)
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    jobs: dict[int, socket.socket] = {}  # launcher pid -> its client's connection
    by_conn: dict[socket.socket, int] = {}
    while True:
        if os.getppid() != parent:  # the pytest worker is gone: so are its jobs' clients
            for pid in jobs:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        ready, _, _ = select.select([srv, rfd, *by_conn], [], [], 1.0)
        if rfd in ready:
            os.read(rfd, 4096)
        while jobs:  # reap every launcher that ended; tell its client
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = jobs.pop(pid, None)
            if conn is not None:
                by_conn.pop(conn, None)
                try:
                    _send(conn, {"status": status})
                except OSError:
                    pass
                conn.close()
        for conn in [c for c in ready if c in by_conn]:  # a client's connection closed: the client is gone
            try:
                data = conn.recv(1)
            except OSError:
                data = b""
            if not data:
                pid = by_conn.pop(conn)
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if srv in ready:
            conn, _ = srv.accept()
            try:
                _send(conn, hello)
                if refuse is not None:
                    conn.close()
                    continue
                lines = _Lines(conn)
                req = lines.read()
            except OSError:
                conn.close()
                continue
            if req is None or len(lines.fds) != 3:
                for fd in lines.fds:
                    os.close(fd)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                srv.close()
                conn.close()
                os.close(rfd)
                os.close(wfd)
                for c in by_conn:
                    c.close()
                _launcher(req, lines.fds, registry)
            for fd in lines.fds:
                os.close(fd)
            jobs[pid] = conn
            by_conn[conn] = pid
            _send(conn, {"pid": pid})


if __name__ == "__main__":
    if sys.argv[1] == "client":  # zygote.py client SOCK -- forkrun's argv
        client(sys.argv[2], sys.argv[4:])
    elif sys.argv[1] == "serve":  # zygote.py serve SOCK REGISTRY MODULE,MODULE,...
        _pp = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
        _BASE_PATH = [p for p in sys.path[1:] if os.path.abspath(p) not in _pp]  # the interpreter's own entries
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (rlhf)
        serve(sys.argv[2], sys.argv[3], [m for m in sys.argv[4].split(",") if m])
    else:
        raise SystemExit(f"zygote.py: unknown command {sys.argv[1]!r} (client, serve)")
