"""``rlhf.distributed.forkrun``: torchrun with ranks forked from a launcher that imported their modules once.

A rank sees what a torchrun rank sees (the same launcher variables, argv, ``__main__``, ``sys.path[0]``, default
signal handlers, unbuffered streams, a function of the script that pickles); a rank that ends by ``os._exit(0)``
ends the job instead of leaving torch's function-entrypoint agent waiting for a return value; a launcher that
cannot fork safely starts the ranks as subprocesses, logged. Negative controls: torchrun's own ``--run-path
--start-method fork`` (what forkrun builds on) differs from a torchrun rank in exactly the ways forkrun repairs, and
waits for ever on a rank that exits 0 without a return value."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import REPO, free_port, run_tagged, tail, test_env

PROBE = os.path.join(REPO, "tests/distributed/_forkrun_probe.py")
# What differs between two launches of the same job by nature: the port, the error file's temporary folder, the
# tag that tests/helpers.py gives every job.
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "RLHF_TEST_JOB_TAG"}


def _launch(start: list[str], out: str, *extra: str, timeout: float = 120, preload: str | None = None):
    os.makedirs(out, exist_ok=True)
    base = test_env()
    pre = ["--preload", preload] if preload is not None else []
    cmd = [sys.executable, *start, *pre, "--nproc_per_node", "2", "--master_port", str(free_port()), PROBE, out,
           *extra]
    proc = run_tagged(cmd, timeout, full_env={**base, "RLHF_PROBE_BASE_ENV": ",".join([*base, "RLHF_PROBE_BASE_ENV"])})
    reports = []
    for r in range(2):
        path = os.path.join(out, f"rank{r}.json")
        reports.append(json.load(open(path)) if os.path.exists(path) else None)
    return proc, reports


FORKRUN = ["-u", "-m", "rlhf.distributed.forkrun"]
TORCHRUN = ["-m", "torch.distributed.run"]


def _comparable(rep: dict, out: str) -> dict:
    rep = dict(rep)
    rep["env"] = {k: v for k, v in rep["env"].items() if k not in PER_LAUNCH}
    rep["argv"] = [a.replace(out, "OUT") for a in rep["argv"]]
    for k in ("random", "forked"):
        rep.pop(k)
    return rep


def test_a_forked_rank_sees_what_a_torchrun_rank_sees(tmp_path):
    t_proc, t_rep = _launch(TORCHRUN, str(tmp_path / "t"))
    f_proc, f_rep = _launch(FORKRUN, str(tmp_path / "f"), preload="json")
    assert t_proc.returncode == 0, tail(t_proc)
    assert f_proc.returncode == 0, tail(f_proc)
    assert "forkrun: preloaded 1 module(s) in" in f_proc.stderr and "forking 2 rank(s)" in f_proc.stderr, tail(f_proc)
    for r in range(2):
        assert t_rep[r]["forked"] is False and f_rep[r]["forked"] is True
        t, f = _comparable(t_rep[r], str(tmp_path / "t")), _comparable(f_rep[r], str(tmp_path / "f"))
        assert t["env"]["RANK"] == str(r) and {"LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "GROUP_RANK",
                                                 "TORCHELASTIC_RUN_ID"} <= set(t["env"]), t["env"]
        assert f == t, (r, f, t)
        assert t["pickled"] is True and t["signals"]["SIGTERM"] == "default" and t["stdout_raw"] == "FileIO", t
    assert f_rep[0]["random"] != f_rep[1]["random"]  # each rank's own random state, not the launcher's copy
    # negative control: torchrun's own in-process ranks (what forkrun builds on) differ exactly where forkrun repairs
    c_proc, c_rep = _launch([*TORCHRUN, "--run-path", "--start-method", "fork"], str(tmp_path / "c"))
    assert c_proc.returncode == 0, tail(c_proc)
    c, t = _comparable(c_rep[0], str(tmp_path / "c")), _comparable(t_rep[0], str(tmp_path / "t"))
    differ = {k for k in t if c[k] != t[k]}
    # torch's agent handlers, inherited by the fork; the launcher's sys.path[0] (and its buffered streams, where
    # the environment does not set PYTHONUNBUFFERED)
    assert {"signals", "path0"} <= differ <= {"signals", "path0", "stdout_raw"}, (differ, c, t)
    assert c["signals"]["SIGTERM"] == "other"


def test_a_rank_that_exits_0_without_returning_ends_the_job_and_a_failure_is_reported(tmp_path):
    proc, rep = _launch(FORKRUN, str(tmp_path / "f"), "exit0", preload="json", timeout=60)
    assert proc.returncode == 0, tail(proc)
    assert rep[0] is not None and rep[1] is not None
    proc, _ = _launch(FORKRUN, str(tmp_path / "g"), "exit3", preload="json", timeout=60)
    assert proc.returncode != 0, tail(proc)  # as torchrun reports a rank's failure: the script, the rank, the code
    assert f"{PROBE} FAILED" in proc.stderr and "rank      : 1" in proc.stderr and "exitcode  : 3" in proc.stderr, \
        tail(proc)


def test_the_agent_counts_an_exit_0_as_done_and_waits_without_the_repair(monkeypatch):
    """In-process: torch's MultiprocessContext with one forked rank that ends by ``os._exit(0)``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, api, start_processes

    from rlhf.compat.elastic import count_clean_exits_as_done

    count_clean_exits_as_done()
    patched = api.MultiprocessContext._poll
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}

    def run(poll) -> object:
        monkeypatch.setattr(api.MultiprocessContext, "_poll", poll)
        pc = start_processes("exit0", _exit0, {0: ()}, {0: {}}, DefaultLogsSpecs(), start_method="fork")
        try:
            return pc.wait(timeout=5, period=0.1)
        finally:
            pc.close()
            for s, h in saved.items():  # the context sets the agent's handlers in this process
                signal.signal(s, h)

    result = run(patched)
    assert result is not None and not result.is_failed()
    assert run(patched.__wrapped__) is None  # control: torch's own poll still waits for a return value


def _exit0():
    os._exit(0)


def test_unsafe_to_fork_falls_back_to_subprocesses(tmp_path):
    code = ("import threading, time\nfrom rlhf.distributed.forkrun import fork_unsafe_reason as f\n"
            "print(f())\nthreading.Thread(target=time.sleep, args=(3,), name='sleeper', daemon=True).start()\n"
            "print(f())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=test_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first == "None" and "sleeper" in second, out.stdout
    # a preloaded module that leaves a thread running: the ranks start as torchrun starts them, said once
    mod = tmp_path / "threaded_at_import.py"
    mod.write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    env = test_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{test_env()['PYTHONPATH']}")
    proc = run_tagged([sys.executable, *FORKRUN, "--preload", "threaded_at_import", "--nproc_per_node", "2",
                       "--master_port", str(free_port()), PROBE, str(tmp_path)], 120, full_env=env)
    assert proc.returncode == 0, tail(proc)
    assert proc.stderr.count("started as subprocesses") == 1, tail(proc)
    for r in range(2):
        assert json.load(open(tmp_path / f"rank{r}.json"))["forked"] is False
