"""How a rank that fails leaves a job: one line naming its rank, phase and step (and what the heartbeats know of
its peers), then ``os._exit``, since a clean interpreter exit could wait on peers that are gone (gloo's threads,
vLLM). SIGTERM from the launcher is reported the same way, from a thread, even while the main thread is blocked
inside a collective. The heartbeats themselves: ``rlhf.distributed.watchdog``."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from rlhf.distributed import rank_state
from rlhf.distributed.heartbeat import kill_if_local

log = logging.getLogger(__name__)

SIGTERM_BACKSTOP_S = 5.0
"""After SIGTERM, the longest a rank that is already reporting its own failure may take to end (torchrun waits
30 s before its SIGKILL)."""
_PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
                      "connection closed", "ECONNRESET", "Timed out waiting", "timed out", "Timeout")


def failure_line(exc: BaseException, rank: int) -> str:
    """The one line for an exception that ends this rank: rank, phase, step, the exception, and what the
    heartbeats know about the peers (a peer that died is named; a stopped one on this host is killed, as it would
    hold up the launcher's teardown)."""
    msg = " ".join(str(exc).split())[:300]
    where = rank_state.where(rank_state.current_phase())
    lost = any(m in str(exc) for m in _PEER_LOST_MARKERS)
    line = f"error: rank {rank} {'lost a peer' if lost else 'failed'} in {where}: {type(exc).__name__}: {msg}"
    dog = rank_state.running_watchdog()
    if dog is None:
        return line
    peers, silent = dog.diagnose(wait_s=1.0 if lost else 0.0)
    killed = [hb["pid"] for hb in silent if kill_if_local(hb, dog.host)]
    if killed:
        peers += f"; killed the silent process(es) {killed} on this host"
    return line + (f" [{peers}]" if peers else "")


def fail_job(exc: BaseException, code: int = 1) -> None:
    """Report ``exc`` in one line (after its traceback) and leave at once: a rank that failed must not wait in
    interpreter teardown (gloo's threads, vLLM) while its peers are gone or blocked."""
    import traceback

    rank_state.failed.set()
    try:
        traceback.print_exception(exc, file=sys.stderr)
    except Exception:
        pass
    dog = rank_state.running_watchdog()
    rank_state.emit(failure_line(exc, dog.rank if dog is not None else int(os.environ.get("RANK", 0))))
    end_rank(code)


def end_rank(code: int) -> int:
    """Leave with ``code``: at once (``os._exit``, output flushed) in a job whose watchdog runs, where a normal
    interpreter exit could wait on peers that are gone; otherwise return ``code`` to the caller."""
    if not rank_state.watchdog_running():
        return code
    rank_state.failed.set()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
    finally:
        os._exit(code)


EXIT_JOIN_S = 30.0
"""At a launched process's end (``exit_process``), the longest it waits for non-daemon threads to finish
(``RLHF_EXIT_JOIN_S`` overrides); the ``atexit`` handlers then get ``EXIT_ATEXIT_S`` more. Past both the process
ends anyway, naming what it did not wait for: a job whose work is done must not burn its allocation waiting on a
thread some library left idle."""
EXIT_ATEXIT_S = 60.0
"""``RLHF_EXIT_ATEXIT_S`` overrides."""


_ending = False


def run_then_exit(main) -> None:
    """A launched process's whole life: ``exit_process(main())``, with ``process_ending()`` true meanwhile, so that
    teardown which only frees memory for later use (a generator's garbage collections) can be skipped."""
    global _ending
    _ending = True
    exit_process(main())


def process_ending() -> bool:
    """Whether this process ends when its entry point returns (``run_then_exit``): in a test's own process, or a
    library caller's, it does not."""
    return _ending


def _threading_exit_hooks() -> list:
    """The hooks a normal interpreter exit runs before it joins non-daemon threads (``threading._shutdown`` runs
    ``threading._threading_atexits``, CPython 3.9-3.14): ``concurrent.futures`` registers one that wakes every idle
    pool worker, so that a ``ThreadPoolExecutor`` dropped without ``shutdown()`` ends. Without them such a worker
    waits on its queue for ever (only the executor's finalizer, run by the garbage collection that
    ``exit_process`` skips, would wake it). Logged once where this Python has no such list."""
    hooks = getattr(threading, "_threading_atexits", None)
    if hooks is None:
        log.warning("exit: this Python has no threading._threading_atexits; idle thread pools are not woken at exit")
        return []
    return list(reversed(hooks))


def exit_process(code: int | None, join_s: float | None = None, atexit_s: float | None = None) -> None:
    """The end of a launched process (a ``launch/*.py`` job or a converter tool run as a script), without the
    interpreter's teardown: its last full garbage collection walks every object that torch, megatron-core and vLLM
    created, 2.6-2.9 s a process at the end of a job (measured on a 2-core AMD EPYC, a one-rank tiny PPO job of 27-31 s
    in all), and frees nothing that a process about to end needs freed. What a normal exit does that matters runs
    first, in the same order: threading's own exit hooks (which wake idle thread pools), the non-daemon threads
    joined, the ``atexit`` handlers (logging's flush, the watchdog's "done", weakref finalizers such as temporary
    folders, W&B), stdout and stderr flushed. Unlike a normal exit every wait is bounded: the joins by ``join_s``
    (``EXIT_JOIN_S``), the hooks and handlers by a backstop thread that ends the process ``atexit_s`` later; the
    threads not waited for are named in one warning. Files the program left open unflushed would lose their buffers
    (ours are closed by their owners: metrics, checkpoints). ``gc.freeze()`` would skip the collection too, but
    extension modules then report every object as leaked on stderr at exit (nanobind, through Triton)."""
    import atexit

    code = 0 if code is None else code if isinstance(code, int) else 1
    join_s = float(os.environ.get("RLHF_EXIT_JOIN_S", EXIT_JOIN_S)) if join_s is None else join_s
    atexit_s = float(os.environ.get("RLHF_EXIT_ATEXIT_S", EXIT_ATEXIT_S)) if atexit_s is None else atexit_s
    deadline = time.monotonic() + join_s
    me = threading.current_thread()

    def backstop() -> None:  # whatever a hook, a join or a handler waits on, the process ends
        time.sleep(join_s + atexit_s)
        left = [t.name for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
        rank_state.emit(f"exit: gave up after {join_s + atexit_s:.0f} s in the exit hooks or atexit handlers; "
                        f"non-daemon threads still alive: {left or 'none'}")
        os._exit(code)

    threading.Thread(target=backstop, name="rlhf-exit-backstop", daemon=True).start()
    for hook in _threading_exit_hooks():  # concurrent.futures' joins its woken workers without a bound: a thread
        t = threading.Thread(target=hook, name="rlhf-exit-hook", daemon=True)  # of ours waits for it, bounded
        t.start()
        t.join(max(0.0, deadline - time.monotonic()))
    left = []
    for t in threading.enumerate():
        if t is me or t.daemon:
            continue
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            left.append(t.name)
    if left:
        rank_state.emit(f"exit: did not wait for non-daemon thread(s) still running after {join_s:.0f} s: "
                        f"{', '.join(left)}")
    try:
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def watch_sigterm(rank: int) -> None:
    """A launcher that stops the job (torchrun after a peer's failure, Slurm's scancel) sends SIGTERM, which by
    default ends a rank without a word. Python runs a signal handler only when the main thread next executes
    bytecode, which a rank blocked in a collective does not; but the C-level handler writes the signal's number to
    ``signal.set_wakeup_fd`` at once, so a thread reading that pipe reports (this rank's phase, and any peer the
    heartbeats know died) and exits 143 within milliseconds. Skipped (logged) where something else already owns
    the wakeup fd. Call from the main thread."""
    global _handler_installed
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: _on_sigterm(rank))
    _handler_installed = True
    prev = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    if prev != -1:  # someone else reads the wakeup fd: put theirs back, keep only the Python-level handler
        signal.set_wakeup_fd(prev)
        os.close(rfd), os.close(wfd)
        log.info("watchdog: the signal wakeup fd is in use; SIGTERM is reported when the main thread next runs")
        return
    _pipe[:] = [rfd, wfd]

    def reader() -> None:
        while True:
            try:
                data = os.read(rfd, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                _on_sigterm(rank, backstop_s=SIGTERM_BACKSTOP_S)

    threading.Thread(target=reader, name="rlhf-sigterm", daemon=True).start()


_handler_installed = False
_pipe: list[int] = []
"""``watch_sigterm``'s wakeup pipe (read end, write end); empty where the wakeup fd was someone else's."""


def release_in_forked_child() -> None:
    """In a child forked from a rank (dist_checkpointing's writers; ``rlhf.distributed.watchdog`` calls this from
    its at-fork hook): SIGTERM kills the child as it kills any process. With the rank's handler it would report as
    the rank, read the job's store through the connection it shares with the rank (the two processes then took
    each other's replies, and the rank hung until torchrun's SIGKILL 30 s later), and its C-level handler would
    write to the rank's wakeup pipe, so that a SIGTERM to the child alone ended the rank."""
    if not _handler_installed:
        return
    try:
        if _pipe:
            signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):  # not the main thread of the main interpreter: nothing was inherited there
        pass
    for fd in _pipe:
        try:
            os.close(fd)
        except OSError:
            pass
    _pipe.clear()


def _on_sigterm(rank: int, backstop_s: float | None = None) -> None:
    """Report this rank's SIGTERM in one line and exit 143. If the rank is already failing (its main thread is
    reporting an exception), that report goes first; the reader thread (``backstop_s``) still ends the rank if
    that report has not ended it by then."""
    if rank_state.failed.is_set():
        if backstop_s is not None:
            time.sleep(backstop_s)
            os._exit(128 + signal.SIGTERM)
        return
    rank_state.failed.set()
    dog = rank_state.running_watchdog()
    peers = dog.diagnose(wait_s=0.5)[0] if dog is not None else ""
    where = rank_state.where(rank_state.current_phase())
    rank_state.emit(f"error: rank {rank} stopped by its launcher (SIGTERM) in {where}"
                    + (f" [{peers}]" if peers else ""))
    os._exit(128 + signal.SIGTERM)
