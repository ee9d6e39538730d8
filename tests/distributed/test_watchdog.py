"""The watchdog's parts one by one (rlhf/distributed/watchdog.py); whole jobs meeting faults are in
tests/train/test_sft_rm_faults.py, tests/dpo/test_dpo_faults.py and tests/ppo/test_ppo_faults.py.

Heartbeats against an in-memory store (a stalled neighbour, a finished one, a dead local one), the phase a
failure is reported in, the fault-injection syntax, the parent-death signal of a rank's forked children and their
own SIGTERM (each with its negative control), and the SIGTERM report of a rank blocked in a gloo collective."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from helpers import REPO, readline_within, test_env

from rlhf.distributed import faults
from rlhf.distributed import failures
from rlhf.distributed import watchdog as wd


class DictStore:
    """The three TCPStore calls the watchdog makes."""

    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self.d[k]

    def check(self, keys):
        return all(k in self.d for k in keys)


def _hb(store, rank, seq, phase="update", step=3, pid=None, host=None, ctime=None):
    store.set(f"hb/{rank}", json.dumps({"seq": seq, "phase": phase, "step": step, "pid": pid or os.getpid(),
                                        "host": host or "elsewhere/boot", "ctime": ctime}))


def _dog(rank=0, world=4, timeout=0.3):
    store = DictStore()
    dog = wd.Watchdog(rank, world, store, wd.WatchdogConfig(timeout_s=timeout, interval_s=0.05))
    return dog, store


def test_neighbours_form_a_ring():
    assert _dog(0, 4)[0].watched == [1, 2]
    assert _dog(3, 4)[0].watched == [0, 1]
    assert _dog(1, 2)[0].watched == [0]


def test_a_silent_neighbour_is_named_with_its_phase_after_the_timeout():
    # 0.2 s into a 2 s timeout: the first check stays quiet unless this process is descheduled for 1.8 s (a loaded
    # 2-core machine has stalled a sleeping test for 0.1 s; 0.1 s of slack was too little). The second check comes
    # after >= 2.2 s of silence, which the sleep guarantees.
    dog, store = _dog(timeout=2.0)
    _hb(store, 1, 1), _hb(store, 2, 1)
    assert dog.check() is None
    time.sleep(0.2)
    _hb(store, 2, 2)  # rank 2 keeps beating, rank 1 does not
    assert dog.check() is None  # 0.2 s < 2 s
    time.sleep(2.0)
    _hb(store, 2, 3)
    what, hb = dog.check()
    assert re.match(r"rank 1 has not answered for [2-9] s \(--dist_timeout_s 2\)", what), what
    assert "last in phase 'update' (step 3)" in what, what
    assert hb["seq"] == 1
    assert json.loads(store.get("hb/0"))["seq"] == 3  # it published its own heartbeat on each check


def test_a_finished_neighbour_is_not_a_stall():
    dog, store = _dog(timeout=0.1)
    _hb(store, 1, 1, phase=wd.DONE), _hb(store, 2, 1, phase=wd.DONE)
    dog.check()
    time.sleep(0.2)
    assert dog.check() is None


def test_a_dead_neighbour_on_this_host_is_named_after_a_second():
    """Long before the timeout; not at once, as a neighbour that leaves through os._exit at the end of a job is
    gone a moment before this rank leaves the same way."""
    dog, store = _dog(timeout=100)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process (or, rarely, a new one with another start time)
    _hb(store, 1, 1, pid=child.pid, host=dog.host, ctime=1.0), _hb(store, 2, 1)
    assert dog.check() is None
    assert dog.check() is None  # gone, for less than a second
    time.sleep(1.05)
    what, _ = dog.check()
    assert what == f"rank 1 (pid {child.pid}) died in phase 'update' (step 3)", what


def test_a_neighbour_that_never_starts_is_named():
    dog, store = _dog(timeout=0.1)
    _hb(store, 2, 1)
    assert dog.check() is None
    time.sleep(0.15)
    _hb(store, 2, 2)
    assert dog.check()[0] == "rank 1 never published a heartbeat in 0.1 s"


def test_a_failure_is_reported_in_the_innermost_phase():
    wd.set_step(4)
    with wd.phase("train"):
        with wd.phase("update"):
            pass
        assert wd.current_phase() == ("train", 4)  # restored on the way out
        with pytest.raises(RuntimeError):
            with wd.phase("checkpoint_save"):
                raise RuntimeError("disk")
        # an exception leaves the phase where it was raised: the failure line names it
        assert wd.current_phase() == ("checkpoint_save", 4)
        line = failures.failure_line(RuntimeError("disk\nfull"), rank=3)
        assert line == "error: rank 3 failed in phase 'checkpoint_save' (step 4): RuntimeError: disk full"
        lost = failures.failure_line(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1"), rank=0)
        assert lost.startswith("error: rank 0 lost a peer in phase 'checkpoint_save' (step 4): RuntimeError")
    wd.set_phase("setup"), wd.set_step(None)


def test_fault_specs_and_timeout_flag():
    assert faults.parse_faults("raise:checkpoint_save:1:2, stop:enter-rollout:0::1") == [
        faults.Fault("raise", "checkpoint_save", 1, 2, 0), faults.Fault("stop", "enter-rollout", 0, None, 1)]
    with pytest.raises(ValueError, match="RLHF_FAULT_INJECT: 'explode:update:1'"):
        faults.parse_faults("explode:update:1")
    assert wd.resolve_timeout_s(None, "cuda") == 300 and wd.resolve_timeout_s(None, "cpu") == 180
    with pytest.raises(ValueError, match="--dist_timeout_s must be > 0, got 0"):
        wd.resolve_timeout_s(0, "cpu")


_FORKER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    from rlhf.distributed import parent_death
    if sys.argv[1] == "1":
        parent_death.die_with_parent()
    pid = os.fork()
    if pid == 0:  # the child, as dist_checkpointing's forked writers: sleeps, outlives nothing if armed
        time.sleep(120)
        os._exit(0)
    print(pid, flush=True)
    time.sleep(120)
""")


