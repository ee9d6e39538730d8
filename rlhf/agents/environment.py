"""What an agent file (``--agent_func_path``) programs against: OpenRLHF's environment API (``AgentInstanceBase``,
``AgentExecutorBase``), the fields of vLLM's records that agents read (``SamplingParams``, ``Completion``,
``RequestOutput``), and the check of what an environment's ``step`` returns. ``rlhf.agents`` hands these names on;
the executors that run them are ``rlhf.agents.executor``."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

REQUIRED_STEP_KEYS = ("rewards", "environment_feedback", "done")


class AgentInstanceBase(ABC):
    """One environment, made fresh (no arguments) for each trajectory."""

    @abstractmethod
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        """``states``: ``{"observation": prompt text, "label": label}``; returns ``{"observation": text}``."""
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs):
        """``states``: ``observation_text`` (everything before this turn's action), ``action_text``, ``label``,
        ``sampling_params``; returns the dict described in the module docstring."""
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase(ABC):
    @abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        """One trajectory: a dict with ``observation_tokens``, ``action_ranges``, ``rollout_log_probs``,
        ``reward``, ``scores`` and ``extra_logs`` (OpenRLHF's keys)."""
        raise NotImplementedError("AgentExecutorBase.execute is not implemented")


@dataclass
class SamplingParams:
    """The per-turn sampling settings handed to agents (the fields of vLLM's ``SamplingParams`` that are read;
    an agent may return vLLM's own object instead)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    logprobs: int | None = 1
    """the sampled token's log-prob is always returned (OpenRLHF sets 1 to ask for it)"""


@dataclass
class Completion:
    """vLLM's ``CompletionOutput`` fields that agents read."""

    token_ids: list[int]
    text: str
    logprobs: list[dict]
    finish_reason: str


@dataclass
class RequestOutput:
    outputs: list[Completion]
    prompt_token_ids: list[int] = field(default_factory=list)


class _Logprob:
    __slots__ = ("logprob",)

    def __init__(self, logprob: float):
        self.logprob = logprob


def as_float(x, what: str) -> float:
    """A step's number: a Python number or a one-element tensor (OpenRLHF calls ``.item()``)."""
    if hasattr(x, "item"):
        if getattr(x, "numel", lambda: 1)() != 1:
            raise ValueError(f"{what} must be one number, got a tensor of shape {tuple(x.shape)}")
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"{what} must be a finite number, got {x!r}")
    return float(x)


class MalformedStep(ValueError):
    """An environment's ``reset`` or ``step`` answered with something the loop cannot use."""


def check_step_result(result: Any) -> None:
    """A malformed ``step`` result names what is wrong (the trajectory then fails with that reason)."""
    if not isinstance(result, dict):
        raise MalformedStep(f"step must return a dict, got {type(result).__name__}")
    missing = [k for k in REQUIRED_STEP_KEYS if k not in result]
    if missing:
        raise MalformedStep(f"step's result lacks {', '.join(missing)}")
    try:
        as_float(result["rewards"], "rewards")
    except ValueError as e:
        raise MalformedStep(str(e)) from None
    if not isinstance(result["environment_feedback"], str):
        raise MalformedStep(f"environment_feedback must be text, got {type(result['environment_feedback']).__name__}")
