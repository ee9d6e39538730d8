"""The sandbox's first process (PID 1 of its PID namespace): runs a reply's programs one after another, each as a
fresh ``python -I -S -B main.py`` child with its own stdin, rlimits and verdict, and reports to the host.

Run inside the sandbox as ``python -I -S -B -c <this file>``, standard library only (nothing of the trainer is
there), and only modules that import no others (``re``, ``enum`` and ``json`` would double its start). It cannot be
signalled by the programs (a PID namespace's init gets no signal it has no handler for, and it installs none), nor
read or written through /proc (it makes itself non-dumpable), and its pipes to the host are not inherited by the
programs. After each program it kills every other process of the namespace (``kill(-1)``) and waits for them, so
nothing of one is alive in the next, and empties the working folder, /tmp and /dev/shm.

Protocol: frames of a 4-byte big-endian length and a ``marshal`` dump of a dict. From the host on stdin, a first
frame ``{"python", "env"}``, then one per program ``{"i", "dir", "stdin" (bytes), "timeout_s", "cpu_s", "as",
"fsize", "nofile", "max_output"}``; to the host on stdout ``{"ev": "ready"}``, then per program ``{"ev": "start",
"i"}`` and ``{"ev": "end", "i", "code", "sig", "out", "err" (bytes), "out_cut", "err_cut", "wall", "why"}``, ``why``
being "wall" (the wall-clock limit), "output" (over ``max_output``) or "". The host gives every verdict."""
import _signal
import ctypes
import marshal
import os
import resource
import select
import time

WORK = "/sandbox"
CLEAN = (WORK, "/tmp", "/dev/shm")
SIGKILL, SIGXFSZ, SIGPIPE, SIGINT = 9, 25, 13, 2


def send(obj) -> None:
    data = marshal.dumps(obj, 4)
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(1, view):]


