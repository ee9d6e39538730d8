"""Multi-turn agents (rlhf.agents, --agent_func_path), OpenRLHF's environment API.

The executor's loop against a scripted engine, by hand: the observation grows by the action's token ids and the
feedback's tokens, only actions carry log-probs, the reward is the sum of the step rewards, the token budget,
--max_turns and failures (raise, malformed, timeout) end a trajectory; OpenRLHF's own example file runs with its
import line changed, its random environment repeating under the trajectory's seed. The PPO runs are below."""
from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from ppo_common import TINY_GRPO, ppo_args

# Training runs in this process (main(argv)): pytest-timeout interrupts a test whose run hangs after 300 s, 5x the
# slowest of these files' tests on a loaded 2-core AMD EPYC (36-62 s, 2026-11-27; test_rlvr_options 11-50 s).
pytestmark = pytest.mark.timeout(300)

PEERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peers", "openrlhf")


@pytest.fixture(scope="module")
def tok(ppo_setup):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ppo_setup["actor"])


class ScriptedLLM:
    """An ``llm_engine`` answering each turn with the next scripted token ids (cut at the turn's max_tokens),
    log-prob -0.5 each; it records each call's context and budget."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.calls = tok, list(replies), []

    async def generate(self, ids, params, multi_modal_data=None):
        from rlhf.agents.environment import Completion, RequestOutput, _Logprob

        self.calls.append((list(ids), params.max_tokens))
        toks = self.replies.pop(0)[: params.max_tokens]
        return RequestOutput([Completion(toks, self.tok.decode(toks), [{t: _Logprob(-0.5)} for t in toks], "stop")])


def _run(executor, tok, llm, prompt_ids, max_length=64, max_tokens=8, traj=None):
    from rlhf.agents import CURRENT, SamplingParams

    async def go():
        if traj is not None:
            CURRENT.set(traj)
        return await executor.execute(prompt=tok.decode(prompt_ids), label="L",
                                      sampling_params=SamplingParams(max_tokens=max_tokens), max_length=max_length,
                                      hf_tokenizer=tok, llm_engine=llm, prompt_ids=prompt_ids)

    return asyncio.run(go())


def _executor(step):
    from rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor

    class Env(AgentInstanceBase):
        def __init__(self):
            self.n, self.seen = 0, []

        async def step(self, states, **kw):
            self.n += 1
            self.seen.append(dict(states))
            return await step(self, states)

    return MultiTurnAgentExecutor(Env)


def test_two_turns_by_hand(tok):
    """Turn 1: action a1, feedback " ok then" (0.25); turn 2: action a2, done (1.0). Observation, action ranges,
    log-probs (0 on the prompt and the feedback), reward sum, the texts the environment saw."""
    seen = []

    async def step(env, states):
        seen.append(states)
        if env.n == 1:
            return {"rewards": torch.tensor(0.25), "environment_feedback": " ok then", "done": False}
        return {"rewards": 1.0, "environment_feedback": "", "done": True, "extra_logs": {"n": env.n}}

    prompt, a1, a2 = [5, 6, 7], [10, 11], [12, 13, 14]
    fb = tok(text=" ok then", add_special_tokens=False)["input_ids"]
    llm = ScriptedLLM(tok, [a1, a2])
    out = _run(_executor(step), tok, llm, prompt)
    assert out["observation_tokens"] == prompt + a1 + fb + a2
    assert out["action_ranges"] == [(3, 5), (5 + len(fb), 8 + len(fb))]
    assert out["rollout_log_probs"] == [0.0] * 3 + [-0.5] * 2 + [0.0] * len(fb) + [-0.5] * 3
    assert out["reward"] == 1.25 and out["scores"] == 1.25 and out["turns"] == 2 and out["done"]
    assert out["extra_logs"] == {"n": 2} and out["failure"] is None and out["prompt_length"] == 3
    assert [c[0] for c in llm.calls] == [prompt, prompt + a1 + fb]  # the model's tokens are never re-tokenized
    assert seen[0]["action_text"] == tok.decode(a1) and seen[0]["label"] == "L"
    assert seen[1]["observation_text"] == tok.decode(prompt) + tok.decode(a1) + " ok then"


def test_a_trajectorys_routing_is_its_longest_prefix_call():
    """By hand: a trajectory (prompt 1 2, action 3 4, tool 5, action 6 7) gets the routing of the generator call
    sharing its longest prefix (turn 2 fed 1..6 and sampled 6 7: 6 positions), cut where a call parts from it; a
    trajectory whose actions no call covers (turn 2 re-rendered the tool's answer) gets none."""
    import numpy as np

    from rlhf.agents.rollout import trajectory_routing

    obs, actions = [1, 2, 3, 4, 5, 6, 7], [(2, 4), (5, 7)]
    r1, r2 = np.arange(3).reshape(3, 1, 1), 10 + np.arange(6).reshape(6, 1, 1)  # (positions fed, layers, K)
    turn1, turn2 = ([1, 2, 3, 4], r1), ([1, 2, 3, 4, 5, 6, 7], r2)
    assert trajectory_routing([turn1, turn2], obs, actions).tolist() == r2.tolist()
    assert trajectory_routing([turn2, turn1], obs, actions).tolist() == r2.tolist()  # not the last call: the longest
    assert trajectory_routing([turn1, turn2], obs[:5], [(2, 4)]).tolist() == r2[:5].tolist()  # cut by --max_len
    edited = ([1, 2, 3, 4, 9, 6, 7], r2)  # the tool's answer re-rendered: the call parts from obs at position 4
    assert trajectory_routing([turn1, edited], obs, actions) is None  # the second action's reads are not covered
    assert trajectory_routing([turn1, edited], obs[:4], [(2, 4)]).tolist() == r2[:4].tolist()
    assert trajectory_routing([], obs, actions) is None


def test_budget_and_max_turns_end_a_trajectory(tok):
    async def never_done(env, states):
        return {"rewards": 0.0, "environment_feedback": " more", "done": False}

    fb = len(tok(text=" more", add_special_tokens=False)["input_ids"])
    llm = ScriptedLLM(tok, [[9] * 8] * 10)
    out = _run(_executor(never_done), tok, llm, [5, 6, 7], max_length=3 + 8 + fb + 4, max_tokens=8)
    assert [c[1] for c in llm.calls] == [8, 4]  # each turn min(--generate_max_len, what the budget leaves)
    assert len(out["observation_tokens"]) == 3 + 8 + fb + 4 + fb and not out["done"]  # the last feedback: cut later
    ex = _executor(never_done)
    ex.max_turns = 1
    out = _run(ex, tok, ScriptedLLM(tok, [[9] * 8] * 10), [5, 6, 7])
    assert out["turns"] == 1 and not out["done"]


@pytest.mark.parametrize("kind", ["raised", "malformed", "two_rewards", "timeout"])
def test_failures_end_the_trajectory_with_a_reason(tok, kind):
    from rlhf.agents import Trajectory
    from rlhf.agents.rollout import failure_kind

    async def step(env, states):
        if env.n == 1:
            return {"rewards": 1.0, "environment_feedback": " x", "done": False}
        if kind == "raised":
            raise RuntimeError("boom")
        if kind == "malformed":
            return {"rewards": 1.0, "environment_feedback": " x"}
        if kind == "two_rewards":
            return {"rewards": torch.ones(2), "environment_feedback": "", "done": True}
        await asyncio.sleep(30)

    out = _run(_executor(step), tok, ScriptedLLM(tok, [[9, 9], [8]]), [5, 6, 7],
               traj=Trajectory(seed=1, timeout_s=0.2))
    assert out["failure"] and failure_kind(out["failure"]) == {"two_rewards": "malformed"}.get(kind, kind), out
    fb = tok(text=" x", add_special_tokens=False)["input_ids"]
    assert out["observation_tokens"] == [5, 6, 7, 9, 9] + fb + [8]  # what it had so far is kept
    assert out["turns"] == 2


def test_openrlhf_agent_file_runs_and_repeats_under_its_seed(tok):
    """OpenRLHF's examples/python/agent_func.py (import line changed): 1-3 steps drawn with ``random``, a 0/1
    reward drawn with torch on the last; seeded by the trajectory, so the same seed gives the same trajectory."""
    from rlhf.agents import Trajectory, load_agent_executor

    ex = load_agent_executor(os.path.join(PEERS, "agent_func.py"))

    def run(seed):
        return _run(ex, tok, ScriptedLLM(tok, [[9, 8]] * 5), [5, 6, 7], max_length=512,
                    traj=Trajectory(seed=seed, timeout_s=5))

    outs = {s: run(s) for s in range(12)}
    assert all(o["failure"] is None and o["done"] for o in outs.values())
    assert {o["turns"] for o in outs.values()} == {2, 3, 4}  # max_steps 1-3: done on step max_steps + 1
    assert {o["reward"] for o in outs.values()} == {0.0, 1.0}
    assert all(run(s) == outs[s] for s in (0, 5))
    for o in outs.values():  # only the actions are the model's
        assert sum(b - a for a, b in o["action_ranges"]) == 2 * o["turns"]


@pytest.mark.parametrize("body,needle", [
    ("x = 1\n", "must define class AgentExecutor(AgentExecutorBase)"),
    ("import not_a_module_here\n", "importing it failed: ModuleNotFoundError"),
])
def test_bad_agent_files_are_named(tmp_path, body, needle):
    from rlhf.agents import load_agent_executor

    f = tmp_path / "agent.py"
    f.write_text(body)
    with pytest.raises(ValueError, match="--agent_func_path") as e:
        load_agent_executor(str(f))
    assert needle in str(e.value)
    with pytest.raises(ValueError, match="expected an existing .py file"):
        load_agent_executor(str(tmp_path / "missing.py"))


# ---- PPO runs (launch/ppo.py's body in this process, one rank, the megatron generator, 4 prompts x 2 per step)
TOOL_ENV = '''
import torch
from rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    """Two turns: the first action gets a tool's answer back, the second is scored (its length's parity)."""

    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        if "FAIL" in states["observation_text"] and "kilo" in states["observation_text"]:
            raise RuntimeError("the tool crashed")
        if self.turn == 1:
            return {"rewards": torch.tensor(0.0), "environment_feedback": " tool: apple banana cherry", "done": False}
        r = float(len(states["action_text"]) % 2)
        return {"rewards": torch.tensor(r), "scores": r, "environment_feedback": "", "done": True,
                "extra_logs": {"second_len": float(len(states["action_text"]))}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def _agent_run(ppo_setup, out, monkeypatch, capsys, agent, *extra, prompts=None, code=0, **kw):
    from helpers import free_port
    from rlhf.observability.metrics import read_metrics_jsonl
    from rlhf.ppo import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    flags = {**TINY_GRPO, "--rollout_backend": "megatron", "--max_samples": "8", "--agent_func_path": agent,
             "--actor_learning_rate": "1e-3", **kw}
    if prompts:
        flags["--prompt_data"] = prompts
    assert main(ppo_args(ppo_setup, str(out), **flags) + list(extra)) == code
    log = capsys.readouterr().err
    return (read_metrics_jsonl(str(out / "metrics.jsonl"), "ppo") if code == 0 else None), log


@pytest.mark.parametrize("packing", [False, True])
def test_two_turn_tool_trajectories_train_on_the_models_tokens_only(ppo_setup, tmp_path, monkeypatch, capsys,
                                                                     packing):
    """Every trajectory takes two turns with a tool's answer between them; the generator's log-probs equal the
    trainer's on the tokens that carry loss (drift ~1e-6 in fp32), which they could not if the tool's tokens (log-prob
    0 from the generator) were among them: the negative control (one step) marks every token as the model's and the
    same check fails by whole nats. Padded and packed (--packing_samples), each with its control."""
    env = tmp_path / "tool_env.py"
    env.write_text(TOOL_ENV)
    extra = ["--packing_samples"] if packing else []
    m, log = _agent_run(ppo_setup, tmp_path / "o", monkeypatch, capsys, str(env), *extra, **{"--max_len": "96"})
    assert "agent: %s (MultiTurnAgentExecutor); trajectories of at most 96 tokens, environment calls within 60s" % env \
        in log, log[-2000:]
    assert sorted(m) == [1, 2]
    for s in m.values():
        assert s["agent/turns"] == 2.0 and s["agent/cut_rate"] == 0.0 and s["agent/failures"] == 0.0, s
        assert 0.5 < s["agent/env_tokens_share"] < 1, s  # the tool's answer among 2 x <= 3 tokens of the model's
        assert s["rollout_logprob_drift_max"] < 1e-4, s
        assert 1.0 <= s["reward_extra/second_len"] and 0.0 <= s["reward"] <= 1.0, s
    from rlhf.agents import rollout as agent_rollout

    real = agent_rollout.AgentRollout._sample

    def every_token_the_models(self, i, r):
        smp = real(self, i, r)
        smp.action_mask = [True] * len(smp.response_ids)
        return smp

    monkeypatch.setattr(agent_rollout.AgentRollout, "_sample", every_token_the_models)
    bad, _ = _agent_run(ppo_setup, tmp_path / "control", monkeypatch, capsys, str(env), *extra, "--stop_after_steps",
                        "1", **{"--max_len": "96"})  # one step: the drift is measured before the first update
    assert sorted(bad) == [1] and bad[1]["rollout_logprob_drift_max"] > 1.0, bad  # measured: 6.11 (both)


def test_held_out_evaluation_runs_the_agent(ppo_setup, tmp_path, monkeypatch, capsys):
    """--eval_dataset with an agent: the held-out prompts run as the agent's two-turn trajectories (3 per prompt,
    training takes 2), and eval/reward and eval/pass@3 are the mean and the mean best-of-3 of those trajectories'
    environment rewards, counted here by hand from the trajectories the evaluation ran."""
    from rlhf.agents import rollout as agent_rollout

    env = tmp_path / "tool_env.py"
    env.write_text(TOOL_ENV)
    real, runs = agent_rollout.AgentRollout.run, []

    def recorded(self, engine, prompts, prompt_idx, *, n, **kw):
        samples, metrics = real(self, engine, prompts, prompt_idx, n=n, **kw)
        runs.append((n, [s.agent.reward for s in samples]))
        return samples, metrics

    monkeypatch.setattr(agent_rollout.AgentRollout, "run", recorded)
    m, _ = _agent_run(ppo_setup, tmp_path / "o", monkeypatch, capsys, str(env), "--eval_dataset", ppo_setup["prompts"],
                      "--eval_n_samples_per_prompt", "3", "--eval_max_samples", "4", **{"--max_len": "96"})
    evals = [r for n, r in runs if n == 3]
    assert len(evals) == 2 and len(runs) == 4 and all(len(r) == 12 for r in evals), runs  # step 0 and the end
    from rlhf.observability.metrics import read_metrics_jsonl

    logged = read_metrics_jsonl(str(tmp_path / "o" / "metrics.jsonl"), "eval")
    assert sorted(logged) == [0, 2], logged
    for step, rewards in zip((0, 2), evals):
        best = sum(max(rewards[i:i + 3]) for i in range(0, 12, 3)) / 4
        got = logged[step]
        assert got["reward"] == pytest.approx(sum(rewards) / 12, abs=1e-6) and got["pass@3"] == pytest.approx(best), got
        assert got["agent/turns"] == 2.0 and got["agent/failures"] == 0.0, got
    assert any(0 < sum(r) < 12 for r in evals), evals  # the rewards differ: a wrong pairing would show


def test_environment_failures_are_counted_then_stop_the_job(ppo_setup, tmp_path, monkeypatch, capsys):
    """Prompts marked FAIL whose words include 'kilo' crash the tool: those trajectories get reward 0 and are counted
    under agent/failures/raised; with the default --max_agent_failures 0 the job stops with one line."""
    import random

    rng = random.Random(4)
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(8):
            words = rng.sample(["kilo", "lima", "mike", "echo"], 2)
            f.write(json.dumps({"prompt": ("FAIL " if i % 2 else "say ") + " ".join(words)}) + "\n")
    env = tmp_path / "tool_env.py"
    env.write_text(TOOL_ENV)
    m, _ = _agent_run(ppo_setup, tmp_path / "o", monkeypatch, capsys, str(env), prompts=str(path),
                      **{"--max_agent_failures": "8", "--max_len": "96"})
    failed = sum(s.get("agent/failures/raised", 0.0) for s in m.values())
    assert failed > 0 and all(s["agent/failures"] == s.get("agent/failures/raised", 0.0) for s in m.values()), m
    _, log = _agent_run(ppo_setup, tmp_path / "stop", monkeypatch, capsys, str(env), prompts=str(path), code=3,
                        **{"--max_len": "96"})
    assert "agent trajectories failed in this step (--max_agent_failures 0): {'raised':" in log, log[-2000:]
    assert "RuntimeError: the tool crashed" in log


def test_openrlhf_agent_resumes_exactly(ppo_setup, tmp_path, monkeypatch, capsys):
    """OpenRLHF's random environment (1-3 steps, a random 0/1 reward) in PPO: three steps straight equal one step, a
    stop and a resume, to the last bit (the environments are seeded from the step and the trajectory)."""
    from crash_harness import assert_resumed

    agent = os.path.join(PEERS, "agent_func.py")
    kw = {"--max_samples": "12", "--save_steps": "1", "--generate_max_len": "2"}
    straight, _ = _agent_run(ppo_setup, tmp_path / "s", monkeypatch, capsys, agent, "--stop_after_steps", "3", **kw)
    assert sorted(straight) == [1, 2, 3]
    assert {s["agent/turns"] for s in straight.values()} != {2.0}  # trajectories of different lengths
    _agent_run(ppo_setup, tmp_path / "r", monkeypatch, capsys, agent, "--stop_after_steps", "1", **kw)
    resumed, log = _agent_run(ppo_setup, tmp_path / "r", monkeypatch, capsys, agent, "--load_checkpoint",
                              "--stop_after_steps", "2", **kw)
    assert_resumed(log, "ppo", step=1)
    skip = ("time/", "tokens_per_s", "mem/", "offload/", "weight_sync/", "weight_version", "agent/env_seconds")
    for s in (2, 3):
        same = {k: v for k, v in straight[s].items() if not k.startswith(skip)}
        assert {k: v for k, v in resumed[s].items() if not k.startswith(skip)} == same, s
        assert "reward_extra/dummy_scores" in same and "agent/turns" in same


ONE_TURN_ENV = '''
from transformers import AutoTokenizer

from _rule_reward import char_code_reward
from rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor

SPECIAL = AutoTokenizer.from_pretrained(%r).all_special_tokens


class AgentInstance(AgentInstanceBase):
    """One turn scored by the plain run's --reward_fn (on the reply without special tokens, as that run decodes)."""

    def __init__(self, *args, **kwargs):
        pass

    async def step(self, states, **kwargs):
        text = states["action_text"]
        for t in SPECIAL:
            text = text.replace(t, "")
        return {"rewards": char_code_reward([], [text])[0], "environment_feedback": "", "done": True}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def test_one_turn_agent_is_the_plain_path_bit_for_bit(ppo_setup, tmp_path, monkeypatch, capsys):
    """A one-turn environment that scores the reply with the plain run's rule reward: with vLLM the same samples
    (each trajectory's first turn is seeded as the plain path's sample), rewards and updates, to the last bit: every
    step's metrics and the final weights."""
    from helpers import free_port
    from rlhf.observability.metrics import read_metrics_jsonl
    from rlhf.ppo import main
    from safetensors.torch import load_file

    env = tmp_path / "one_turn.py"
    env.write_text(ONE_TURN_ENV % ppo_setup["actor"])

    def run(out, **kw):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--max_samples": "8", "--actor_learning_rate": "1e-3",
                                                "--rollout_backend": "vllm", **kw})
        assert main(argv) == 0
        capsys.readouterr()
        return read_metrics_jsonl(str(out / "metrics.jsonl"), "ppo"), load_file(str(out / "model.safetensors"))

    plain, w_plain = run(tmp_path / "plain", **{"--reward_fn": "_rule_reward:char_code_reward"})
    agent, w_agent = run(tmp_path / "agent", **{"--agent_func_path": str(env)})
    skip = ("time/", "tokens_per_s", "mem/", "offload/", "weight_sync/", "agent/")
    assert sorted(plain) == sorted(agent) == [1, 2]
    for s in plain:
        assert agent[s]["agent/turns"] == 1.0 and agent[s]["agent/env_tokens_share"] == 0.0
        same = {k: v for k, v in plain[s].items() if not k.startswith(skip)}
        assert {k: v for k, v in agent[s].items() if not k.startswith(skip)} == same, s
        assert same["advantages_abs"] > 0 and same["actor/grad_norm"] > 0
    assert w_plain.keys() == w_agent.keys() and all(torch.equal(w_plain[k], w_agent[k]) for k in w_plain)


