"""Partial rollouts with agents (``--partial_rollout`` with ``--agent_func_path``, rlhf.agents.carry): launch/ppo.py's
body in this process, one rank, the megatron generator, 4 prompts x 2 trajectories a step and two groups beyond.

An environment of 1-5 turns (drawn from ``random``, which the rollout seeds per trajectory) makes a round's groups
whole at different turns: the round stops once 4 groups are whole and the others' sessions wait,
parked on their unanswered requests, through the weight update. The generator's log-probs of the tokens the current
weights sampled equal the trainer's (``partial/logprob_drift_fresh``, ~1e-6 in fp32), those of the tokens an earlier
version sampled do not (the update moved them): the versions a session's turns carry are the ones that sampled them,
and the tokens trained are the tokens sampled. A step that saves runs every session to its end, so a resumed job
ends as the straight one; with ``--max_staleness 0`` nothing is carried and the job is the synchronous one."""
from __future__ import annotations

import os

import pytest

from ppo_common import TINY_GRPO, ppo_args
from test_agent_programs import chatml_actor  # noqa: F401 (the fixture: a byte-level BPE with a ChatML template)

pytestmark = pytest.mark.timeout(400)

PEERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peers", "openrlhf")
VARIED = '''
import random

import torch

from rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    """1-5 turns, a short tool line after each but the last; then a random 0/1 reward."""

    def __init__(self, *args, **kwargs):
        self.turns, self.turn = random.randint(1, 5), 0

    async def step(self, states, **kwargs):
        self.turn += 1
        if self.turn < self.turns:
            return {"rewards": torch.tensor(0.0), "environment_feedback": " tool: ok", "done": False}
        return {"rewards": torch.tensor(float(random.randint(0, 1))), "environment_feedback": "",
                "done": True}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''
SKIP = ("time/", "tokens_per_s", "mem/", "offload/", "weight_sync/", "weight_version", "agent/env_seconds")

TURNS = '''
async def run_agent(client, prompt, label, model, seed, **kw):
    """1-4 chat turns (by the trajectory's seed), each reply fed back with a user's line after it."""
    msgs = [{"role": "user", "content": prompt}]
    for turn in range(1 + seed % 4):
        r = await client.chat.completions.create(model=model, messages=msgs)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "go on"}]
    return float(len(r.choices[0].message.content) % 2)