@pytest.mark.parametrize("armed", [True, False])
def test_children_forked_by_a_rank_die_with_it(armed):
    """A rank's main thread forks a child; the rank is SIGKILLed. Armed (every rank is): the child dies with it.
    Negative control, unarmed: the child lives on (an orphan, as the one once found after a crash test)."""
    proc = subprocess.Popen([sys.executable, "-c", _FORKER.format(repo=REPO), "1" if armed else "0"],
                            stdout=subprocess.PIPE, text=True, env=test_env())
    child = None
    try:
        child = psutil.Process(int(readline_within(proc, 60)))
        proc.kill()
        proc.wait()
        gone, alive = psutil.wait_procs([child], timeout=3)
        assert bool(gone) == armed, (armed, child.status() if alive else "gone")
    finally:
        proc.kill()
        proc.wait()
        if child is not None and child.is_running():
            child.kill()


_BLOCKED = textwrap.dedent("""
    import os, sys, time, datetime
    sys.path.insert(0, {repo!r})
    import torch, torch.distributed as dist
    from rlhf.distributed import watchdog
    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    watchdog.start_watchdog(rank, 2, "127.0.0.1", int(os.environ["MASTER_PORT"]), 60.0)
    watchdog.set_step(7)
    watchdog.set_phase("waiting")
    print("ready", flush=True)
    if rank == 0:
        t = torch.zeros(1)
        dist.recv(t, src=1)  # rank 1 never sends: blocked inside gloo, not in Python
    else:
        time.sleep(120)
""")


