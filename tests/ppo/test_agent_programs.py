"""Agents as plain programs (``run_agent`` files, rlhf.agents.program) and OpenRLHF's OpenAI-server executor in PPO
jobs: launch/ppo.py's body in this process, one rank, the megatron generator, 4 prompts x 2 trajectories a step.

The actor's tokenizer is a byte-level BPE with merges and a ChatML template that trims each message (the tokenizer
of tests/ppo/test_agent_endpoint.py): a random model's replies almost never come back as the same ids when a client's
conversation is rendered and encoded again. The trainer's log-probs of the trained tokens equal the generator's (the
drift check) only when the trained tokens are the sampled ones; the control stitches sessions as OpenRLHF's example
does (re-encoded, prefix assumed) and the same check fails."""
from __future__ import annotations

import json
import os

import pytest

from ppo_common import DIMS, TINY_GRPO, ppo_args

pytestmark = pytest.mark.timeout(300)

PEERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peers", "openrlhf")

TALK = '''
async def run_agent(client, prompt, label, model, **kw):
    """Three turns: the model's reply, then a user's line, as a chat client keeps its history."""
    msgs = [{"role": "user", "content": prompt}]
    for turn in range(3):
        r = await client.chat.completions.create(model=model, messages=msgs, logprobs=True)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        msgs.append({"role": "user", "content": "tool: apple banana"})
    return float(len(r.choices[0].message.content) % 2)
'''

FAILING = '''
import asyncio
import json
import time

LOG = %r


async def run_agent(client, prompt, label, model, index, **kw):
    """By the prompt's first word: raise, hang, run past --max_len, return no number; else one turn."""
    with open(LOG, "a") as f:
        f.write(json.dumps({"start": index, "t": time.monotonic()}) + "\\n")
    try:
        word = prompt.split()[1]
        msgs = [{"role": "user", "content": prompt}]
        r = await client.chat.completions.create(model=model, messages=msgs)
        if word == "apple":
            raise RuntimeError("the tool crashed")
        if word == "banana":
            await asyncio.sleep(3600)
        if word == "cherry":
            for _ in range(40):
                msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": prompt}]
                r = await client.chat.completions.create(model=model, messages=msgs)
        return "high" if word == "delta" else 1.0
    finally:
        with open(LOG, "a") as f:
            f.write(json.dumps({"end": index, "t": time.monotonic()}) + "\\n")
'''


def make_chatml_actor(work, seed: int, **overrides) -> str:
    """A tiny Llama (DIMS) with the ChatML tokenizer of test_agent_endpoint, saved under ``work``."""
    from test_agent_endpoint import chatml_tokenizer

    from rlhf.models.tiny import make_tiny_hf

    chatml_tokenizer(work / "tok")
    return make_tiny_hf(str(work / "actor"), "llama", seed=seed, tokenizer_dir=str(work / "tok"),
                        **{**DIMS, **overrides})


@pytest.fixture(scope="module")
def chatml_actor(tmp_path_factory):
    return make_chatml_actor(tmp_path_factory.mktemp("chatml_actor"), 4)


def _job(ppo_setup, actor, out, monkeypatch, capsys, agent, *extra, code=0, **kw):
    from helpers import free_port
    from rlhf.observability.metrics import read_metrics_jsonl
    from rlhf.ppo import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    flags = {**TINY_GRPO, "--rollout_backend": "megatron", "--max_samples": "8", "--agent_func_path": str(agent),
             "--actor_learning_rate": "1e-3", "--pretrain": actor, "--max_len": "200", "--generate_max_len": "6", **kw}
    assert main(ppo_args(ppo_setup, str(out), **flags) + list(extra)) == code
    log = capsys.readouterr().err
    return (read_metrics_jsonl(str(out / "metrics.jsonl"), "ppo") if code == 0 else None), log


def naive_trajectory(self):
    """The control's stitching (OpenRLHF's example without its assert): the last call's prompt as the client's
    conversation re-encoded, each call's action assumed where its own prompt ended."""
    calls = self.calls
    last = calls[-1]
    obs = last.prompt_ids + last.completion_ids
    lps, ranges = [0.0] * len(obs), []
    for c in calls:
        a, b = len(c.prompt_ids), min(len(c.prompt_ids) + len(c.completion_ids), len(obs))
        ranges.append((a, b))
        lps[a:b] = c.logprobs[: b - a]
    return {"observation_tokens": obs, "action_ranges": ranges, "rollout_log_probs": lps, "versions": None,
            "prompt_length": len(calls[0].prompt_ids), "turns": len(calls), "last_finished": last.finished,
            "endpoint": self.stats(len(calls))}


