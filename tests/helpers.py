"""Helpers shared by tests: run a script under torchrun, make tiny HF models once per session.

Every process a test starts through ``run_torchrun`` / ``run_python`` carries ``JOB_TAG`` in its environment, in a
session of its own: on a timeout (or pytest-timeout's interrupt) every tagged process is SIGKILLed, torchrun's ranks
and whatever they forked included, and on return the helper asserts that none of them is left. torchrun's ranks
are not in torchrun's process group, and a one-rank job has no heartbeat neighbour, so killing torchrun alone (what
``subprocess.run(timeout=...)`` does) can leave a rank running after the test."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import psutil
from rank_budget import ranks_in, ranks_of_budget

from rlhf.distributed.env import free_port  # noqa: F401  (tests import it from here)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.dirname(sys.executable)


def require(module: str, why: str = "") -> None:
    """A test's dependency: skip where it is missing on a developer's machine, fail under CI=true, where a missing
    package is an install bug that a skip would hide (the suite would stay green with whole trainers untested)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec(module) is not None:
        return
    msg = f"{module} is not installed{': ' + why if why else ''} (bash tools/setup_env.sh installs it)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true: {msg}", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


_START_ENV = dict(os.environ)  # at the first import, before any test of this process ran
SET_IN_PROCESS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY",  # rlhf.compat.onednn.bound_onednn_caches
                  "PYTORCH_NVML_BASED_CUDA_CHECK", "TRITON_CACHE_AUTOTUNING", "TILELANG_CLEANUP_TEMP_FILES",
                  "AITER_SITUV2_A4W4", "NUMEXPR_MAX_THREADS",  # importing vllm
                  "LD_LIBRARY_PATH",  # importing vLLM's engine (its cv2 import)
                  "LD_PRELOAD",  # vLLM's CPU platform, at an engine's start
                  "WANDB_SERVICE",  # an in-process W&B run's service (a job must not talk to it)
                  "MLFLOW_ALLOW_FILE_STORE")  # an in-process PPO run's default MLflow store (a job sets its own)
SET_IN_PROCESS_PREFIXES = ("VLLM_",  # vLLM's import and engine (VLLM_DIST_IDENT, ...); VLLM_ENABLE_V1_... ours
                           "TORCHINDUCTOR_", "_TORCHINDUCTOR_",  # importing megatron.core, vllm, torch's inductor
                           "NVTE_",  # megatron's LanguageModule.__init__ (NVTE_FLASH_ATTN, ...)
                           "MSWEA_", "LITELLM_")  # importing rlhf.demo.swe_mini (a job's rank sets them itself)
"""Variables that importing torch's companions or building a model or an engine sets in this process's environment
(each seen in the suite's zygote summary, 2026-11-29 and 2026-12-02; no test passes one of them to a job on
purpose)."""


def test_env(**extra: str) -> dict:
    """This process's environment for a job, without launcher variables: an in-process single rank of an earlier test
    (``DistEnv.export``) leaves RANK, WORLD_SIZE and MASTER_* in it, which no job of a test should inherit. Nor the
    ``SET_IN_PROCESS`` variables an in-process model or engine of an earlier test set: they are as they were before
    any test (a job's ranks set them again themselves), so that a job's environment does not depend on which tests
    ran before it in this worker, and equals the zygote's (else the job runs forkrun itself, ``tests/zygote.py``:
    4 jobs of the quick tier and about 30 of the suite did so)."""
    from rlhf.distributed.env import env_without_launcher

    env = env_without_launcher()
    for k in {*SET_IN_PROCESS, *(k for k in {*env, *_START_ENV} if k.startswith(SET_IN_PROCESS_PREFIXES))}:
        if k in _START_ENV:
            env[k] = _START_ENV[k]
        else:
            env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


test_env.__test__ = False  # a helper, not a test, in the modules that import it by name


JOB_TAG = "RLHF_TEST_JOB_TAG"


