"""``rlhf.distributed.failures.exit_process``: the end of a launched process without the interpreter's teardown
still does what a normal exit does that matters (non-daemon threads joined, ``atexit`` handlers run, buffered stdout
flushed, the exit code kept). Negative control: a bare ``os._exit`` in the same script loses all three."""
import os
import subprocess
import sys

from helpers import REPO

SCRIPT = r"""
import atexit, os, sys, threading, time
out = sys.argv[1]
atexit.register(lambda: open(os.path.join(out, "atexit"), "w").close())
def late():
    time.sleep(0.3)
    open(os.path.join(out, "thread"), "w").close()
threading.Thread(target=late).start()
print("buffered line", end="")  # stdout is a pipe: block-buffered, lost unless flushed
if sys.argv[2] == "exit_process":
    from rlhf.distributed.failures import exit_process
    exit_process(7)
os._exit(7)
"""


def _run(tmp_path, how):
    out = tmp_path / how
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(out), how], capture_output=True, text=True, timeout=120,
                       cwd=REPO, env={**env, "PYTHONPATH": REPO})
    return p, sorted(os.listdir(out))


def test_exit_process_joins_threads_runs_atexit_and_flushes(tmp_path):
    p, files = _run(tmp_path, "exit_process")
    assert p.returncode == 7, p.stderr
    assert files == ["atexit", "thread"] and p.stdout == "buffered line", (files, p.stdout, p.stderr)
    p, files = _run(tmp_path, "bare")  # negative control: os._exit alone
    assert p.returncode == 7 and files == [] and p.stdout == "", (files, p.stdout, p.stderr)