def test_two_ranks_vllm_trajectories_of_different_lengths(ppo_setup, tmp_path):
    """torchrun, 2 ranks sharing one vLLM engine (TP 2), OpenRLHF's random environment: each rank runs its half of
    the trajectories, whose turn counts differ (so in some rounds a rank has nothing to generate but still joins the
    engine's batched call); every sampled action token's log-prob agrees with the trainer's (fp32), the tool's tokens
    are masked, and the environments' extra logs are logged."""
    from helpers import REPO, run_torchrun, tail
    from rlhf.observability.metrics import read_metrics_jsonl

    save = tmp_path / "o"
    args = ppo_args(ppo_setup, str(save), **{**TINY_GRPO, "--vllm_tensor_parallel_size": "2", "--max_samples": "8",
                                             "--agent_func_path": os.path.join(PEERS, "agent_func.py"),
                                             "--generate_max_len": "2", "--max_len": "256",
                                             "--actor_learning_rate": "1e-3"})
    p = run_torchrun(os.path.join(REPO, "launch", "ppo.py"), 2, args, timeout=600)
    assert p.returncode == 0, tail(p)
    m = read_metrics_jsonl(str(save / "metrics.jsonl"), "ppo")
    assert sorted(m) == [1, 2]
    for s in m.values():
        # 2-4 turns of 2 tokens between ~70-token feedbacks: a few of the longest run into --max_len 256 and are cut
        assert 2.0 < s["agent/turns"] < 4.0 and s["agent/cut_rate"] < 0.5 and s["agent/env_tokens_share"] > 0.9, s
        assert s["rollout_logprob_drift_max"] <= 1e-4, s
        assert 0 <= s["reward_extra/dummy_scores"] <= 1 and s["reward"] == s["reward_extra/dummy_scores"], s


