"""Multi-turn agents: OpenRLHF's environment API (``openrlhf/utils/agent.py``, the same class names, methods and
dict keys; our code), so that an OpenRLHF agent file runs here with one line changed::

    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor   # OpenRLHF
    from rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor            # here

An agent file (``--agent_func_path``) defines ``AgentExecutor``, a subclass of :class:`AgentExecutorBase` built with
no arguments; usually ``class AgentExecutor(MultiTurnAgentExecutor): def __init__(self):
super().__init__(AgentInstance)`` around an :class:`AgentInstanceBase` subclass with ``async reset(states)`` and
``async step(states)``. The rollout (``rlhf.agents.rollout``) runs every trajectory's ``execute`` concurrently
(asyncio) and answers all their ``llm_engine.generate`` calls of a turn with one batched call of the colocated
engine.

``step`` returns ``rewards`` (a number or a one-element tensor; a trajectory's reward is the sum over its steps),
``environment_feedback`` (text, tokenized and appended as context), ``done``, and optionally ``scores`` (what
dynamic filtering reads; the last step's; default the reward), ``sampling_params`` (the next turn's) and
``extra_logs`` (the last step's, logged as ``reward_extra/<name>``). Only the model's own tokens carry loss.
"""
from rlhf.agents.environment import (REQUIRED_STEP_KEYS, AgentExecutorBase, AgentInstanceBase, Completion,
                                     MalformedStep, RequestOutput, SamplingParams, as_float, check_step_result)
from rlhf.agents.executor import (CURRENT, MultiTurnAgentExecutor, SingleTurnAgentExecutor, TooManyAgentFailures,
                                  Trajectory, env_call, execute_kwargs, load_agent_executor, seed_environment)

__all__ = ["AgentExecutorBase", "AgentInstanceBase", "CURRENT", "Completion", "MalformedStep", "MultiTurnAgentExecutor",
           "REQUIRED_STEP_KEYS", "RequestOutput", "SamplingParams", "SingleTurnAgentExecutor", "TooManyAgentFailures",
           "Trajectory", "as_float", "check_step_result", "env_call", "execute_kwargs", "load_agent_executor",
           "seed_environment"]
