"""``rlhf.distributed.failures.exit_process``: the end of a launched process without the interpreter's teardown
still does what a normal exit does that matters (non-daemon threads joined, ``atexit`` handlers run, buffered stdout
flushed, the exit code kept), and never waits for ever: a ``ThreadPoolExecutor`` some library dropped without
``shutdown()`` (kept alive by a reference cycle, automatic collection off: what hung README command (1) after its PPO
stage) is woken as a normal exit wakes it, and a thread that never ends is named and left after the bound.
Controls: a bare ``os._exit`` loses all three; the join as it was before (no exit hooks, no bound) hangs on the
dropped executor, shown bounded by the test's own timeout."""
import os
import subprocess
import sys
import time

import pytest

from helpers import REPO, run_tagged

SCRIPT = r"""
import atexit, concurrent.futures, gc, os, sys, threading, time
out, how = sys.argv[1], sys.argv[2]
atexit.register(lambda: open(os.path.join(out, "atexit"), "w").close())
def late():
    time.sleep(0.3)
    open(os.path.join(out, "thread"), "w").close()
threading.Thread(target=late).start()
if "pool" in how:  # a library's executor, dropped without shutdown() and kept alive by a reference cycle
    gc.disable()
    ex = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    ex.submit(lambda: None).result()  # its worker is now idle on the queue
    ex.cycle = ex
    del ex
if "idle" in how:  # a non-daemon thread that never ends
    threading.Thread(target=threading.Event().wait, name="never-ends").start()
if "hang_atexit" in how:
    atexit.register(threading.Event().wait)
print("buffered line", end="")  # stdout is a pipe: block-buffered, lost unless flushed
if how.startswith("exit_process"):
    from rlhf.distributed.failures import exit_process
    exit_process(7)
if how.startswith("old_join"):  # exit_process as it was until 2026-11-28: join every non-daemon thread, no hooks
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
os._exit(7)
"""


def _run(tmp_path, how, timeout=60, **env):
    out = tmp_path / how
    out.mkdir()
    base = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    t0 = time.monotonic()
    p = run_tagged([sys.executable, "-c", SCRIPT, str(out), how], timeout,
                   full_env={**base, "PYTHONPATH": REPO, **env})
    return p, sorted(os.listdir(out)), time.monotonic() - t0


def test_exit_process_joins_threads_runs_atexit_and_flushes(tmp_path):
    p, files, _ = _run(tmp_path, "exit_process")
    assert p.returncode == 7, p.stderr
    assert files == ["atexit", "thread"] and p.stdout == "buffered line", (files, p.stdout, p.stderr)
    assert "did not wait" not in p.stderr, p.stderr
    p, files, _ = _run(tmp_path, "bare")  # negative control: os._exit alone
    assert p.returncode == 7 and files == [] and p.stdout == "", (files, p.stdout, p.stderr)


def test_dropped_executor_is_woken_and_a_thread_that_never_ends_is_bounded(tmp_path):
    # The dropped executor alone: woken by concurrent.futures' own exit hook, so nothing is left behind and the
    # process ends well inside the join bound (20 s here; it ends in ~0.5 s: start-up plus the 0.3 s thread).
    p, files, secs = _run(tmp_path, "exit_process_pool", RLHF_EXIT_JOIN_S="20")
    assert p.returncode == 7 and files == ["atexit", "thread"] and p.stdout == "buffered line", (p.stderr, files)
    assert "did not wait" not in p.stderr and secs < 15, (secs, p.stderr)
    # With a thread that never ends beside it: the process ends after the 2 s bound, names that thread (and only
    # it: the pool's worker was woken), and still runs its atexit handlers and flushes its output.
    p, files, secs = _run(tmp_path, "exit_process_pool_idle", RLHF_EXIT_JOIN_S="2")
    assert p.returncode == 7 and files == ["atexit", "thread"] and p.stdout == "buffered line", (p.stderr, files)
    line = [ln for ln in p.stderr.splitlines() if "did not wait" in ln]
    assert len(line) == 1 and line[0].endswith(": never-ends"), p.stderr
    assert secs < 30, secs
    # Control: the join as it was hangs on the dropped executor (bounded here by the 6 s timeout, then killed).
    with pytest.raises(subprocess.TimeoutExpired):
        _run(tmp_path, "old_join_pool", timeout=6)


def test_an_atexit_handler_that_hangs_is_bounded(tmp_path):
    """The backstop: a handler that never returns ends the process after join + atexit bounds, exit code kept."""
    p, files, secs = _run(tmp_path, "exit_process_hang_atexit", RLHF_EXIT_JOIN_S="1", RLHF_EXIT_ATEXIT_S="2")
    assert p.returncode == 7 and "gave up after 3 s" in p.stderr, (p.returncode, p.stderr)
    assert secs < 30, secs
