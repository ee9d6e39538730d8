"""PrimeIntellect's ``verifiers`` environments as ``run_agent`` programs (rlhf.agents.program): each trajectory is
one ``Environment.run_rollout`` of the environment against the rank's OpenAI-compatible endpoint, through
verifiers' own ``OpenAIChatCompletionsClient``; its rubric's reward is the trajectory's reward and its metrics the
trajectory's ``extra_logs``. The carried release is 0.3.1 and its ``verifiers.legacy`` API (``load_environment``,
``SingleTurnEnv``, ``ToolEnv``, ``MultiTurnEnv``); docs/agents.md says why not 0.4.0.

An agent file is two lines::

    from rlhf.agents.verifiers_env import environment_agent
    run_agent = environment_agent("my_env", **env_args)   # the module name load_environment imports, or an env

The job's prompt (a string, or a list of chat messages) and label are the rollout's ``prompt`` and ``answer``; the
environment's ``system_prompt`` and ``few_shot`` go before a string prompt, as its own dataset formatting does. The
environment's dataset is not read: the job's ``--prompt_data`` is.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def _messages(env, prompt) -> list[dict]:
    if isinstance(prompt, list):
        return [dict(m) for m in prompt]
    head = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
    return head + [dict(m) for m in (env.few_shot or [])] + [{"role": "user", "content": str(prompt)}]


def environment_agent(env, **env_args):
    """A ``run_agent(client, prompt, label, model, index, **kw)`` running the verifiers environment ``env`` (an
    ``Environment``, or an id for ``verifiers.legacy.utils.env_utils.load_environment(env, **env_args)``; loaded
    once, at the first call). Returns ``{"reward", "scores", "extra_logs"}``: the rubric's reward and metrics."""
    state = {"env": env if not isinstance(env, str) else None}

    def environment():
        if state["env"] is None:
            from verifiers.legacy.utils.env_utils import load_environment

            state["env"] = load_environment(env, **env_args)
            log.info("verifiers environment %r: %s", env, type(state["env"]).__name__)
        return state["env"]

    async def run_agent(client, prompt, label, model, index=0, **kw):
        from verifiers.legacy.clients import OpenAIChatCompletionsClient

        e = environment()
        row = {"prompt": _messages(e, prompt), "example_id": int(index), "answer": "" if label is None else str(label)}
        out = await e.run_rollout(row, OpenAIChatCompletionsClient(client), model, dict(e.sampling_args or {}))
        if out.get("error"):
            raise RuntimeError(f"verifiers rollout failed: {out['error']}")
        reward = float(out["reward"])
        metrics = {k: float(v) for k, v in (out.get("metrics") or {}).items() if isinstance(v, (int, float))}
        return {"reward": reward, "scores": reward, "extra_logs": metrics}

    return run_agent
