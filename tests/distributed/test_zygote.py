"""``tests/zygote.py``, the suite's pre-imported launcher: a job it launches is forkrun's job (the ranks see the
same things, the exit status and failure report come through, signals reach the launcher), a job it cannot serve
as forkrun would is run by forkrun itself, and nothing of a job outlives its client, SIGKILL included.
Negative controls: an environment that differs in a variable read at import is refused by name (and the job still
runs, by forkrun); the processes that must vanish are first seen by ``job_processes`` (the kill test cannot pass on
a finder that sees nothing)."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
from helpers import JOB_TAG, REPO, job_launcher, job_processes, kill_job, run_tagged, tail, test_env, torchrun_cmd

from distributed.test_forkrun import PROBE, _comparable

NOT_USED = "zygote: not used (the environment differs from the zygote's in "


def _probe(launcher: str, out: str, *extra: str, **env: str):
    os.makedirs(out, exist_ok=True)
    base = test_env()
    full = {**base, "RLHF_PROBE_BASE_ENV": ",".join([*base, "RLHF_PROBE_BASE_ENV"]), **env}
    proc = run_tagged(torchrun_cmd(PROBE, 2, [out, *extra], launcher=launcher), 120, full_env=full)
    reports = [json_or_none(os.path.join(out, f"rank{r}.json")) for r in range(2)]
    return proc, reports


def json_or_none(path: str):
    import json

    return json.load(open(path)) if os.path.exists(path) else None


def test_a_zygote_job_is_forkruns_job_and_a_different_environment_is_refused(tmp_path):
    f_proc, f_rep = _probe("forkrun", str(tmp_path / "f"))
    assert f_proc.returncode == 0, tail(f_proc)
    for i in range(2):  # the first job may wait for the zygote's imports; the second finds them done
        z_proc, z_rep = _probe("zygote", str(tmp_path / f"z{i}"))
        assert z_proc.returncode == 0, tail(z_proc)
        assert "zygote: not used" not in z_proc.stderr, tail(z_proc)
        assert "forkrun: preloaded 2 module(s) in 0.0 s" in z_proc.stderr, tail(z_proc)  # imported in the zygote
        for r in range(2):
            assert _comparable(z_rep[r], str(tmp_path / f"z{i}")) == _comparable(f_rep[r], str(tmp_path / "f")), r
    # Negative control: a variable torch or transformers may read when imported differs: forkrun runs the job
    c_proc, c_rep = _probe("zygote", str(tmp_path / "c"), HF_DATASETS_OFFLINE="1")
    assert c_proc.returncode == 0, tail(c_proc)
    assert NOT_USED + "HF_DATASETS_OFFLINE)" in c_proc.stderr, tail(c_proc)
    assert c_rep[0]["env"]["HF_DATASETS_OFFLINE"] == "1"


def test_the_exit_status_and_the_failure_report_come_through(tmp_path):
    f_proc, _ = _probe("forkrun", str(tmp_path / "f"), "exit3")
    z_proc, _ = _probe("zygote", str(tmp_path / "z"), "exit3")
    assert z_proc.returncode == f_proc.returncode != 0, (tail(z_proc), tail(f_proc))
    for proc in (f_proc, z_proc):
        assert f"{PROBE} FAILED" in proc.stderr and "rank      : 1" in proc.stderr and "exitcode  : 3" in \
            proc.stderr, tail(proc)


def _start(tmp_path, name: str):
    tag = f"zygote-test-{name}-{os.getpid()}"
    out = str(tmp_path / name)
    os.makedirs(out)
    proc = subprocess.Popen(torchrun_cmd(PROBE, 2, [out, "sleep"], launcher="zygote"), cwd=REPO,
                            env=test_env(**{JOB_TAG: tag}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not all(os.path.exists(os.path.join(out, f"rank{r}.json")) for r in range(2)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    procs = job_processes(tag)
    launcher = job_launcher(tag)
    # the launcher (the zygote's child, not the client's) and its two forked ranks, all found by the tag
    assert launcher is not None and launcher != proc.pid and launcher in {p.pid for p in procs}, procs
    assert len([p for p in procs if p.ppid() == launcher]) == 2, [(p.pid, p.ppid()) for p in procs]
    return proc, tag, procs


def test_a_killed_client_takes_its_job_with_it(tmp_path):
    proc, tag, procs = _start(tmp_path, "kill")
    try:
        psutil.Process(proc.pid).kill()  # SIGKILL: the client can relay nothing
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive and job_processes(tag) == [], [p.pid for p in alive]
    finally:
        kill_job(tag, proc.pid)


def test_sigterm_reaches_the_launcher_and_the_client_ends_as_it_did(tmp_path):
    proc, tag, procs = _start(tmp_path, "term")
    try:
        proc.send_signal(signal.SIGTERM)  # torchrun's agent stops its ranks and ends by the same signal's exit
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0, out[-3000:]
        gone, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive, [p.pid for p in alive]
        assert "Received 15 death signal" in out or "SIGTERM" in out, out[-3000:]
    finally:
        kill_job(tag, proc.pid)


FULL_PROBE = os.path.join(REPO, "tests/distributed/_forkrun_probe_full.py")
RANDOM = ("random", "torch_random", "hash")


def test_with_the_full_preload_a_zygote_rank_is_a_fresh_rank(tmp_path):
    """The preload list of a real job (torch, transformers, megatron-core through rlhf, vLLM's engine: 16 modules):
    a rank forked from the zygote sees what a fresh torchrun rank that imported them itself sees: environment (what
    the imports set), paths, signal handlers, torch's threads and defaults, logging, warnings filters,
    multiprocessing's start method, the fault handler, umask, locale, interpreter flags. Each rank's ``random`` and
    torch generators differ from the other rank's, as fresh ones do. Not the same: the string hash seed (a forked
    interpreter keeps its parent's: the zygote's ranks and launches share one; fresh ranks each have their own)."""
    import json

    def probe(launcher, out):
        os.makedirs(out, exist_ok=True)
        base = test_env()
        full = {**base, "RLHF_PROBE_BASE_ENV": ",".join([*base, "RLHF_PROBE_BASE_ENV"])}
        proc = run_tagged(torchrun_cmd(FULL_PROBE, 2, [out], launcher=launcher), 300, full_env=full)
        assert proc.returncode == 0, tail(proc)
        return proc, [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]

    def same(rep, out):
        rep = {k: v for k, v in rep.items() if k not in RANDOM}
        rep["env"] = {k: v for k, v in rep["env"].items() if k not in ("MASTER_PORT", "TORCHELASTIC_ERROR_FILE",
                                                                        JOB_TAG)}
        return json.loads(json.dumps(rep).replace(out, "OUT"))

    _, fresh = probe("torchrun", str(tmp_path / "t"))
    z_proc, zyg = probe("zygote", str(tmp_path / "z"))
    assert "forkrun: preloaded 16 module(s)" in z_proc.stderr and NOT_USED not in z_proc.stderr, tail(z_proc)
    for r in range(2):
        assert same(zyg[r], str(tmp_path / "z")) == same(fresh[r], str(tmp_path / "t")), r
    for rep in (fresh, zyg):
        assert rep[0]["random"] != rep[1]["random"] and rep[0]["torch_random"] != rep[1]["torch_random"]
    assert fresh[0]["hash"] != fresh[1]["hash"] and zyg[0]["hash"] == zyg[1]["hash"]  # the documented difference
