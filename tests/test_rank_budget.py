"""The suite's rank budget (``tests/rank_budget.py``), seen from the workers: separate processes sharing one xdist
run id take and give back ranks, and each check reads who got ranks when."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import rank_budget

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = """
import sys, time
import rank_budget
rank_budget.WAIT_CAP_S = float(sys.argv[1])
taken = []
for line in sys.stdin:
    op, n = line.split()
    if op == "acq":
        taken.append(rank_budget.acquire(int(n)))
        print("got", taken[-1], flush=True)
    else:
        rank_budget.release(taken.pop())
        print("rel", flush=True)
"""


class Worker:
    """A process standing for one xdist worker: ``acq N`` / ``rel`` on its stdin, ``got N`` / ``rel`` back."""

    def __init__(self, run: str, wait_cap: float = 60.0):
        self.env = {**os.environ, "PYTEST_XDIST_TESTRUNUID": run, "PYTHONPATH": HERE}
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(wait_cap)], env=self.env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.out.put(ln.strip()) for ln in self.proc.stdout], daemon=True).start()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float) -> str | None:
        try:
            return self.out.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> str:
        self.proc.kill()
        self.proc.wait()
        return self.proc.stderr.read()


@pytest.fixture
def workers():
    run = uuid.uuid4().hex
    made: list[Worker] = []

    def make(**kw) -> Worker:
        made.append(Worker(run, **kw))
        return made[-1]

    yield make
    for w in made:
        w.close()
    for suffix in ("", ".lock"):
        path = os.path.join(rank_budget.tempfile.gettempdir(), f"rlhf-rank-budget-{run}.json{suffix}")
        if os.path.exists(path):
            os.unlink(path)


def test_a_job_waits_while_the_other_worker_holds_the_budget(workers):
    a, b = workers(), workers()
    a.send("acq 4")
    assert a.reply(10) == "got 4"
    b.send("acq 2")
    assert b.reply(1.5) is None, "a 2-rank job started beside a 4-rank one (6 ranks over a budget of 4)"
    a.send("rel 0")
    assert a.reply(10) == "rel"
    assert b.reply(10) == "got 2"


def test_two_narrow_jobs_run_side_by_side(workers):
    a, b = workers(), workers()
    a.send("acq 2")
    b.send("acq 2")
    assert (a.reply(10), b.reply(10)) == ("got 2", "got 2")


def test_a_waiter_first_in_line_is_not_overtaken(workers):
    """A 4-rank job waiting behind a 2-rank one is not overtaken by a 2-rank job that would fit: it would wait for
    ever while the two narrow workers took turns."""
    a, b, c = workers(), workers(), workers()
    a.send("acq 2")
    assert a.reply(10) == "got 2"
    b.send("acq 4")
    assert b.reply(1.0) is None
    c.send("acq 2")
    assert c.reply(1.0) is None, "a 2-rank job overtook the 4-rank job waiting before it"
    a.send("rel 0")
    assert b.reply(10) == "got 4"
    assert c.reply(1.0) is None
    b.send("rel 0")
    assert c.reply(10) == "got 2"


def test_a_dead_holder_gives_its_ranks_back(workers):
    a, b = workers(), workers()
    a.send("acq 4")
    assert a.reply(10) == "got 4"
    b.send("acq 4")
    assert b.reply(1.0) is None
    a.proc.send_signal(signal.SIGKILL)
    assert b.reply(10) == "got 4", "the ranks of a killed worker were held for ever"


def test_a_worker_holding_ranks_gets_more_at_once(workers):
    """A test that holds a job and starts another must not wait for itself (it would until the cap, over budget)."""
    a = workers(wait_cap=5.0)
    a.send("acq 4")
    assert a.reply(10) == "got 4"
    t0 = time.monotonic()
    a.send("acq 2")
    assert a.reply(10) == "got 2"
    assert time.monotonic() - t0 < 2.0
    assert "over the budget" not in a.close()


def test_a_leaked_holder_slows_the_suite_but_never_hangs_it(workers):
    a, b = workers(), workers(wait_cap=1.0)
    a.send("acq 4")
    assert a.reply(10) == "got 4"
    b.send("acq 2")
    assert b.reply(10) == "got 2"
    assert "waited 1 s for 2 ranks; taking them over the budget" in b.close()


def test_what_is_counted(monkeypatch):
    assert rank_budget.ranks_in(["python", "-m", "torch.distributed.run", "--nproc_per_node", "4", "x.py"]) == 4
    assert rank_budget.ranks_in(["mpirun", "-np", "2", "python", "x.py"]) == 2
    assert rank_budget.ranks_in(["python", "x.py", "-n", "3"]) == 1
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    assert rank_budget.acquire(4) == 0  # outside xdist nothing is counted
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", uuid.uuid4().hex)
    assert rank_budget.acquire(1) == 0  # a one-rank job takes its idle worker's core


def test_run_tagged_waits_for_its_ranks(workers, monkeypatch):
    """The hook the suite's jobs go through: ``helpers.run_tagged`` of a 2-rank command waits while another worker
    holds the budget."""
    import helpers

    a = workers()
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", a.env["PYTEST_XDIST_TESTRUNUID"])
    a.send("acq 4")
    assert a.reply(10) == "got 4"
    done = threading.Event()
    cmd = [sys.executable, "-c", "pass", "--nproc_per_node", "2", "-"]
    t = threading.Thread(target=lambda: (helpers.run_tagged(cmd, 60), done.set()), daemon=True)
    t.start()
    assert not done.wait(1.5), "run_tagged started a 2-rank job beside a 4-rank one"
    a.send("rel 0")
    assert done.wait(30)
    t.join(10)