def test_a_run_agent_chat_trains_the_sampled_tokens(ppo_setup, chatml_actor, tmp_path, monkeypatch, capsys):
    """A three-turn chat program through the endpoint: every turn is continued token for token (no new segment,
    every call trained), naive re-encoding would have differed in most of them, and the generator's log-probs equal
    the trainer's on every trained token (fp32). The control re-encodes each request's conversation and stitches
    as OpenRLHF's example: the same check fails, 7,000 times over."""
    agent = tmp_path / "talk.py"
    agent.write_text(TALK)
    m, log = _job(ppo_setup, chatml_actor, tmp_path / "o", monkeypatch, capsys, agent)
    assert "(run_agent, through the rank's OpenAI-compatible endpoint)" in log, log[-2000:]
    assert sorted(m) == [1, 2]
    for s in m.values():
        assert s["agent/turns"] == 3.0 and s["agent/endpoint/calls"] == 3.0 and s["agent/failures"] == 0.0, s
        assert s["agent/endpoint/untrained_share"] == 0.0 and s["agent/endpoint/new_segments"] == 0.0, s
        assert s["agent/endpoint/retokenize_differs_share"] > 0.5, s
        assert s["rollout_logprob_drift_max"] < 1e-4, s
        assert 0.0 < s["agent/env_tokens_share"] < 1.0 and 0.0 <= s["reward"] <= 1.0, s
    from rlhf.agents import tokens

    def naive_prompt(self, messages, tools):
        ids, parent = real(self, messages, tools)
        return self.fmt.encode(self.fmt.render(messages, tools, True)), parent

    real = tokens.Session.chat_prompt
    monkeypatch.setattr(tokens.Session, "chat_prompt", naive_prompt)
    monkeypatch.setattr(tokens.Session, "trajectory", naive_trajectory)
    bad, _ = _job(ppo_setup, chatml_actor, tmp_path / "control", monkeypatch, capsys, agent, "--stop_after_steps", "1")
    assert bad[1]["rollout_logprob_drift_max"] > 0.1, bad  # measured: 0.72 (a near-uniform random model)


def test_openrlhfs_openai_server_executor_runs_with_its_import_changed(ppo_setup, chatml_actor, tmp_path,
                                                                       monkeypatch, capsys):
    """OpenRLHF's examples/python/agent_func_openai_server_executor.py (its import line changed): its own FastAPI
    server in a thread of its own calls the rollout's llm_engine from there, its AsyncOpenAI client lives across
    steps, and its one-turn sessions are scored by --reward_fn; the generator's log-probs equal the trainer's."""
    m, log = _job(ppo_setup, chatml_actor, tmp_path / "o", monkeypatch, capsys,
                  os.path.join(PEERS, "agent_func_openai_server_executor.py"),
                  **{"--reward_fn": "_rule_reward:length_reward"})
    assert "OpenAI-compatible server ready at http://127.0.0.1:" in log, log[-2000:]
    assert sorted(m) == [1, 2]
    for s in m.values():
        assert s["agent/turns"] == 1.0 and s["agent/failures"] == 0.0 and s["agent/env_tokens_share"] == 0.0, s
        assert s["rollout_logprob_drift_max"] < 1e-4 and s["advantages_abs"] > 0, s


def test_programs_that_raise_hang_or_overrun_get_reward_0_and_a_reason(ppo_setup, chatml_actor, tmp_path,
                                                                       monkeypatch, capsys):
    """Prompts by their first word: raise (raised), sleep an hour (timeout after --agent_timeout_s 5; with 1 s a
    loaded machine counted a malformed one as a timeout too), run past --max_len (budget), return text (malformed).
    Each failed trajectory has reward 0 and its reason counted; the step does not wait for the hanging one; at most
    --agent_max_sessions 2 run at once."""
    prompts = tmp_path / "prompts.jsonl"
    words = ["apple", "banana", "cherry", "delta"]
    prompts.write_text("".join(json.dumps({"prompt": f"say: {w} kilo"}) + "\n" for w in words))
    log_file = tmp_path / "sessions.jsonl"
    agent = tmp_path / "failing.py"
    agent.write_text(FAILING % str(log_file))
    m, log = _job(ppo_setup, chatml_actor, tmp_path / "o", monkeypatch, capsys, agent, "--stop_after_steps", "1",
                  **{"--prompt_data": str(prompts), "--max_agent_failures": "8", "--agent_timeout_s": "5",
                     "--agent_max_sessions": "2", "--rollout_batch_size": "4", "--n_samples_per_prompt": "2"})
    s = m[1]
    got = {k: s.get(f"agent/failures/{k}", 0.0) for k in ("raised", "timeout", "budget", "malformed")}
    assert got == {"raised": 2.0, "timeout": 2.0, "budget": 2.0, "malformed": 2.0}, s
    assert s["agent/failures"] == 8.0 and s["reward"] == 0.0, s
    assert "agent: 8 of 8 trajectories failed (reward 0)" in log, log[-2000:]
    events = [json.loads(x) for x in log_file.read_text().splitlines()]
    live, most = 0, 0
    for e in sorted(events, key=lambda e: e["t"]):
        live += 1 if "start" in e else -1
        most = max(most, live)
    assert most <= 2, events


