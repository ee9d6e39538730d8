"""PrimeIntellect's verifiers 0.4.0, its current release (``verifiers.v1``), as ``run_agent`` programs: each
trajectory is one ``Env.run_episode(task, ModelContext)`` of a taskset played by a harness, whose program talks to
the rank's OpenAI-compatible endpoint through verifiers' interception server and its ``EvalClient`` (so the
endpoint's token-exactness rule holds). The task's rewards are the trajectory's reward, its metrics the
``extra_logs``. An agent file is two lines::

    from rlhf.agents.verifiers_v1 import episode_agent
    run_agent = episode_agent("my_taskset", harness="null")    # the module verifiers' loaders import

The job's prompt is the task's ``prompt``; its label fills the task data's ``answer`` (a dict label, its fields).
The taskset's own ``load()`` is not read: the job's ``--prompt_data`` is.

0.4.0 and the job's 0.3.1 (``verifiers.legacy``, rlhf.agents.verifiers_env) are both named ``verifiers``, so the
episodes run in one worker process per job process (rlhf.agents.verifiers_v1_worker) that imports 0.4.0 from
``<venv>/verifiers-v1``; it is started at the first episode and ends with the job (or when its stdin closes)."""
from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)


def v1_dir() -> Path:
    return Path(sys.prefix) / "verifiers-v1"


class EpisodeWorker:
    """The worker process and its pending episodes (futures of whichever loop asked)."""

    def __init__(self):
        where = v1_dir()
        if not (where / "verifiers" / "v1").is_dir():
            raise RuntimeError(f"verifiers 0.4.0 is not installed in {where} (tools/setup_env.sh installs it there)")
        path = [str(where)] + [p for p in sys.path if p and os.path.exists(p)]
        from rlhf.agents.program import API_KEY
        from rlhf.agents.verifiers_v1_worker import API_KEY_VAR

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONNOUSERSITE": "1", API_KEY_VAR: API_KEY}
        self.proc = subprocess.Popen([sys.executable, "-m", "rlhf.agents.verifiers_v1_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True, start_new_session=True)
        self.lock = threading.Lock()
        self.pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.next_id = 0
        threading.Thread(target=self._read, name="rlhf-verifiers-v1", daemon=True).start()
        atexit.register(self.close)
        log.info("verifiers 0.4.0 worker started (pid %d, %s)", self.proc.pid, where)

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                res = json.loads(line)
            except ValueError:
                log.warning("verifiers worker wrote a line that is not the protocol's: %r", line[:200])
                continue
            with self.lock:
                loop, fut = self.pending.pop(res["id"], (None, None))
            if fut is not None:
                loop.call_soon_threadsafe(lambda f=fut, r=res: f.done() or f.set_result(r))
        with self.lock:
            waiting, self.pending = list(self.pending.values()), {}
        for loop, fut in waiting:
            err = RuntimeError("the verifiers worker exited")
            loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_exception(err))

    def _send(self, msg: dict) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    async def episode(self, req: dict) -> dict:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self.lock:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the verifiers worker exited (code {self.proc.returncode})")
            i, self.next_id = self.next_id, self.next_id + 1
            self.pending[i] = (loop, fut)
            self._send({"id": i, **req})
        try:
            return await fut
        except asyncio.CancelledError:
            with self.lock:
                if self.pending.pop(i, None) is not None and self.proc.poll() is None:
                    self._send({"cancel": i})
            raise

    def close(self) -> None:
        """End the worker and every program it started (its process group)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


_WORKER: dict[int, EpisodeWorker] = {}


def worker() -> EpisodeWorker:
    """This process's worker (a forked child gets its own)."""
    w = _WORKER.get(os.getpid())
    if w is None or w.proc.poll() is not None:
        w = _WORKER[os.getpid()] = EpisodeWorker()
    return w


def close_worker() -> None:
    w = _WORKER.pop(os.getpid(), None)
    if w is not None:
        w.close()


def episode_agent(taskset: str, harness: str | None = "null", **taskset_args):
    """A ``run_agent(client, prompt, label, model, base_url, **kw)`` playing one episode of verifiers 0.4.0's
    taskset ``taskset`` (``taskset_args`` go to its ``TasksetConfig``) with the harness ``harness`` (``None``: the
    taskset's default) in the local subprocess runtime. Returns ``{"reward", "scores", "extra_logs"}``."""
    spec = {"taskset": taskset, "taskset_args": dict(taskset_args), "harness": harness}

    async def run_agent(client, prompt, label, model, base_url, max_tokens=None, temperature=None, top_p=None,
                        **kw):
        sampling = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p))
                    if v is not None}
        res = await worker().episode({"env": spec, "prompt": prompt, "label": label, "model": model,
                                      "base_url": base_url, "sampling": sampling})
        if res.get("error"):
            raise RuntimeError(f"verifiers episode failed: {res['error']}")
        return {"reward": res["reward"], "scores": res["reward"], "extra_logs": res["metrics"]}

    return run_agent