@pytest.mark.parametrize("kw,needle", [
    ({"--max_turns": "2"}, "--max_turns 2 applies to multi-turn agents: add --agent_func_path"),
    ({"--agent_func_path": "AGENT", "--max_turns": "0"}, "--max_turns must be >= 1, got 0"),
    ({"--agent_func_path": "AGENT", "--agent_timeout_s": "0"}, "--agent_timeout_s must be > 0"),
    ({"--agent_func_path": "AGENT", "--agent_max_sessions": "0"}, "--agent_max_sessions must be >= 1, got 0"),
    ({"--agent_func_path": "AGENT", "--pretrain_data": "PROMPTS", "--reward_fn": "_rule_reward:length_reward"},
     "--agent_func_path with --pretrain_data: not supported with trajectories yet"),
    ({"--agent_func_path": "AGENT", "--max_len": "4096"},
     "--max_len 4096 is longer than --pretrain's max_position_embeddings 256"),
    ({"--agent_func_path": "missing.py"}, "--agent_func_path missing.py: expected an existing .py file"),
])
def test_agent_flags_are_checked_before_any_model(ppo_setup, tmp_path, capsys, monkeypatch, kw, needle):
    from rlhf.runtime import role as engine
    from rlhf.ppo import main

    def no_model(*a, **k):
        raise AssertionError("a model was built before the flags were checked")

    monkeypatch.setattr(engine.ModelRole, "__init__", no_model)
    agent = os.path.join(PEERS, "agent_func.py")
    kw = {k: {"AGENT": agent, "PROMPTS": ppo_setup["prompts"]}.get(v, v) for k, v in kw.items()}
    assert main(ppo_args(ppo_setup, str(tmp_path / "o"), **{**TINY_GRPO, **kw})) == 2
    err = capsys.readouterr().err
    assert needle in err, err[-2000:]