'''


def _job(ppo_setup, out, monkeypatch, capsys, *extra, agent=None, actor=None, **kw):
    from helpers import free_port
    from rlhf.observability.metrics import read_metrics_jsonl
    from rlhf.ppo import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    if agent is None:
        agent = out.parent / "varied_env.py"
        agent.write_text(VARIED)
    flags = {**TINY_GRPO, "--rollout_backend": "megatron", "--max_samples": "16", "--agent_func_path": agent,
             "--actor_learning_rate": "1e-3", "--generate_max_len": "2", "--save_steps": "2", "--max_len": "200", **kw}
    setup = {**ppo_setup, "actor": actor} if actor else ppo_setup
    assert main(ppo_args(setup, str(out), **flags) + list(extra)) == 0
    return read_metrics_jsonl(str(out / "metrics.jsonl"), "ppo"), capsys.readouterr().err


def _same(a: dict, b: dict) -> tuple[dict, dict]:
    return tuple({k: v for k, v in x.items() if not k.startswith(SKIP)} for x in (a, b))


def test_parked_sessions_cross_an_update_with_their_versions_and_resume_exactly(ppo_setup, tmp_path, monkeypatch,
                                                                                 capsys):
    """Four steps, a checkpoint after steps 2 and 4: steps 1 and 3 park sessions (``partial/aborted_samples``),
    steps 2 and 4 train tokens one update old and none older, the fresh tokens' drift is the sync's (< 1e-4) and
    every carried token's is the update's (> 1e-5). Stopped after step 2 and resumed, steps 3 and 4 are the straight
    run's, to the last bit."""
    from crash_harness import assert_resumed

    flags = ("--partial_rollout", "--max_staleness", "1", "--partial_rollout_oversample", "0.5")
    straight, log = _job(ppo_setup, tmp_path / "s", monkeypatch, capsys, *flags)
    assert sorted(straight) == [1, 2, 3, 4]
    assert "--partial_rollout with --agent_func_path" not in log
    # the round stopped with sessions of the groups beyond the batch still running: parked
    assert straight[1]["partial/aborted_samples"] + straight[3]["partial/aborted_samples"] > 0, straight
    for s in (2, 4):  # a save follows step 2 and 4: every session ran to its end
        assert straight[s]["partial/aborted_samples"] == 0, straight[s]
    carried = [straight[s] for s in (2, 3, 4) if straight[s]["partial/tokens_age_1"] > 0]
    assert carried, straight
    for m in straight.values():
        assert m["partial/max_token_age"] <= 1 and m["partial/trained_groups"] == 4, m
        assert m["partial/logprob_drift_fresh_max"] < 1e-4, m  # measured: ~1e-6
        assert m["agent/turns"] > 1 and m["agent/failures"] == 0
    for m in carried:  # every carried token moved with the update (measured: >= 3e-3; fresh ones <= 5e-7)
        assert m["partial/logprob_drift_carried_min"] > 1e-5, m
    _job(ppo_setup, tmp_path / "r", monkeypatch, capsys, *flags, "--stop_after_steps", "2")
    resumed, log = _job(ppo_setup, tmp_path / "r", monkeypatch, capsys, *flags, "--load_checkpoint")
    assert_resumed(log, "ppo", step=2)
    for s in (3, 4):
        got, want = _same(resumed[s], straight[s])
        assert got == want, s


def test_max_staleness_0_is_the_synchronous_agent_job(ppo_setup, tmp_path, monkeypatch, capsys):
    """With --max_staleness 0 the partial round runs one batch of new groups to its end: the synchronous agent
    job's samples, rewards and updates, every metric the two share equal; with --dynamic_filtering, whose rounds
    (groups whose trajectories' random rewards all agree are filtered out) are the synchronous step's too."""
    flags = ("--dynamic_filtering", "--dynamic_filtering_max_rounds", "3")
    kw = {"--max_samples": "8"}
    sync, _ = _job(ppo_setup, tmp_path / "sync", monkeypatch, capsys, *flags, **kw)
    part, _ = _job(ppo_setup, tmp_path / "part", monkeypatch, capsys, "--partial_rollout", "--max_staleness", "0",
                   *flags, **kw)
    assert sorted(sync) == sorted(part) == [1, 2]
    assert any(m["dynamic_filtering/pass_rate"] < 1 for m in sync.values()), sync
    # counted otherwise, not computed otherwise: the synchronous filtered step logs the agent/* of its last round,
    # the partial round those of the trained trajectories
    differ = ("agent/",)
    for s in sync:
        a, b = _same(sync[s], part[s])
        a, b = ({k: v for k, v in x.items() if not k.startswith(differ)} for x in (a, b))
        shared = {k: v for k, v in b.items() if k in a}
        assert shared == {k: a[k] for k in shared} and len(shared) > 20, s
        assert part[s]["partial/max_token_age"] == 0 and a["advantages_abs"] > 0


def test_a_run_agent_program_is_carried_through_its_endpoint(ppo_setup, chatml_actor, tmp_path, monkeypatch, capsys):
    """A run_agent program of 1-4 chat turns through the endpoint, its sessions parked across updates: the
    endpoint's calls keep the version of the round that answered them: the fresh tokens' drift stays the sync's and
    every token counted carried moved with the update. A held-out evaluation after every step runs its own sessions
    (through an endpoint of its own) while the carried ones stay parked."""
    prog = tmp_path / "turns.py"
    prog.write_text(TURNS)
    m, _ = _job(ppo_setup, tmp_path / "o", monkeypatch, capsys, "--partial_rollout", "--max_staleness", "1",
                "--partial_rollout_oversample", "0.5", "--eval_dataset", ppo_setup["prompts"], "--eval_steps", "1",
                "--eval_max_samples", "2", agent=str(prog), actor=chatml_actor,
                **{"--max_samples": "12", "--generate_max_len": "3", "--save_steps": "0", "--max_len": "160"})
    assert sorted(m) == [1, 2, 3]
    assert sum(s["partial/aborted_samples"] for s in m.values()) > 0, m
    from rlhf.observability.metrics import read_metrics_jsonl

    evals = read_metrics_jsonl(str(tmp_path / "o" / "metrics.jsonl"), "eval")  # run while sessions were parked
    assert sorted(evals) == [0, 1, 2, 3] and all(e["agent/failures"] == 0 and e["agent/endpoint/calls"] >= 1
                                                 for e in evals.values()), evals
    assert sum(s["partial/tokens_age_1"] for s in m.values()) > 0, m
    for s in m.values():
        assert s["partial/logprob_drift_fresh_max"] < 1e-4 and s["agent/failures"] == 0, s
        assert s["agent/endpoint/calls"] >= 1, s
        # a call the next round answered is fresh there: a carried token that did not move would be one mis-stamped
        assert s.get("partial/logprob_drift_carried_min", 1.0) > 1e-5, s  # measured: >= 5e-3
