"""PrimeIntellect's ``verifiers`` environments (0.3.1, ``verifiers.legacy``) as run_agent programs
(rlhf.agents.verifiers_env): verifiers' own ``ToolEnv``, ``SingleTurnEnv`` and ``MultiTurnEnv`` driving the rank's
OpenAI-compatible endpoint through verifiers' own OpenAI client; first against a scripted generator (a tool call
parsed, run and answered, the sampled ids fed back verbatim, the rubric's reward returned), then in a PPO job
(``load_environment`` of two environment modules, one single-turn and one multi-turn)."""
from __future__ import annotations

import pytest

from test_agent_endpoint import ScriptedGen, bytewise, serve, tok  # noqa: F401 (a fixture)
from test_agent_programs import _job, make_chatml_actor

pytestmark = pytest.mark.timeout(300)

ENVS = '''
import verifiers.legacy as vf
from datasets import Dataset


def text(completion):
    m = completion[-1]
    return (getattr(m, "content", None) if not isinstance(m, dict) else m.get("content")) or ""


def answered(completion, answer, **kw):
    """1 when the last reply contains the answer."""
    return float(bool(answer) and answer in text(completion))


def parity(completion, **kw):
    """The last reply's length, odd or even: a reward a random model gets half the time."""
    return float(len(text(completion)) % 2)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class Echo(vf.MultiTurnEnv):
    """Every reply is answered by a user line, for max_turns turns."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "again: apple banana"}]


class Broken(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        raise vf.ToolError("the environment broke")


DATA = Dataset.from_list([{"question": "unused", "answer": "5"}])


def load_environment(kind="tool", **kw):
    if kind == "tool":
        return vf.ToolEnv(dataset=DATA, tools=[add], max_turns=3, rubric=vf.Rubric(funcs=[answered]),
                          system_prompt="You add.")
    if kind == "single":
        return vf.SingleTurnEnv(dataset=DATA, rubric=vf.Rubric(funcs=[parity]), system_prompt="Say a word.")
    if kind == "broken":
        return Broken(dataset=DATA, max_turns=3, rubric=vf.Rubric(funcs=[parity]))
    return Echo(dataset=DATA, max_turns=3, rubric=vf.Rubric(funcs=[parity]))
'''

AGENT = '''
from rlhf.agents.verifiers_env import environment_agent

ENVS = [environment_agent("vf_envs", kind=k) for k in ("single", "echo", "tool")]


async def run_agent(client, prompt, label, model, index, **kw):
    """Trajectory i in the single-turn, the multi-turn or the tool environment, by i % 3."""
    return await ENVS[index % 3](client, prompt, label, model=model, index=index, **kw)
'''


@pytest.fixture(scope="module")
def long_actor(tmp_path_factory):
    """The ChatML tiny actor of test_agent_programs with room for the tool environment's prompt (658 tokens)."""
    return make_chatml_actor(tmp_path_factory.mktemp("long_actor"), 5, max_position_embeddings=1024)


@pytest.fixture
def envs(tmp_path, monkeypatch):
    (tmp_path / "vf_envs.py").write_text(ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    importlib.invalidate_caches()
    return importlib.import_module("vf_envs")


@pytest.mark.parametrize("answer,reward", [(" it is 5", 1.0), (" it is 6", 0.0)])
def test_a_verifiers_tool_env_drives_the_endpoint(envs, tok, answer, reward):
    """verifiers' ToolEnv: its tool in OpenAI's format reaches the template, the model's call is parsed and run by
    the environment, the second request is fed the first one's prompt and sampled ids verbatim, then the tool's
    result; the rubric's reward and metrics come back as the trajectory's."""
    from rlhf.agents.verifiers_env import environment_agent

    call = ' <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    r1, r2 = bytewise(tok, call) + [tok.eos_token_id], bytewise(tok, answer) + [tok.eos_token_id]
    gen = ScriptedGen([(r1, True), (r2, True)])
    agent = environment_agent(envs.load_environment("tool"))

    async def go(client, ep, sid):
        return await agent(client, "add 2 and 3", "5", model="m", index=0)

    st, out = serve(tok, gen, go)
    assert out["reward"] == reward and out["scores"] == reward, out
    assert out["extra_logs"]["answered"] == reward and out["extra_logs"]["add_calls"] == 1.0, out
    p1, p2 = gen.fed[0]["ids"], gen.fed[1]["ids"]
    assert tok.decode(p1).startswith("<|im_start|>system\nYou add.") and '"name": "add"' in tok.decode(p1)
    assert p2[:len(p1) + len(r1)] == p1 + r1
    assert tok.decode(p2[len(p1) + len(r1):]).startswith("\n<|im_start|>tool\n<tool_response>\n5\n")
    t = st.session.trajectory()
    assert t["observation_tokens"] == p2 + r2
    assert t["endpoint"]["continued"] == 1.0 and t["endpoint"]["new_segments"] == 0.0, t["endpoint"]


def test_a_rollout_verifiers_ended_in_error_fails(envs, tok):
    """An environment whose step raises: verifiers records the error in the rollout (and its rubric still scores
    it); the program raises, so the trajectory fails with reward 0 and its reason, never a scored success."""
    from rlhf.agents.verifiers_env import environment_agent

    gen = ScriptedGen([(bytewise(tok, " hi") + [tok.eos_token_id], True)])
    agent = environment_agent(envs.load_environment("broken"))

    async def go(client, ep, sid):
        return await agent(client, "say hi", None, model="m", index=0)

    with pytest.raises(RuntimeError, match="verifiers rollout failed: .*the environment broke"):
        serve(tok, gen, go)


def test_verifiers_environments_in_a_ppo_job(envs, ppo_setup, long_actor, tmp_path, monkeypatch, capsys):
    """Three environments loaded by verifiers' load_environment in one job: the single-turn one (1 call), the
    multi-turn one (3 calls, a user line after each reply) and the tool one (its tool in the prompt; a random model
    calls none, so 1 call): 8 trajectories, 3 + 3 x 3 + 2 calls. Every call is continued token for token and the
    generator's log-probs equal the trainer's; the rubric's metric is logged."""
    agent = tmp_path / "vf_agent.py"
    agent.write_text(AGENT)
    m, log = _job(ppo_setup, long_actor, tmp_path / "o", monkeypatch, capsys, agent, "--stop_after_steps", "1",
                  **{"--max_len": "1024"})
    assert "(run_agent, through the rank's OpenAI-compatible endpoint)" in log, log[-2000:]
    s = m[1]
    assert s["agent/turns"] == 1.75 and s["agent/endpoint/calls"] == 1.75 and s["agent/failures"] == 0.0, s
    assert s["agent/endpoint/untrained_share"] == 0.0 and s["agent/endpoint/new_segments"] == 0.0, s
    assert s["rollout_logprob_drift_max"] < 1e-4, s
    assert "reward_extra/parity" in s and 0.0 <= s["reward"] <= 1.0, s
