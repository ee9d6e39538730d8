"""Agents as plain programs: an ``--agent_func_path`` file that defines ``run_agent(client, prompt, label, **kw)``
instead of an ``AgentExecutor``. The rollout gives each trajectory a session of its rank's OpenAI-compatible
endpoint (``rlhf.agents.endpoint``) and calls ``run_agent`` with a client pointed at it::

    async def run_agent(client, prompt, label, **kw) -> float:    # client: openai.AsyncOpenAI
        r = await client.chat.completions.create(model=kw["model"], messages=[{"role": "user", "content": prompt}])
        return float(r.choices[0].message.content.strip() == label)

A plain ``def run_agent`` runs in a thread of its own with an ``openai.OpenAI`` client. It returns the reward (a
number), or a dict with ``reward`` and optionally ``scores`` and ``extra_logs`` (OpenRLHF's keys). ``kw`` holds
``model``, ``base_url`` and ``api_key`` (for clients other than ``openai``'s), ``max_tokens``, ``temperature``,
``top_p``, ``index`` (the trajectory's number in the step) and ``seed`` (the trajectory's).

A session fails, with reward 0 and its reason counted, when ``run_agent`` raises (``raised``), returns something
else (``malformed``), goes --agent_timeout_s without a request in flight and without returning (``timeout``: its
task is cancelled; a thread's next request is refused), or asks for more than its budget (``budget``)."""
from __future__ import annotations

import asyncio
import inspect
import threading
import time

from rlhf.agents.environment import AgentExecutorBase, MalformedStep, as_float
from rlhf.agents.trajectory import CURRENT

RUN_AGENT_KWARGS = ("model", "base_url", "api_key", "max_tokens", "temperature", "top_p", "index", "seed")
API_KEY = "rlhf-local"


class NoCalls(MalformedStep):
    """run_agent returned without calling the model: nothing to train."""


def check_run_agent(fn, path: str) -> None:
    """``run_agent`` takes (client, prompt, label) and keywords; ``ValueError`` naming the flag otherwise."""
    if not callable(fn):
        raise ValueError(f"--agent_func_path {path}: run_agent must be a function")
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise ValueError(f"--agent_func_path {path}: run_agent must take (client, prompt, label, **kw), got "
                         f"({', '.join(p.name for p in params)})")


def reward_of(value) -> tuple[float, float | None, dict]:
    """(reward, scores, extra_logs) of what run_agent returned."""
    if isinstance(value, dict):
        if "reward" not in value:
            raise MalformedStep(f"run_agent returned a dict without 'reward': {sorted(value)}")
        r = as_float(value["reward"], "run_agent's reward")
        s = value.get("scores")
        return r, (None if s is None else as_float(s, "run_agent's scores")), dict(value.get("extra_logs") or {})
    try:
        return as_float(value, "run_agent's reward"), None, {}
    except ValueError as e:
        raise MalformedStep(str(e)) from None


def in_daemon_thread(fn, *args, **kwargs) -> asyncio.Future:
    """``fn(*args, **kwargs)`` in a daemon thread of its own (never joined at exit, so a program stuck there cannot
    hold the job's end), its result as a future of the running loop."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, v) -> None:
        if not fut.done():
            fut.set_result(v) if ok else fut.set_exception(v)

    def body() -> None:
        try:
            v, ok = fn(*args, **kwargs), True
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            v, ok = e, False
        try:
            loop.call_soon_threadsafe(settle, ok, v)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            pass

    threading.Thread(target=body, name="rlhf-run-agent", daemon=True).start()
    return fut


class RunAgentExecutor(AgentExecutorBase):
    """The executor of a ``run_agent`` file. The rollout sets ``endpoint`` (the rank's), ``timeout_s``
    (--agent_timeout_s) and ``sampling`` (the job's max_tokens, temperature, top_p) before a step."""

    def __init__(self, fn, path: str):
        check_run_agent(fn, path)
        self.fn, self.path = fn, path
        self.is_async = inspect.iscoroutinefunction(fn)
        sig = inspect.signature(fn).parameters.values()
        self.kw_names = set(RUN_AGENT_KWARGS) if any(p.kind is p.VAR_KEYWORD for p in sig) else (
            {p.name for p in sig} & set(RUN_AGENT_KWARGS))
        self.endpoint, self.timeout_s, self.sampling = None, 60.0, {}

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None,
                      prompt_ids: list[int] | None = None):
        traj, ep = CURRENT.get(), self.endpoint  # a carried session keeps its endpoint while others come and go
        sid, st = ep.open(traj.index)
        t0 = time.perf_counter()
        try:
            value, failure = await self._run(ep, sid, st, prompt, label, traj)
        finally:
            ep.close(sid)
        if traj is not None:  # the program's own time: the session less its requests' waits
            traj.env_seconds += max(time.perf_counter() - t0 - st.waited_s, 1e-9)
        out = st.session.trajectory()
        reward, scores, extra = 0.0, None, {}
        if st.failure is not None:
            failure = f"{type(st.failure).__name__}: {st.failure}"
        elif failure is None:
            try:
                if out is None:
                    raise NoCalls("run_agent returned without a request to the endpoint: nothing to train")
                reward, scores, extra = reward_of(value)
            except MalformedStep as e:
                failure = f"MalformedStep: {e}"
        ids = list(prompt_ids) if prompt_ids is not None else hf_tokenizer(text=prompt, add_special_tokens=False)[
            "input_ids"]
        out = out or {"observation_tokens": ids, "action_ranges": [], "rollout_log_probs": [0.0] * len(ids),
                      "prompt_length": len(ids), "turns": 0, "last_finished": False, "endpoint": st.session.stats(0)}
        return {**out, "prompt": prompt, "label": label, "reward": reward, "scores": scores, "extra_logs": extra,
                "done": failure is None, "failure": failure}

    def _kwargs(self, ep, sid: str, traj) -> dict:
        kw = {"model": ep.model, "base_url": ep.url(sid), "api_key": API_KEY, "index": traj.index, "seed": traj.seed,
              **self.sampling}
        return {k: v for k, v in kw.items() if k in self.kw_names}

    async def _run(self, ep, sid: str, st, prompt, label, traj) -> tuple[object, str | None]:
        """run_agent under the session's watch: (its value, None) or (None, the failure)."""
        import openai

        kw = self._kwargs(ep, sid, traj)
        url = ep.url(sid)
        if self.is_async:
            client = openai.AsyncOpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=24 * 3600.0)
            task = asyncio.ensure_future(self.fn(client, prompt, label, **kw))
        else:
            client = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=24 * 3600.0)
            task = in_daemon_thread(self.fn, client, prompt, label, **kw)
        try:
            late = await self._watch(task, st)
            if late:
                task.cancel()
                if self.is_async:
                    await asyncio.wait({task}, timeout=5)
                return None, (f"TimeoutError: run_agent went {self.timeout_s:g}s without a request to the endpoint or "
                              "an answer (--agent_timeout_s)")
            try:
                return task.result(), None
            except Exception as e:  # noqa: BLE001 - the program's failure ends this trajectory only
                return None, f"{type(e).__name__}: {e}"
        finally:
            if self.is_async:
                await client.close()

    async def _watch(self, task, st) -> bool:
        """Wait for ``task``; True when it ran --agent_timeout_s of its own time (no request in flight) first."""
        while True:
            left = self.timeout_s if st.waiting else self.timeout_s - (time.monotonic() - st.idle_since)
            if left <= 0:
                return True
            done, _ = await asyncio.wait({task}, timeout=left)
            if done:
                return False