def read_exact(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def receive(fd: int = 0):
    """The next frame from the host, or None at its end."""
    try:
        head = read_exact(fd, 4)
    except EOFError:
        return None
    return marshal.loads(read_exact(fd, int.from_bytes(head, "big")))


def empty(folder: str) -> None:
    """Remove everything under ``folder`` (folders a program locked with chmod 0 are opened again first)."""
    for root, dirs, files in os.walk(folder, topdown=True, onerror=None):
        for d in dirs:
            try:
                os.chmod(os.path.join(root, d), 0o700, follow_symlinks=False)
            except OSError:
                pass
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            try:
                os.unlink(os.path.join(root, name))
            except OSError:
                pass
        for name in dirs:
            p = os.path.join(root, name)
            try:
                os.unlink(p) if os.path.islink(p) else os.rmdir(p)
            except OSError:
                pass


def reap_all() -> None:
    """Kill every other process of the namespace and wait until none is left."""
    try:
        os.kill(-1, SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def child(test, python: str, env: dict, rin: int, wout: int, werr: int) -> None:
    """In the forked child: limits, pipes, folder, then exec. Never returns."""
    try:
        for sig in (SIGPIPE, SIGXFSZ, SIGINT):
            _signal.signal(sig, _signal.SIG_DFL)
        cpu = max(int(test["cpu_s"] + 0.999), 1)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # soft below hard: SIGXCPU first, a timeout
        resource.setrlimit(resource.RLIMIT_AS, (test["as"], test["as"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (test["fsize"], test["fsize"]))
        resource.setrlimit(resource.RLIMIT_NOFILE, (test["nofile"], test["nofile"]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.dup2(rin, 0)
        os.dup2(wout, 1)
        os.dup2(werr, 2)
        os.closerange(3, 1 << 16)
        os.chdir(WORK)
        os.execve(python, [python, "-I", "-S", "-B", "main.py"], env)
    finally:
        os._exit(126)


def copy(src: str, dst: str) -> None:
    fi = os.open(src, os.O_RDONLY)
    fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while os.sendfile(fo, fi, None, 1 << 20):
            pass
    finally:
        os.close(fi)
        os.close(fo)


def run_one(test, python: str, env: dict) -> dict:
    for folder in CLEAN:
        if os.path.isdir(folder):
            empty(folder)
    src = "/.in/" + test["dir"]
    for name in os.listdir(src):
        copy(src + "/" + name, WORK + "/" + name)
    rin, win = os.pipe()
    rout, wout = os.pipe()
    rerr, werr = os.pipe()
    t0 = time.monotonic()
    send({"ev": "start", "i": test["i"]})
    pid = os.fork()
    if pid == 0:
        child(test, python, env, rin, wout, werr)
    for fd in (rin, wout, werr):
        os.close(fd)
    out, err, cut, status, why = pump(pid, win, rout, rerr, test["stdin"], t0 + test["timeout_s"],
                                      test["max_output"])
    code = sig = None
    if status is not None:
        if os.WIFEXITED(status):
            code = os.WEXITSTATUS(status)
        elif os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
    return {"ev": "end", "i": test["i"], "code": code, "sig": sig, "why": why, "out": out, "err": err,
            "out_cut": cut[0], "err_cut": cut[1], "wall": time.monotonic() - t0}


def pump(pid: int, win: int, rout: int, rerr: int, stdin: bytes, deadline: float, cap: int):
    """Feed the child's stdin, read its outputs up to ``cap`` each, until it ends (then everything else is killed)
    or the deadline or the cap stops it. (stdout, stderr, bytes cut of each, wait status or None, why)."""
    bufs = {rout: bytearray(), rerr: bytearray()}
    cut = {rout: 0, rerr: 0}
    ep = select.epoll()
    for fd in (rout, rerr):
        os.set_blocking(fd, False)
        ep.register(fd, select.EPOLLIN)
    pending = memoryview(stdin)
    open_fds = {rout, rerr}
    if pending:
        os.set_blocking(win, False)
        ep.register(win, select.EPOLLOUT)
        open_fds.add(win)
    else:
        os.close(win)
    pidfd = os.pidfd_open(pid)
    ep.register(pidfd, select.EPOLLIN)  # readable once the child has ended
    open_fds.add(pidfd)
    status, why, ended = None, "", False
    while not (ended and not (open_fds & {rout, rerr})):
        left = deadline - time.monotonic()
        if left <= 0 and not ended:
            why, ended = "wall", True
            reap_all()
            continue
        for fd, _ in ep.poll(max(left, 0) if not ended else 1.0):
            if fd == pidfd:
                ep.unregister(pidfd)
                os.close(pidfd)
                open_fds.discard(pidfd)
                if not ended:
                    try:
                        _, status = os.waitpid(pid, 0)
                    except ChildProcessError:
                        pass
                    reap_all()  # the program's own end ends its run: what it left behind goes now
                    ended = True
            elif fd == win:
                try:
                    pending = pending[os.write(win, pending[:65536]):]
                except OSError:  # the program closed its stdin (or ended) before reading it all
                    pending = pending[:0]
                if not pending:
                    ep.unregister(win)
                    os.close(win)
                    open_fds.discard(win)
            else:
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    ep.unregister(fd)
                    os.close(fd)
                    open_fds.discard(fd)
                    continue
                room = max(cap - len(bufs[fd]), 0)
                bufs[fd] += data[:room]
                cut[fd] += len(data) - min(len(data), room)
        if (cut[rout] or cut[rerr]) and not ended:
            why, ended = "output", True
            reap_all()
    for fd in open_fds:
        os.close(fd)
    ep.close()
    return bytes(bufs[rout]), bytes(bufs[rerr]), (cut[rout], cut[rerr]), status, why


def main() -> None:
    _signal.signal(SIGINT, _signal.SIG_DFL)  # no handler: a PID namespace's init then ignores it
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0: no /proc/1/fd, /proc/1/mem for the programs
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
    for fd in (0, 1, 2):
        os.set_inheritable(fd, False)
    first = receive()
    python, env = first["python"], first["env"]
    send({"ev": "ready"})
    while True:
        test = receive()
        if test is None:
            break
        send(run_one(test, python, env))
    reap_all()


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # the host stopped listening: nothing to tell anybody
        os._exit(1)
    except Exception as e:  # noqa: BLE001 (the host reads this on its diagnostic pipe)
        os.write(2, f"sandbox supervisor: {type(e).__name__}: {e}\n".encode())
        os._exit(1)