def test_sigterm_is_reported_from_inside_a_collective():
    """torchrun ends the survivors of a failed rank with SIGTERM; one blocked in a gloo receive never runs a Python
    handler, but the wakeup-fd thread reports its rank and phase and exits 143 within a second."""
    from helpers import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _BLOCKED.format(repo=REPO)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=test_env(RANK=str(r), MASTER_PORT=port, WORLD_SIZE="2")) for r in (0, 1)]
    try:
        for p in procs:
            assert readline_within(p, 60).strip() == "ready"
        time.sleep(0.5)
        t0 = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        rc = procs[0].wait(timeout=10)
        took = time.monotonic() - t0
        err = procs[0].stderr.read()
        assert rc == 128 + signal.SIGTERM and took < 2.0, (rc, took, err[-2000:])
        assert "error: rank 0 stopped by its launcher (SIGTERM) in phase 'waiting' (step 7)" in err, err[-2000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()


class HangingStore(DictStore):
    """A store whose reads never return (its host stalled, or a connection another process also read from)."""

    def get(self, k):
        time.sleep(3600)


def test_a_failing_rank_never_waits_on_the_store():
    """The report of a failing rank reads the peers' heartbeats with a bound: a store that never answers costs at
    most wait_s + DIAGNOSE_SLACK_S and is said. Negative control: the same read, unbounded, is still blocked."""
    import threading

    dog = wd.Watchdog(0, 2, HangingStore(), wd.WatchdogConfig(timeout_s=60, interval_s=0.05))
    _hb(dog.store, 1, 1)
    t0 = time.monotonic()
    peers, silent = dog.diagnose(wait_s=0.2)
    took = time.monotonic() - t0
    assert took < 0.2 + wd.DIAGNOSE_SLACK_S + 0.5 and silent == [], took
    assert peers == f"the job's store did not answer in {0.2 + wd.DIAGNOSE_SLACK_S:g} s; peers unknown", peers
    raw = threading.Thread(target=dog._diagnose, daemon=True)
    raw.start()
    raw.join(2.0)
    assert raw.is_alive()


_FORKS_A_WRITER = textwrap.dedent("""
    import multiprocessing, os, sys, time, datetime
    sys.path.insert(0, {repo!r})
    import torch.distributed as dist
    from rlhf.distributed import watchdog
    port = int(sys.argv[1])
    if sys.argv[2] == "0":  # the negative control: the at-fork hook is never registered
        watchdog._fork_hooked = True
    server = dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    watchdog.start_watchdog(0, 2, "127.0.0.1", port, 60.0)
    watchdog.set_phase("checkpoint_save")

    def writer():  # as dist_checkpointing's forked writers
        time.sleep(120)

    child = multiprocessing.get_context("fork").Process(target=writer)
    child.start()
    print(child.pid, flush=True)
    child.join()
    print("writer ended", child.exitcode, flush=True)
    time.sleep(2)
    print("rank alive", flush=True)
    os._exit(0)
""")


@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "no_fork_hook"])
def test_a_forked_writer_dies_of_sigterm_alone(hooked):
    """A child forked by a rank (dist_checkpointing's writers) dies of SIGTERM as a plain process does, and the
    rank does not take the child's SIGTERM for its own. Negative control, the watchdog's at-fork hook (which calls
    rlhf.distributed.failures' ``release_in_forked_child``) not registered: the child keeps the rank's handler and
    wakeup pipe, the rank reports "stopped by its launcher" and exits 143 (and the child would read the store
    through the rank's own connection: a torchrun teardown that hit both then hung the rank 30 s, about 1 in 50
    SIGKILL tests under load)."""
    from helpers import free_port

    proc = subprocess.Popen([sys.executable, "-c", _FORKS_A_WRITER.format(repo=REPO), str(free_port()),
                             "1" if hooked else "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=test_env())
    child = None
    try:
        child = psutil.Process(int(readline_within(proc, 60)))
        time.sleep(0.3)
        child.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        if not hooked:
            assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, out, err[-2000:])
            assert "stopped by its launcher" in err and "rank alive" not in out, (out, err[-2000:])
            return
        assert proc.returncode == 0, (proc.returncode, out, err[-2000:])
        assert out.split("\n")[:2] == [f"writer ended {-signal.SIGTERM}", "rank alive"], (out, err[-2000:])
        assert "stopped by its launcher" not in err, err[-2000:]
    finally:
        proc.kill()
        proc.wait()
        if child is not None and child.is_running():  # the control's writer may outlive its rank
            child.kill()


_LONG_BARRIER = textwrap.dedent("""
    import os, sys, time, datetime
    sys.path.insert(0, {repo!r})
    import torch.distributed as dist
    from rlhf.distributed import watchdog
    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    # a CUDA job's default group names two backends (cpu:gloo,cuda:nccl); gloo stands in for NCCL on a CPU build
    dist.init_process_group("cpu:gloo,cuda:gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        print("torch: passed")
    except ValueError as e:
        print("torch:", e)
    for i in range(2):
        t0 = time.monotonic()
        if rank == 0:
            time.sleep(1.0)  # rank 0 converts; rank 1 waits for it
        watchdog.long_barrier()
        print(f"barrier {{i}} waited {{time.monotonic() - t0:.1f}}", flush=True)
    dist.destroy_process_group()
""")


def test_long_barrier_runs_on_a_two_backend_default_group():
    """The HF export's long barrier on a CUDA job: its default group is ``cpu:gloo,cuda:nccl``, on which torch's
    ``monitored_barrier`` raises (first seen on an H200: every SFT run with an export ended rc=1 after exporting).
    ``long_barrier`` runs it on a gloo group of its own; rank 1 waits there for rank 0's second."""
    from helpers import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _LONG_BARRIER.format(repo=REPO)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=test_env(RANK=str(r), MASTER_PORT=port, WORLD_SIZE="2")) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        # the control: torch's own barrier refuses this group, as it did on the GPU
        assert "torch: monitored_barrier is only implemented for GLOO backend" in out, out
    waits = [float(w) for w in re.findall(r"barrier \d waited ([\d.]+)", outs[1][0])]
    assert len(waits) == 2 and min(waits) >= 0.8, outs[1][0]
