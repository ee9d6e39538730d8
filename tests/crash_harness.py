"""Crash anywhere: run a job, SIGKILL its whole process tree (torchrun, every rank, the export subprocess) just
after a chosen event in its log, resume with --load_checkpoint, and repeat; the final weights must be
bit-identical to an uninterrupted run's.

Kill points are events, not wall-clock times, so every phase is hit on any machine speed: ``("startup", s)``
kills ``s`` seconds after launch; ``("step", k)`` after the progress line of step k; ``("save", k)`` after the
"checkpoint: saving step k" line (mid-save); ``("export", 0)`` after "exporting HF model" (mid-export). Each is
followed by a seeded random delay of up to ``jitter`` seconds. Ranks run in sessions of their own, so the whole
tree is found through psutil, not the process group.
"""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading

import psutil
from helpers import REPO, free_port, test_env


def kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()  # SIGKILL: no handler, no clean-up
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def _pattern(task: str, event: str, k: int) -> re.Pattern | None:
    return {"step": re.compile(rf"\[{task} {k}/\d+ "), "save": re.compile(rf"checkpoint: saving step {k} "),
            "export": re.compile(r"exporting HF model to ")}.get(event)


def launch_and_kill(script: str, nproc: int, args: list[str], task: str, point: tuple[str, float], jitter: float,
                    rng: random.Random, timeout: float = 600,
                    later: tuple[tuple[str, float], ...] = ()) -> tuple[bool, str]:
    """One launch, killed at ``point``. Returns (killed, log). ``killed`` is False if the job ended first.

    The kill comes a seeded random delay of up to ``jitter`` seconds after the event, but never after the event of
    a ``later`` kill point (or the export): on a machine fast enough to run past it within the delay, the kill
    falls at that event instead, so every later point still comes in a later launch."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), os.path.join(REPO, script), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=test_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    hit, overrun = threading.Event(), threading.Event()
    event, k = point
    pat = _pattern(task, event, int(k))
    guards = [g for g in (_pattern(task, e, int(j)) for e, j in (*later, ("export", 0))) if g is not None]

    def reader() -> None:
        for ln in proc.stdout:
            lines.append(ln)
            if pat is not None and pat.search(ln):
                hit.set()
            if hit.is_set() and any(g.search(ln) for g in guards if g.pattern != getattr(pat, "pattern", None)):
                overrun.set()
        hit.set()  # the job ended
        overrun.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    if event == "startup":
        hit.wait(timeout=float(k))
    else:
        hit.wait(timeout=timeout)
    overrun.wait(timeout=rng.uniform(0, jitter))
    killed = proc.poll() is None
    if killed:
        kill_tree(proc.pid)
    proc.wait(timeout=60)
    t.join(timeout=10)
    return killed, "".join(lines)


def has_checkpoint(ckpt_dir: str) -> bool:
    return os.path.isdir(ckpt_dir) and any(re.match(r"^iter_\d+$", d) for d in os.listdir(ckpt_dir))


def crash_and_resume(script: str, nproc: int, args: list[str], task: str, ckpt_dir: str,
                     points: list[tuple[str, float]], seed: int, jitter: float = 0.5) -> list[dict]:
    """Kill at each of ``points`` in turn, each launch resuming from the last checkpoint (if any); then run to
    the end. Returns one record per launch: the point, whether it was killed, and the checkpoint it resumed."""
    rng = random.Random(seed)
    records = []
    for point in points + [("end", 0)]:
        resume = has_checkpoint(ckpt_dir)
        launch_args = args + (["--load_checkpoint"] if resume else [])
        if point[0] == "end":
            p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                "--master_port", str(free_port()), os.path.join(REPO, script), *launch_args],
                               cwd=REPO, env=test_env(), capture_output=True, text=True, timeout=600)
            assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
            records.append({"point": point, "killed": False, "resumed": resume})
            break
        later = tuple(points[points.index(point) + 1:])
        killed, log = launch_and_kill(script, nproc, launch_args, task, point, jitter, rng, later=later)
        records.append({"point": point, "killed": killed, "resumed": resume, "log_tail": log[-1500:]})
    return records