def test_calculator_agent_by_hand(tok):
    """rlhf/demo/calc_agent.py: a call gets the value back as the next user turn (ChatML), the answer after it is
    graded; an answer without a call is graded at once; expressions are integers of + - * only."""
    from rlhf.agents import SamplingParams, load_agent_executor
    from rlhf.demo.calc_agent import evaluate

    assert evaluate("12*34") == 408 and evaluate(" 60 x 56") == 3360 and evaluate("(2+3)*-4") == -20
    assert evaluate("2**100") is None and evaluate("__import__('os')") is None and evaluate("1/2") is None
    from helpers import REPO

    ex = load_agent_executor(os.path.join(REPO, "rlhf", "demo", "calc_agent.py"))
    def say(text):
        return tok(text=text, add_special_tokens=False)["input_ids"]

    prompt = "<|im_start|>user\nWhat is 12 times 34?<|im_end|>\n<|im_start|>assistant\n"
    p_ids = say(prompt)
    for replies, reward, turns in (([say("<calc>12*34</calc>"), say("408")], 1.0, 2),
                                   ([say("<calc>12*34"), say("The answer is 407")], 0.0, 2),
                                   ([say("408")], 1.0, 1), ([say("about 400")], 0.0, 1)):
        llm = ScriptedLLM(tok, replies)
        out = asyncio.run(ex.execute(prompt=prompt, label="408", sampling_params=SamplingParams(max_tokens=64),
                                     max_length=256, hf_tokenizer=tok, llm_engine=llm, prompt_ids=p_ids))
        assert out["reward"] == reward and out["turns"] == turns and out["done"], (replies, out)
        assert out["extra_logs"]["used_tool"] == float(turns > 1)
        if turns == 2:
            assert llm.calls[1][0][len(p_ids) + len(replies[0]):] == \
                say("\n<|im_start|>user\nCalculator: 408<|im_end|>\n<|im_start|>assistant\n")