def job_launcher(tag: str) -> int | None:
    """The pid of the job's launcher where a zygote forked it (``tests/zygote.py``: it leads its own process group),
    else None."""
    if _ZYGOTE_REGISTRY is None:
        return None
    try:
        with open(os.path.join(_ZYGOTE_REGISTRY, tag)) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def job_processes(tag: str) -> list[psutil.Process]:
    """Every live process whose environment carries ``JOB_TAG=tag`` (zombies excluded), and, for a job a zygote
    launched, every process forked from it: its launcher's process group, with the zygote's command line (their
    /proc environment is the zygote's)."""
    out = []
    group = job_launcher(tag)
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(JOB_TAG) == tag or (group is not None and os.getpgid(p.pid) == group
                                                    and ZYGOTE_PY in p.cmdline()):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ProcessLookupError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    """The pids of every live descendant of ``pid`` (children in sessions of their own included), [] if it is gone."""
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(pids) -> list[int]:
    """Those of ``pids`` that are still running (a zombie is not)."""
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def kill_job(tag: str, root: int | None = None) -> None:
    """SIGKILL every process of the job (the tree under ``root`` and everything tagged), until none is left: a
    process forked while the first ones were being killed is caught by the next round."""
    for _ in range(20):
        procs = job_processes(tag)
        if root is not None:
            try:
                r = psutil.Process(root)
                procs += [r] + r.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        if not procs:
            return
        for p in procs:
            try:
                p.kill()  # SIGKILL: no handler, no clean-up
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        root = None


def leftovers(tag: str, grace: float = 10.0) -> list[str]:
    """The job's processes still alive ``grace`` seconds after it ended (waiting for them to go), as
    'pid cmdline' strings; they are killed before returning."""
    deadline = time.monotonic() + grace
    procs = job_processes(tag)
    while procs and time.monotonic() < deadline:
        time.sleep(0.2)
        procs = job_processes(tag)
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:200]} (status {p.status()}, parent {p.ppid()})")
        except psutil.NoSuchProcess:
            pass
    kill_job(tag)
    return out


def run_tagged(cmd: list[str], timeout: float, env: dict | None = None, *, full_env: dict | None = None,
               cwd: str = REPO) -> subprocess.CompletedProcess:
    """Run ``cmd`` (text output captured) with every process of it tagged; the environment is ``test_env(**env)``,
    or ``full_env`` as given. On a timeout or an interrupt the whole job is SIGKILLed before
    ``subprocess.TimeoutExpired`` (or the interrupt) propagates; after a normal end, any process of the job still
    alive 10 s later fails the test (and is killed). ``env[JOB_TAG]`` chooses the tag. A job of several ranks
    first waits for its share of the suite's rank budget (``rank_budget``); ``timeout`` counts from its start."""
    with ranks_of_budget(ranks_in(cmd)):
        return _run_tagged(cmd, timeout, env, full_env, cwd)


def _run_tagged(cmd: list[str], timeout: float, env: dict | None, full_env: dict | None,
                cwd: str) -> subprocess.CompletedProcess:
    env = dict(env or {})
    tag = env.pop(JOB_TAG, None) or uuid.uuid4().hex
    run_env = {**full_env, **env, JOB_TAG: tag} if full_env is not None else test_env(**{JOB_TAG: tag}, **env)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(tag, proc.pid)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    except BaseException:  # pytest-timeout's interrupt, KeyboardInterrupt: nothing of the job may outlive the test
        kill_job(tag, proc.pid)
        proc.communicate()
        raise
    left = leftovers(tag)
    assert not left, f"processes of {' '.join(cmd[:6])} outlived it (killed now): {left}"
    _log_launch(cmd, t0)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _log_launch(cmd: list[str], t0: float) -> None:
    """With ``RLHF_TEST_LAUNCH_LOG=path``: one JSON line per process a test launched (the test, the script, its
    seconds), to see where the suite's time goes."""
    path = os.environ.get("RLHF_TEST_LAUNCH_LOG")
    if not path:
        return
    import json

    script = next((c for c in cmd if c.endswith(".py")), cmd[-1] if cmd else "")
    with open(path, "a") as f:
        f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "script": os.path.relpath(script, REPO),
                            "nproc": cmd[cmd.index("--nproc_per_node") + 1] if "--nproc_per_node" in cmd else "1",
                            "seconds": round(time.monotonic() - t0, 2)}) + "\n")


