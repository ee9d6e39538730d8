"""``launch/ppo.py``'s agent flags (OpenRLHF's dotted names beside ours) and their checks, before any model."""
from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.part import Part, flag


@dataclass
class AgentPart(Part):
    """Multi-turn agents; once ``check_agent_args`` has filled ``max_len``, the agent rollout's configuration
    (``rlhf.agents.rollout.AgentRollout``)."""

    agent_func_path: str | None = flag("--agent_func_path", "--train.agent_func_path", dest="agent_func_path",
                                       default=None,
                                       help="a Python file defining OpenRLHF's AgentExecutor (rlhf.agents) or "
                                            "run_agent(client, prompt, label, **kw), a program against the rank's "
                                            "OpenAI-compatible endpoint (rlhf.agents.program): multi-turn "
                                            "trajectories; their rewards are the step's reward")
    """(--agent_func_path) a Python file defining OpenRLHF's AgentExecutor, or a run_agent program"""
    max_turns: int | None = flag(type=int, default=None,
                                 help="--agent_func_path: at most this many model turns per trajectory (default: "
                                      "until done or the token budget)")
    """(--max_turns) model turns per trajectory at most"""
    max_len: int | None = flag("--max_len", "--data.max_len", dest="max_len", type=int, default=None,
                               help="prompt and reply tokens together (OpenRLHF's): prompts keep at most --max_len - "
                                    "--generate_max_len; with --agent_func_path a trajectory's token budget (default "
                                    "--prompt_max_len + --generate_max_len), each turn at most --generate_max_len")
    """(--max_len, --data.max_len) prompt and reply tokens together; filled by ``check_agent_args``"""
    agent_timeout_s: float = flag(type=float, default=60.0,
                                  help="--agent_func_path: seconds an environment's reset or step may take before "
                                       "its trajectory fails (reward 0)")
    """(--agent_timeout_s) seconds an environment's reset or step may take"""
    max_agent_failures: int = flag(type=int, default=0,
                                   help="--agent_func_path: failed trajectories tolerated per step (reward 0, "
                                        "counted); more stop the job")
    """(--max_agent_failures) failed trajectories tolerated per step"""
    agent_max_sessions: int | None = flag(type=int, default=None,
                                          help="--agent_func_path: trajectories one rank runs at once (their "
                                               "environments or run_agent programs; default: all of its share)")
    """(--agent_max_sessions) trajectories one rank runs at once"""

    def check_agent(self) -> None:
        """The agent's own values, once ``check_agent_args`` knows an agent runs (``ValueError`` naming the flag).
        The part is then the agent rollout's configuration (``rlhf.agents.rollout.AgentRollout``)."""
        if self.agent_max_sessions is not None and self.agent_max_sessions < 1:
            raise ValueError(f"--agent_max_sessions must be >= 1, got {self.agent_max_sessions}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"--max_turns must be >= 1, got {self.max_turns}")
        if not self.agent_timeout_s > 0:
            raise ValueError(f"--agent_timeout_s must be > 0, got {self.agent_timeout_s}")
        if self.max_agent_failures < 0:
            raise ValueError(f"--max_agent_failures must be >= 0, got {self.max_agent_failures}")


def check_agent_args(job) -> None:
    """The agent flags against the rest of the job (``PPOJobConfig``); fills --max_len's default (and lowers
    --prompt_max_len under an OpenRLHF --max_len). ``ValueError`` naming them."""
    agent, gen = job.agent, job.generation
    if not agent.agent_func_path:
        if agent.max_turns is not None:
            raise ValueError(f"--max_turns {agent.max_turns} applies to multi-turn agents: add --agent_func_path")
        if agent.max_len is not None:  # OpenRLHF's --data.max_len: prompt and reply together
            if agent.max_len <= gen.generate_max_len:
                raise ValueError(f"--max_len {agent.max_len} leaves no room for a prompt beside --generate_max_len "
                                 f"{gen.generate_max_len}")
            gen.prompt_max_len = min(gen.prompt_max_len, agent.max_len - gen.generate_max_len)
        return
    if agent.max_len is None:
        agent.max_len = gen.prompt_max_len + gen.generate_max_len
    if agent.max_len < 2:
        raise ValueError(f"--max_len must be >= 2, got {agent.max_len}")
    agent.check_agent()
    from rlhf.agents.executor import load_agent_executor

    load_agent_executor(agent.agent_func_path)  # the user's file imports and defines AgentExecutor: before any model
    algo = job.algo
    refused = [("--overlong_buffer_len", algo.overlong_buffer_len, "it measures one reply against --generate_max_len"),
               ("--stop_properly_penalty_coef", algo.stop_properly_penalty_coef, "it scores one reply's ending"),
               ("--ignore_eos", gen.ignore_eos or None, "a benchmark setting for one reply"),
               ("--pretrain_data", job.ptx.pretrain_data, "not supported with trajectories yet")]
    for flag, value, why in refused:
        if value is not None:
            raise ValueError(f"--agent_func_path with {flag}: {why}; drop one of them")
    if job.rollout.rollout_backend == "megatron" and job.parallel.expert_model_parallel_size > 1:
        raise ValueError("--agent_func_path with --rollout_backend megatron and --expert_model_parallel_size > 1: the "
                         "fallback generator's turns differ in length across data-parallel ranks, whose MoE forwards "
                         "are collectives; use vLLM")


def check_agent_fit(agent: AgentPart, hf_config: dict) -> None:
    """--max_len within the actor's positions (vLLM refuses a longer context; RoPE past them is garbage)."""
    limit = hf_config.get("max_position_embeddings")
    if agent.agent_func_path and limit and agent.max_len > limit:
        raise ValueError(f"--max_len {agent.max_len} is longer than --pretrain's max_position_embeddings {limit}: "
                         "a trajectory cannot be longer than the model's context")


def response_width(generation, agent: AgentPart, samples: list) -> int:
    """The experience batch's response columns: --generate_max_len (``generation``), or with an agent the longest
    trajectory's tokens after its prompt if longer (``samples``: the step's, the same on every rank)."""
    if not agent.agent_func_path:
        return generation.generate_max_len
    return max([generation.generate_max_len] + [len(s.response_ids) for s in samples])


def generator_max_model_len(generation, agent: AgentPart) -> int:
    """The generator's context: a prompt and a reply (``generation``: the job's ``GenerationPart``), or a whole
    trajectory with an agent."""
    return max(generation.prompt_max_len + generation.generate_max_len,
               agent.max_len if agent.agent_func_path else 0)