def test_each_ranks_calls_get_their_own_answers():
    """Two ranks' requests in one round, among them calls of an agent file's own server (no trajectory: j = -1,
    numbered from 0 on each rank): rank 0's futures get rank 0's answers, not rank 1's call of the same number,
    and the two ranks' calls without a trajectory are seeded apart."""
    import asyncio
    import types

    from rlhf.agents.rollout import AgentRollout, Pool

    class Engine:
        def generate_requests(self, reqs):
            self.seeds = [r[4] for r in reqs]
            return [([i], [-0.5], True) for i in range(len(reqs))]

    roll = AgentRollout.__new__(AgentRollout)
    roll.routing, roll.mesh = False, types.SimpleNamespace(rank=0)
    loop = asyncio.new_event_loop()
    futs = [loop.create_future() for _ in range(2)]
    p = (1.0, 1.0, 1)
    queued = [(-1, 0, [4], p, futs[0]), (3, 0, [4], p, futs[1])]
    requests = [(0, -1, 0, [4], p, 0), (0, 3, 0, [4], p, 30), (1, -1, 0, [5], p, 0), (1, 7, 0, [6], p, 70)]
    engine, pool = Engine(), Pool()
    roll._answer(engine, pool, 11, 4, requests, queued)
    assert [f.result() for f in futs] == [([0], [-0.5], True, 4), ([1], [-0.5], True, 4)]
    assert engine.seeds[0] != engine.seeds[2] and engine.seeds[1] == 30 and engine.seeds[3] == 70
    assert pool.versions == {3: [4]} and pool.generated == 2
    loop.close()
