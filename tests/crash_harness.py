"""Jobs that crash, stall or heal, and the checks that tell a real resume from a restart.

``Job`` runs one torchrun job with every line of its output timestamped; every process of the job (torchrun,
its ranks, whatever they fork or start) carries ``RLHF_TEST_JOB_TAG`` in its environment, so that the job's
processes are found by that tag even after their parent died, and ``Job.close`` asserts that none outlived the
job (killing any it finds, so that a failing test leaks nothing).

Crash anywhere (``crash_and_resume``): run a job, SIGKILL its whole process tree just after a chosen event in its
log, relaunch with the same command line (``--load_checkpoint`` on every launch: it starts fresh where nothing was
published yet), and repeat; every launch is checked with ``check_launch`` (a launch that had a checkpoint logged
``resumed from ... (step k)`` with k > 0 and ran only steps k+1.. ; one that had none logged the fresh start), and
the final weights must be bit-identical to an uninterrupted run's.

Kill points are events, not wall-clock times, so every phase is hit on any machine speed: ``("startup", s)``
kills ``s`` seconds after launch, or at the first step's progress line if that comes first; ``("step", k)``
after the progress line of step k; ``("save", k)`` after the "checkpoint: saving step k" line (mid-save);
``("export", 0)`` once rank 0 is held in the export (mid-export: its "fault injection: hang at export" line; on a
slow machine the megatron copy outlasts any delay after "exporting HF model", and a kill timed from that line
fell before the hold). Each is followed by a seeded random delay of up to
``jitter`` seconds. A launch that is to be killed cannot run past its point's phase: rank 0 hangs in the export
and in every checkpoint save from the point's step on (``RLHF_FAULT_INJECT=hang:...``) until the kill comes.
"""
from __future__ import annotations

import os
import random
import re
import subprocess
import threading
import time
import uuid

import psutil
import rank_budget
from helpers import (JOB_TAG, REPO, ZYGOTE_PY, job_launcher, job_processes, kill_job, leftovers,  # noqa: F401
                     test_env, torchrun_cmd)