SCORED = '''
async def run_agent(client, prompt, label, model, index, **kw):
    """One turn; the reward is the same for all, the score (what dynamic filtering reads) the index's parity."""
    await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}])
    return {"reward": 0.5, "scores": float(index % 2), "extra_logs": {"seen": 1.0 + index % 2}}
'''


def test_dynamic_filtering_reads_a_programs_scores(ppo_setup, chatml_actor, tmp_path, monkeypatch, capsys):
    """A program's dict result: ``scores`` drive --dynamic_filtering (every group's two scores differ, so every
    group passes in one round; its rewards, all 0.5, would have passed none), ``extra_logs`` are logged."""
    agent = tmp_path / "scored.py"
    agent.write_text(SCORED)
    m, _ = _job(ppo_setup, chatml_actor, tmp_path / "o", monkeypatch, capsys, agent, "--dynamic_filtering",
                "--stop_after_steps", "1", **{"--dynamic_filtering_max_rounds": "2"})
    s = m[1]
    assert s["dynamic_filtering/pass_rate"] == 1.0 and s["dynamic_filtering/rounds"] == 1.0, s
    assert s["reward"] == 0.5 and s["reward_extra/seen"] == 1.5, s


def test_the_calculator_program_feeds_calc_agents_conversation(tmp_path):
    """rlhf/demo/calc_program.py (the calculator as a run_agent program) against the endpoint, the model scripted:
    two tool calls, then a third reply that calls again and is graded (MAX_CALLS reached), as calc_agent.py ends a
    trajectory. Each request is fed what calc_agent's executor feeds: calc_task's conversation rendered by the
    template, then each reply's sampled ids and calc_agent's ChatML feedback line."""
    from test_agent_endpoint import ScriptedGen, bytewise, chatml_tokenizer, serve

    from rlhf.demo import calc_program
    from rlhf.demo.calc_agent import AgentInstance
    from rlhf.demo.calc_task import chat_prompt

    tok = chatml_tokenizer(tmp_path / "tok")
    record = {"prompt": chat_prompt(23, 45), "answer": "1035"}
    (mine,) = calc_program.program_records([record])
    call = bytewise(tok, "<calc>23*45</calc>") + [tok.eos_token_id]
    last = bytewise(tok, "<calc>23*45</calc> so 1035") + [tok.eos_token_id]
    gen = ScriptedGen([(call, True), (call, True), (last, True)])

    async def agent(client, ep, sid):
        return await calc_program.run_agent(client, mine["prompt"], mine["answer"], model="m")

    _, out = serve(tok, gen, agent, max_len=4096)
    assert out == {"reward": 1.0, "scores": 1.0,
                   "extra_logs": {"tool_calls": 2.0, "used_tool": 1.0, "correct": 1.0}}, out
    enc = lambda s: tok(text=s, add_special_tokens=False)["input_ids"]  # noqa: E731
    start = enc(tok.apply_chat_template(record["prompt"], tokenize=False, add_generation_prompt=True))
    executor_side = AgentInstance()
    executor_side.chatml = True
    feedback = enc(executor_side._user("Calculator: 1035"))
    assert [f["ids"] for f in gen.fed] == [start, start + call + feedback, start + call + feedback + call + feedback]


SORTED = '''
async def run_agent(client, prompt, label, model, index, **kw):
    """A "keep" prompt: two turns, scores by the index's parity (its group passes); a "drop" one: one turn, score 0."""
    keep = prompt.split()[1] == "keep"
    msgs = [{"role": "user", "content": prompt}]
    for _ in range(2 if keep else 1):
        r = await client.chat.completions.create(model=model, messages=msgs)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "go"}]
    return {"reward": 0.5, "scores": float(index % 2) if keep else 0.0}
'''


def test_dynamic_filtering_logs_the_trained_trajectories_agent_metrics(ppo_setup, chatml_actor, tmp_path,
                                                                      monkeypatch, capsys):
    """Two rounds of dynamic filtering over 4 "keep" and 4 "drop" prompts (shuffled: the first round holds some of
    each): the batch trained is the 4 "keep" groups, whose trajectories took 2 turns each, so agent/* says 2 turns;
    the last round's trajectories alone (the rest of the prompts, some of them "drop") took fewer."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say: {w} kilo {i}"}) + "\n"
                               for i, w in enumerate(["keep", "drop"] * 4)))
    agent = tmp_path / "sorted.py"
    agent.write_text(SORTED)
    m, _ = _job(ppo_setup, chatml_actor, tmp_path / "o", monkeypatch, capsys, agent, "--dynamic_filtering",
                "--stop_after_steps", "1", **{"--dynamic_filtering_max_rounds": "2", "--prompt_data": str(prompts),
                                              "--rollout_batch_size": "4", "--n_samples_per_prompt": "2"})
    s = m[1]
    assert s["dynamic_filtering/rounds"] == 2.0 and s["dynamic_filtering/pass_rate"] == 0.5, s  # some of each
    assert s["agent/turns"] == 2.0 and s["agent/endpoint/calls"] == 2.0, s