def readline_within(proc: subprocess.Popen, timeout: float) -> str:
    """``proc.stdout``'s next line, read with a bound: a child that never prints it is killed and the test fails
    with ``TimeoutError`` after ``timeout`` seconds instead of waiting for ever (a bare ``readline()`` blocks until
    the suite's per-test limit, and then leaves the child)."""
    import threading

    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        proc.kill()
        raise TimeoutError(f"no line from {proc.args!r:.120} in {timeout:g} s (killed)")
    return box[0]


def spawn_within(fn, args: tuple, nprocs: int, timeout: float = 300) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with a bound: a rank that raises fails the test with its
    traceback (the others are terminated, as ``spawn`` does); ranks still running after ``timeout`` seconds are
    killed and the test fails with ``TimeoutError``. On any way out no rank is left alive."""
    import torch.multiprocessing as mp

    with ranks_of_budget(nprocs):
        _spawn_within(mp, fn, args, nprocs, timeout)


def _spawn_within(mp, fn, args: tuple, nprocs: int, timeout: float) -> None:
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"spawned ranks of {getattr(fn, '__name__', fn)} still running after {timeout:g} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()


def sleep_forever(rank: int, pid_dir: str) -> None:
    """A spawned rank that never ends (``spawn_within``'s own test): writes its pid, then sleeps."""
    open(os.path.join(pid_dir, str(rank)), "w").write(str(os.getpid()))
    time.sleep(3600)


LAUNCHER = os.environ.get("RLHF_TEST_LAUNCHER", "zygote")
"""How ``torchrun_cmd`` starts a job's ranks. ``zygote`` (default): ``forkrun`` run by a launcher forked from a
process of this pytest worker that imported forkrun's preload list once (``tests/zygote.py``; where its conditions
do not hold, the client runs forkrun itself and says why); ``forkrun``: torchrun itself with its ranks forked from
a launcher that imported torch, transformers, megatron-core and (PPO) vLLM once (``rlhf.distributed.forkrun``);
``torchrun``: a fresh interpreter per rank. Tests about launching, restarts, signals or the rank processes
themselves pass ``launcher="torchrun"``; ``RLHF_TEST_LAUNCHER=torchrun`` (or ``forkrun``) runs every job so."""

ZYGOTE_PY = os.path.join(REPO, "tests", "zygote.py")
_ZYGOTE_REGISTRY: str | None = None  # <dir>/<job tag>: the pid of the job's launcher (tests/zygote.py writes it)
_ZYGOTES: dict[tuple[str, ...], tuple[subprocess.Popen, str]] = {}


def _stop_zygotes() -> None:
    import shutil

    for proc, _ in _ZYGOTES.values():
        proc.kill()
        proc.wait()
    _ZYGOTES.clear()
    if _ZYGOTE_REGISTRY is not None:
        shutil.rmtree(_ZYGOTE_REGISTRY, ignore_errors=True)


def zygote(modules: list[str]) -> str:
    """The socket of this process's zygote for ``modules`` (started now if there is none, or it died)."""
    global _ZYGOTE_REGISTRY
    import atexit
    import tempfile

    key = tuple(modules)
    if key in _ZYGOTES and _ZYGOTES[key][0].poll() is None:
        return _ZYGOTES[key][1]
    if _ZYGOTE_REGISTRY is None:
        _ZYGOTE_REGISTRY = tempfile.mkdtemp(prefix=f"rlhf-zygote-{os.getpid()}-")
        atexit.register(_stop_zygotes)
    sock = os.path.join(_ZYGOTE_REGISTRY, f"z{len(_ZYGOTES)}-{uuid.uuid4().hex[:6]}.sock")
    with open(sock[:-5] + ".log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-u", ZYGOTE_PY, "serve", sock, _ZYGOTE_REGISTRY, ",".join(modules)],
                                cwd=REPO, env=test_env(), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while not os.path.exists(sock) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # it binds before importing; clients wait in its backlog for the imports
    _ZYGOTES[key] = (proc, sock)
    return sock


def torchrun_cmd(script: str, nproc: int, args: list[str], max_restarts: int = 0,
                 launcher: str | None = None) -> list[str]:
    """``torchrun --nproc_per_node nproc [--max-restarts N] script args`` on a free port (``launcher``:
    ``LAUNCHER`` by default)."""
    restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
    launcher = launcher or LAUNCHER
    if launcher not in ("torchrun", "forkrun", "zygote"):
        raise ValueError(f"launcher={launcher!r}: torchrun, forkrun or zygote")
    flags = ["--nproc_per_node", str(nproc), "--master_port", str(free_port()), *restarts, script, *args]
    if launcher == "zygote":
        from rlhf.distributed.forkrun import default_preload

        modules = default_preload(script)
        return [sys.executable, "-S", "-E", ZYGOTE_PY, "client", zygote(modules), "--",
                "--preload", ",".join(modules), *flags]
    start = ["-m", "torch.distributed.run"] if launcher == "torchrun" else ["-u", "-m", "rlhf.distributed.forkrun"]
    return [sys.executable, *start, *flags]


def run_torchrun(script: str, nproc: int, args: list[str], timeout: float = 600, launcher: str | None = None,
                 **env: str):
    """Run ``torchrun --nproc_per_node nproc script args``; returns the CompletedProcess (text)."""
    return run_tagged(torchrun_cmd(script, nproc, args, launcher=launcher), timeout, env)


def run_python(args: list[str], timeout: float = 600, **env: str):
    return run_tagged([sys.executable, *args], timeout, env)


def tail(proc, n: int = 3000) -> str:
    """The end of a finished process's output, and the start of the first traceback or ``error:`` line in its
    stderr when that lies before the end (a job's failing rank: torchrun's own dump fills the last lines)."""
    err = proc.stderr or ""
    first = min((i for i in (err.find("Traceback (most recent call last)"), err.find("error:")) if i >= 0),
                default=-1)
    head = f"--- first error in stderr ---\n{err[first:first + n]}\n" if 0 <= first < len(err) - n else ""
    return (proc.stdout or "")[-n:] + "\n" + head + "--- stderr ---\n" + err[-n:]


def make_seq_cls_rm(out: str, tokenizer_dir: str, seed: int = 0, scale: float = 1.0, **dims) -> str:
    """An ordinary tiny HF Llama ``ForSequenceClassification`` (random, every attention and MLP layer live, so its
    score depends on the whole context and on positions) for reward-model and critic tests. Only its score head is
    rescaled, so that scores of random token sequences spread with std ``scale`` (a random init's spread is too
    small for a policy to move within a few test steps)."""
    import torch
    import transformers

    from rlhf.models.tiny import make_tiny_hf

    make_tiny_hf(out, "llama", seq_cls=True, seed=seed, tokenizer_dir=tokenizer_dir, **dims)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    g = torch.Generator().manual_seed(seed + 17)
    ids = torch.randint(3, model.config.vocab_size, (64, 12), generator=g)
    with torch.no_grad():
        scores = model(input_ids=ids).logits.squeeze(-1)  # (64,): the last token's score
        model.score.weight.mul_(scale / scores.std())
    model.save_pretrained(out)
    return out