# ------------------------------------------------------------------------------------------------ one job
class Job:
    """One torchrun job in the background: timestamped output lines, its ranks' processes, signals to one rank."""

    def __init__(self, script: str, nproc: int, args: list[str], *, max_restarts: int = 0,
                 launcher: str | None = None, **env: str):
        self.tag = uuid.uuid4().hex
        cmd = torchrun_cmd(os.path.join(REPO, script), nproc, args, max_restarts, launcher=launcher)
        self.budget = rank_budget.acquire(nproc)  # given back when the launcher ends (the reader) or at close
        self.budget_lock = threading.Lock()
        self.t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(cmd, cwd=REPO,
                                         env=test_env(PYTHONUNBUFFERED="1", **{JOB_TAG: self.tag}, **env),
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True)
        except BaseException:
            self._give_back()
            raise
        self.lines: list[tuple[float, str]] = []
        self.cond = threading.Condition()
        self.ended_at: float | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for ln in self.proc.stdout:
            with self.cond:
                self.lines.append((time.monotonic(), ln))
                self.cond.notify_all()
        self.proc.wait()
        with self.cond:
            self.ended_at = time.monotonic()
            self.cond.notify_all()
        self._give_back()

    def _give_back(self) -> None:
        with self.budget_lock:
            taken, self.budget = self.budget, 0
        rank_budget.release(taken)

    @property
    def log(self) -> str:
        with self.cond:
            return "".join(ln for _, ln in self.lines)

    def wait_for(self, pattern: str | re.Pattern, timeout: float = 300) -> float | None:
        """The time of the first line matching ``pattern`` (waiting for it), or None if the job ended or the
        timeout passed first."""
        pat = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        seen = 0
        with self.cond:
            while True:
                for t, ln in self.lines[seen:]:
                    if pat.search(ln):
                        return t
                seen = len(self.lines)
                if self.ended_at is not None or time.monotonic() >= deadline:
                    return None
                self.cond.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))

    def rank_process(self, rank: int) -> psutil.Process:
        """The live worker process of ``rank``: torchrun's child with RANK=rank in its environment, or (ranks forked
        by ``rlhf.distributed.forkrun``: the launcher's command line, and its /proc environment, which holds no rank
        variable of theirs) the launcher's ``rank``-th live forked child by pid (one node: the agent starts local
        ranks in order)."""
        forked = []
        launcher = " ".join(self.proc.args)
        parent = job_launcher(self.tag) or self.proc.pid  # a zygote's launcher is its child, not the client's
        for p in job_processes(self.tag):
            try:
                if p.ppid() != parent:
                    continue
                cmdline = " ".join(p.cmdline())
                if "rlhf.distributed.forkrun" in cmdline or ZYGOTE_PY in cmdline:
                    forked.append(p)
                elif p.environ().get("RANK") == str(rank) and "torch.distributed.run" not in cmdline:
                    return p
            except psutil.NoSuchProcess:
                continue
        forked.sort(key=lambda p: p.pid)
        if rank < len(forked):
            return forked[rank]
        seen = []
        for p in job_processes(self.tag):
            try:
                seen.append((p.pid, p.ppid(), p.status(), "RANK" in p.environ()))
            except psutil.Error as e:
                seen.append((p.pid, repr(e)))
        raise AssertionError(f"no live process of rank {rank}; the launcher is {self.proc.pid} ({launcher}) "
                             f"(exit code {self.proc.poll()}); the job's processes (pid, ppid, status, RANK in "
                             f"/proc environ): {seen}; its last lines:\n{self.log[-2000:]}")

    def signal_rank(self, rank: int, sig: int) -> float:
        """Send ``sig`` to rank ``rank``'s process only (not the tree); returns the time it was sent."""
        self.rank_process(rank).send_signal(sig)
        return time.monotonic()

    def wait(self, timeout: float = 600) -> tuple[int, float]:
        """(exit code, time it ended); the job is killed if it runs past ``timeout``."""
        try:
            rc = self.proc.wait(timeout=max(0.0, timeout - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            kill_job(self.tag, self.proc.pid)
            self.proc.wait(timeout=60)
            raise AssertionError(f"the job ran past {timeout:g} s; its last lines:\n{self.log[-3000:]}")
        self.reader.join(timeout=30)
        return rc, self.ended_at or time.monotonic()

    def close(self, grace: float = 10.0) -> None:
        """Assert that no process of the job is left once it ended (every straggler is killed first)."""
        if self.proc.poll() is None:
            kill_job(self.tag, self.proc.pid)
            self.proc.wait(timeout=60)
        self._give_back()
        left = leftovers(self.tag, grace)
        assert not left, f"processes of the job outlived it: {left}"

    def error_lines(self) -> list[str]:
        return [ln.strip() for _, ln in self.lines if ln.startswith("error:")]


# ------------------------------------------------------------------------------------------------ resume checks
_RESUMED = re.compile(r"resumed from (\S+) \(step (\d+)\)")
_FRESH = re.compile(r"--load_checkpoint: no checkpoint under \S+ yet; starting from step 0")


def progress_steps(log: str, task: str) -> list[int]:
    """The step numbers of the progress lines ``[task k/N ...]`` of one launch, in order."""
    return [int(k) for k in re.findall(rf"\[{task} (\d+)/\d+ ", log)]


def assert_resumed(log: str, task: str, *, step: int | None = None, total: int | None = None) -> int:
    """The launch resumed from a checkpoint: it logged ``resumed from ... (step k)`` with k > 0 (== ``step`` if
    given), and every step it ran comes after k, once each, in order (from k+1 to ``total`` if given: the launch
    ran to the end). Returns k. A relaunch that silently trained from scratch fails here."""
    m = _RESUMED.findall(log)
    assert len(m) == 1, f"expected one 'resumed from ... (step k)' line, found {len(m)}: the launch did not resume"
    k = int(m[0][1])
    assert k > 0, f"resumed from step {k}"
    if step is not None:
        assert k == step, f"resumed from step {k}, expected {step}"
    steps = progress_steps(log, task)
    assert steps == sorted(set(steps)) and all(s > k for s in steps), \
        f"after resuming from step {k} the launch ran steps {steps}"
    if total is not None:
        assert steps == list(range(k + 1, total + 1)), \
            f"after resuming from step {k} the launch ran steps {steps}, not {k + 1}..{total}"
    elif steps:
        assert steps[0] == k + 1, f"after resuming from step {k} the first step run was {steps[0]}"
    return k


def assert_fresh_start(log: str, task: str) -> None:
    """A launch with ``--load_checkpoint`` and nothing published yet: it said so and started at step 1."""
    assert _FRESH.search(log), "no '--load_checkpoint: no checkpoint under ... yet' line"
    assert not _RESUMED.search(log), "it resumed"
    steps = progress_steps(log, task)
    assert not steps or steps[0] == 1, f"a fresh start ran steps {steps}"


# ------------------------------------------------------------------------------------------------ crash anywhere
def _pattern(task: str, event: str, k: int) -> re.Pattern | None:
    return {"step": re.compile(rf"\[{task} {k}/\d+ "), "save": re.compile(rf"checkpoint: saving step {k} "),
            "export": re.compile(r"exporting HF model to ")}.get(event)


_HELD_IN_EXPORT = re.compile(r"fault injection: hang at export ")


def launch_and_kill(script: str, nproc: int, args: list[str], task: str, point: tuple[str, float], jitter: float,
                    rng: random.Random, timeout: float = 600,
                    later: tuple[tuple[str, float], ...] = ()) -> tuple[bool, str]:
    """One launch, its whole tree SIGKILLed at ``point``. Returns (killed, log). ``killed`` is False if the job
    ended first. No process of the job may outlive the kill.

    The kill comes a seeded random delay of up to ``jitter`` seconds after the event, but never after the event of
    a ``later`` kill point (or the export): on a machine fast enough to run past it within the delay, the kill
    falls at that event instead, so every later point still comes in a later launch. The job cannot outrun the
    kill either: rank 0 hangs (``RLHF_FAULT_INJECT`` ``hang``) in the export (after the megatron copy, before the
    HF files) and in any checkpoint save at or after the point's step (after the first role's shards), until the
    kill comes. Without the hangs, on a loaded machine the harness read the event's line seconds late and the job
    had published the next checkpoint or exported by then, so the next launch resumed past its own point."""
    steps = [int(j) for e, j in (point, *later) if e in ("step", "save")]
    first_save = int(point[1]) if point[0] in ("step", "save") else 1
    holds = ["hang:export:0"] + ([] if point[0] == "export" else  # a save after the last point's step: + 64
                                 [f"hang:checkpoint_save:0:{s}" for s in range(first_save, max(steps + [0]) + 65)])
    job = Job(script, nproc, args, RLHF_FAULT_INJECT=",".join(holds))
    event, k = point
    guards = [g for g in (_pattern(task, e, int(j)) for e, j in (*later, ("export", 0))) if g is not None]
    guards = [g for g in guards if event == "startup" or g.pattern != _pattern(task, event, int(k)).pattern]
    if event == "startup":
        # the delay, or the end of the first step if that comes first: a job fast enough to pass its first save
        # within the delay (the PPO job through the suite's zygote passed step 4's save within 6.1 s) would leave
        # the later points nothing to hit in a fresh launch
        first = re.compile("|".join([_pattern(task, "step", 1).pattern] + [g.pattern for g in guards]))
        job.wait_for(first, timeout=float(k))
    elif event == "export":  # rank 0 held in the export: the megatron copy written, the HF files not yet
        job.wait_for(_HELD_IN_EXPORT, timeout=timeout)
    else:
        job.wait_for(_pattern(task, event, int(k)), timeout=timeout)
    hit_at = time.monotonic()
    delay = rng.uniform(0, jitter)
    while time.monotonic() < hit_at + delay and job.proc.poll() is None:
        new = [ln for t, ln in list(job.lines) if t >= hit_at]
        if any(g.search(ln) for g in guards for ln in new):
            break
        time.sleep(0.01)
    killed = job.proc.poll() is None
    if killed:
        kill_job(job.tag, job.proc.pid)
    job.proc.wait(timeout=60)
    job.reader.join(timeout=10)
    job.close()
    return killed, job.log


def has_checkpoint(ckpt_dir: str) -> bool:
    return os.path.isdir(ckpt_dir) and any(re.match(r"^iter_\d+$", d) for d in os.listdir(ckpt_dir))


def check_launch(record: dict, task: str, total: int) -> None:
    """A launch of ``crash_and_resume``: one that had a checkpoint resumed from it (and, killed or not, ran only
    steps after it; the last launch ran every remaining step), one that had none started fresh."""
    log, last = record["log"], record["point"][0] == "end"
    if record["had_checkpoint"]:
        record["resumed_step"] = assert_resumed(log, task, total=total if last else None)
    elif _FRESH.search(log) or last:  # a launch killed during start-up may not have got that far
        assert_fresh_start(log, task)


def crash_and_resume(script: str, nproc: int, args: list[str], task: str, ckpt_dir: str,
                     points: list[tuple[str, float]], seed: int, total: int, jitter: float = 0.5) -> list[dict]:
    """Kill at each of ``points`` in turn, each launch with ``--load_checkpoint`` (resuming whatever was
    published, or starting fresh); then run to the end. Every launch passes ``check_launch``. Returns one record
    per launch: the point, whether it was killed, whether it had a checkpoint, the step it resumed from, its log."""
    rng = random.Random(seed)
    records = []
    launch_args = args + ["--load_checkpoint"]
    for point in points + [("end", 0)]:
        had = has_checkpoint(ckpt_dir)
        if point[0] == "end":
            job = Job(script, nproc, launch_args)
            rc, _ = job.wait(timeout=600)
            job.close()
            assert rc == 0, job.log[-4000:]
            record = {"point": point, "killed": False, "had_checkpoint": had, "log": job.log}
        else:
            later = tuple(points[points.index(point) + 1:])
            killed, log = launch_and_kill(script, nproc, launch_args, task, point, jitter, rng, later=later)
            record = {"point": point, "killed": killed, "had_checkpoint": had, "log": log}
        check_launch(record, task, total)
        records.append(record)
    return records


# ------------------------------------------------------------------------------------------------ single-rank faults
FAULT_TIMEOUT_S = 20
"""``--dist_timeout_s`` of the fault tests: above any wait of one rank for another in these tiny jobs on a loaded
2-core machine (start-up skew included), small enough to keep each stall test under a minute."""


def fault_job(script: str, nproc: int, args: list[str], *, inject: str | None = None,
              signal_after: tuple[str, int, int] | None = None, timeout: float = 300, **env: str) -> dict:
    """One job that meets one fault and must end by itself: ``inject`` (``RLHF_FAULT_INJECT``, the rank fails at
    a named place) or ``signal_after`` = (log pattern, rank, signal): the signal goes to that rank's process only,
    just after the first line matching the pattern. Returns its exit code, the seconds from the fault to the
    job's end, its ``error:`` lines and log. Asserts that no process of the job outlived it."""
    args = args + ["--dist_timeout_s", str(FAULT_TIMEOUT_S)]
    job = Job(script, nproc, args, **({"RLHF_FAULT_INJECT": inject} if inject else {}), **env)
    try:
        if signal_after is not None:
            pattern, rank, sig = signal_after
            assert job.wait_for(pattern, timeout=timeout) is not None, f"never saw {pattern!r}:\n{job.log[-3000:]}"
            fault_at = job.signal_rank(rank, sig)
        else:
            fault_at = job.wait_for(r"^fault injection: ", timeout=timeout)
            assert fault_at is not None, f"the fault was never injected:\n{job.log[-3000:]}"
        rc, ended = job.wait(timeout=timeout)
    finally:
        job.close()
    what = inject or f"signal {signal_after[2]} to rank {signal_after[1]} after {signal_after[0]!r}"
    print(f"fault {os.path.basename(script)} x{nproc} {what}: ended {ended - fault_at:.1f} s after it, rc {rc}")
    timeline = "".join(f"{t - fault_at:+8.2f} s  {ln}" for t, ln in job.lines
                       if "Warning" not in ln and "warnings.warn" not in ln)
    return {"rc": rc, "seconds": ended - fault_at, "errors": job.error_lines(), "log": job.log,
            "timeline": timeline[-6000:]}


def assert_ends_within(result: dict, hi: float, lo: float = 0.0) -> None:
    """The job ended between ``lo`` and ``hi`` seconds after its fault; if not, the job's last lines with their
    times from the fault say what it waited on."""
    assert lo < result["seconds"] < hi, \
        f"ended {result['seconds']:.1f} s after the fault, not in ({lo:g}, {hi:g}):\n{result['timeline']}"


def assert_named(result: dict, pattern: str) -> None:
    """One ``error:`` line of the job matches ``pattern`` (the rank and phase of the fault)."""
    assert result["rc"] != 0, result["log"][-3000:]
    assert any(re.search(pattern, e) for e in result["errors"]), \
        f"no error line matches {pattern!r}: {result['errors']}\n{result['log'][-3000:]}"
