"""Running one trajectory: OpenRLHF's multi-turn and single-turn executors (the trajectory's seed and timeout around
each environment call: ``rlhf.agents.trajectory``), and loading ``--agent_func_path``'s ``AgentExecutor`` (or its
``run_agent``). ``rlhf.agents`` hands these names on; the rollout that runs every trajectory of a step is
``rlhf.agents.rollout``."""
from __future__ import annotations

import copy
import inspect

from rlhf.agents.environment import (AgentExecutorBase, AgentInstanceBase, MalformedStep, as_float,
                                     check_step_result)
from rlhf.agents.trajectory import CURRENT, Trajectory, env_call, seed_environment  # noqa: F401 - handed on


class TooManyAgentFailures(RuntimeError):
    """More trajectories failed in a step than --max_agent_failures allows: the job stops with one line (every
    rank decides alike: each holds every trajectory's outcome)."""


class MultiTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF's multi-turn loop: reset, then generate / step until ``done``, the token budget
    (``max_length``; each turn at most the sampling params' ``max_tokens``, the trainer's --generate_max_len) or
    ``max_turns`` (the trainer's --max_turns, when set). The model's tokens are never re-tokenized: the
    observation grows by the action's token ids and the feedback's tokens."""

    max_turns: int | None = None  # set by the rollout from --max_turns

    def __init__(self, agent_instance_cls):
        assert issubclass(agent_instance_cls, AgentInstanceBase), "AgentInstance must inherit from AgentInstanceBase"
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None,
                      prompt_ids: list[int] | None = None):
        """OpenRLHF's result dict, plus ``turns``, ``done``, ``last_finished`` (the last action ended by EOS),
        ``prompt_length`` and ``failure`` (an environment that raised, answered malformed or too late: the
        trajectory ends there, what it has so far is kept; the rollout gives it reward 0)."""
        t = {"obs": [], "ranges": [], "lps": [], "total": 0.0, "scores": None, "extra": {}, "done": False,
             "turns": 0, "start": 0, "finished": False}
        try:
            await self._run(t, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, prompt_ids)
            failure = None
        except Exception as e:  # noqa: BLE001 - the environment's failure ends this trajectory only
            failure = f"{type(e).__name__}: {e}"
            if not t["obs"]:
                t["obs"] = list(prompt_ids) if prompt_ids is not None else hf_tokenizer(
                    text=prompt, add_special_tokens=False)["input_ids"]
                t["lps"], t["start"] = [0.0] * len(t["obs"]), len(t["obs"])
        return {"prompt": prompt, "label": label, "observation_tokens": t["obs"], "action_ranges": t["ranges"],
                "rollout_log_probs": t["lps"], "reward": t["total"],
                "scores": t["total"] if t["scores"] is None else t["scores"], "extra_logs": t["extra"],
                "turns": t["turns"], "done": t["done"], "last_finished": t["finished"],
                "prompt_length": t["start"], "failure": failure}

    async def _run(self, t, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, prompt_ids):
        seed_environment()
        agent = self.agent_instance_cls()
        first = await env_call(agent.reset, {"observation": prompt, "label": label})
        obs_text = first["observation"] if isinstance(first, dict) else first
        if not isinstance(obs_text, str):
            raise MalformedStep(f"reset must return {{'observation': text}}, got {first!r}"[:200])
        if prompt_ids is not None and obs_text == prompt:
            obs = list(prompt_ids)  # the dataset's tokens (chat template, BOS): the single-turn path's prompt
        else:
            obs = hf_tokenizer(text=obs_text, add_special_tokens=False)["input_ids"]
        if len(obs) > max_length - 1:
            obs = obs[-(max_length - 1):]
            obs_text = hf_tokenizer.decode(obs)
        t.update(obs=obs, lps=[0.0] * len(obs), start=len(obs))
        per_turn = sampling_params.max_tokens or max_length
        while not t["done"]:
            budget = min(per_turn, max_length - len(t["obs"]))
            if budget <= 0 or (self.max_turns is not None and t["turns"] >= self.max_turns):
                break
            params = copy.copy(sampling_params)
            params.max_tokens = budget
            out = (await llm_engine.generate(t["obs"], params)).outputs[0]
            action = list(out.token_ids)
            t["ranges"].append((len(t["obs"]), len(t["obs"]) + len(action)))
            t["obs"] = t["obs"] + action
            t["lps"] += ([next(iter(d.values())).logprob for d in out.logprobs] if out.logprobs
                         else [0.0] * len(action))
            t["turns"] += 1
            t["finished"] = out.finish_reason == "stop"
            result = await env_call(agent.step, {"observation_text": obs_text, "action_text": out.text,
                                                 "label": label, "sampling_params": sampling_params})
            check_step_result(result)
            t["total"] += as_float(result["rewards"], "rewards")
            if result.get("scores") is not None:
                try:
                    t["scores"] = as_float(result["scores"], "scores")
                except ValueError as e:
                    raise MalformedStep(str(e)) from None
            t["extra"] = result.get("extra_logs") or t["extra"]
            t["done"] = bool(result["done"])
            sampling_params = result.get("sampling_params") or sampling_params
            feedback = result["environment_feedback"]
            fb = hf_tokenizer(text=feedback, add_special_tokens=False)["input_ids"] if feedback else []
            obs_text += out.text + feedback
            t["obs"] = t["obs"] + fb
            t["lps"] += [0.0] * len(fb)


class SingleTurnAgentExecutor(AgentExecutorBase):
    """One generation, no environment (OpenRLHF's default executor); the reward comes from the trainer's reward
    sources. Used by the tests as the agent form of the plain path."""

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None,
                      prompt_ids: list[int] | None = None):
        obs = list(prompt_ids) if prompt_ids is not None else hf_tokenizer(text=prompt, add_special_tokens=False)[
            "input_ids"]
        params = copy.copy(sampling_params)
        params.max_tokens = min(sampling_params.max_tokens or max_length, max_length - len(obs))
        out = (await llm_engine.generate(obs, params)).outputs[0]
        action = list(out.token_ids)
        return {"prompt": prompt, "label": label, "observation_tokens": obs + action,
                "action_ranges": [(len(obs), len(obs) + len(action))],
                "rollout_log_probs": [0.0] * len(obs) + [next(iter(d.values())).logprob for d in out.logprobs],
                "reward": None, "scores": None, "extra_logs": {}, "turns": 1, "done": True,
                "last_finished": out.finish_reason == "stop", "prompt_length": len(obs), "failure": None}


def load_agent_executor(path: str) -> AgentExecutorBase:
    """``--agent_func_path``: the file's ``AgentExecutor`` class (an :class:`AgentExecutorBase`), built with no
    arguments, as OpenRLHF loads it, else its ``run_agent`` function (``rlhf.agents.program.RunAgentExecutor``).
    Bad files raise ``ValueError`` naming the flag."""
    import importlib.util
    import os

    if not path.endswith(".py") or not os.path.isfile(path):
        raise ValueError(f"--agent_func_path {path}: expected an existing .py file")
    spec = importlib.util.spec_from_file_location("agent_module", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: say which and why
        raise ValueError(f"--agent_func_path {path}: importing it failed: {type(e).__name__}: {e}") from None
    cls = getattr(module, "AgentExecutor", None)
    if inspect.isclass(cls) and issubclass(cls, AgentExecutorBase):
        return cls()
    if getattr(module, "run_agent", None) is not None:
        from rlhf.agents.program import RunAgentExecutor

        return RunAgentExecutor(module.run_agent, path)
    raise ValueError(f"--agent_func_path {path}: the file must define class AgentExecutor(AgentExecutorBase) "
                     f"(for example AgentExecutor(MultiTurnAgentExecutor) around an AgentInstanceBase) or a function "
                     f"run_agent(client, prompt, label, **kw) (rlhf.agents.program)")


def execute_kwargs(executor: AgentExecutorBase) -> set[str]:
    """The keyword arguments ``executor.execute`` accepts (``prompt_ids`` is ours; OpenRLHF's files lack it)."""
    sig = inspect.signature(executor.execute)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return {"prompt", "label", "sampling_params", "max_length", "hf_tokenizer", "llm_engine", "images",
                "prompt_ids"}
    return set(sig.parameters)
