"""Nothing a test starts outlives it: the tagged runner kills a whole torchrun job on a timeout (a rank that
ignores SIGTERM included), and a launched one-rank job dies with its launcher (the parent-death signal every
launched rank arms, ``rlhf/distributed/watchdog.py::start_watchdog``). Every job here is torchrun's own (a rank
per interpreter): the process tree is what these tests are about. Each has its negative control: the plain
``subprocess.run(timeout=...)`` kill, and the rank with the watchdog off, both leave the rank running."""
from __future__ import annotations

import os
import subprocess
import time
import uuid

import psutil
import pytest
from crash_harness import Job
from helpers import JOB_TAG, REPO, job_processes, kill_job, run_torchrun

_STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid())); os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""

_LAUNCHED_ALONE = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from rlhf.distributed.watchdog import start_watchdog
start_watchdog(0, 1, "127.0.0.1", int(os.environ["MASTER_PORT"]), 60.0)
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid())); os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for_file(path, proc, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < deadline, "the rank never started"
        time.sleep(0.05)
    return int(open(path).read())


def test_a_rank_that_ignores_sigterm_is_gone_after_a_timeout(tmp_path):
    script, pidfile, tag = tmp_path / "stubborn.py", str(tmp_path / "pid"), uuid.uuid4().hex
    script.write_text(_STUBBORN)
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_torchrun(str(script), 1, [pidfile], timeout=20, launcher="torchrun", **{JOB_TAG: tag})
    assert time.monotonic() - t0 < 60, "the kill took longer than the timeout's margin"
    assert os.path.exists(pidfile), "the rank had not started within 20 s: nothing was tested"
    pid = int(open(pidfile).read())
    assert not _alive(pid), f"rank {pid} outlived the timeout"
    assert job_processes(tag) == []

    # Negative control: what subprocess.run(timeout=...) does on a timeout (kill torchrun, the child it started)
    # leaves the rank running.
    os.remove(pidfile)
    job = Job(str(script), 1, [pidfile], launcher="torchrun")  # torchrun in the background, tagged
    try:
        pid = _wait_for_file(pidfile, job.proc)
        job.proc.kill()
        job.proc.wait(timeout=30)
        time.sleep(1.0)
        assert _alive(pid), "control: the rank died with torchrun alone, so the test above shows nothing"
    finally:
        kill_job(job.tag, job.proc.pid)
    assert not _alive(pid)


@pytest.mark.parametrize("watchdog", ["1", "0"])
def test_a_launched_single_rank_dies_with_its_launcher(tmp_path, watchdog):
    """``watchdog=0`` is the negative control: with ``RLHF_WATCHDOG=0`` no parent-death signal is armed, and the rank
    of a one-rank job lives on after torchrun is SIGKILLed (as every one-rank job did before the signal was armed
    for world size 1)."""
    script, pidfile = tmp_path / "alone.py", str(tmp_path / "pid")
    script.write_text(_LAUNCHED_ALONE.format(repo=REPO))
    job = Job(str(script), 1, [pidfile], launcher="torchrun", RLHF_WATCHDOG=watchdog)
    try:
        pid = _wait_for_file(pidfile, job.proc)
        job.proc.kill()  # torchrun alone, as a scheduler's SIGKILL of the launcher would
        job.proc.wait(timeout=30)
        deadline = time.monotonic() + (10 if watchdog == "1" else 2)  # the control only needs to outlive a moment
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if watchdog == "1":
            assert not _alive(pid), f"rank {pid} outlived its launcher by 10 s"
        else:
            assert _alive(pid), "control: without the parent-death signal the rank should have lived on"
    finally:
        kill_job(job.tag, job.proc.pid)


def test_spawned_ranks_and_a_silent_child_are_bounded(tmp_path):
    """The suite's bounds on what it starts without torchrun: ``spawn_within`` kills ranks that never end after its
    timeout (none alive afterwards) and ``readline_within`` kills a child that never prints its line."""
    import sys

    from helpers import readline_within, sleep_forever, spawn_within

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="still running after 8 s"):
        spawn_within(sleep_forever, (str(tmp_path),), nprocs=2, timeout=8)
    # the ranks that got as far as writing their pid (under the suite's load a spawned rank may take seconds to
    # import): none alive; at least one did, so the check is not empty
    pids = [int((tmp_path / str(r)).read_text()) for r in (0, 1) if (tmp_path / str(r)).exists()]
    assert pids and not any(_alive(p) for p in pids) and time.monotonic() - t0 < 60, pids
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    with pytest.raises(TimeoutError):
        readline_within(proc, 1)
    assert proc.wait(timeout=10) == -9
