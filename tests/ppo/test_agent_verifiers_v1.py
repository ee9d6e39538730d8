"""PrimeIntellect's verifiers 0.4.0, its current release (``verifiers.v1``), as run_agent programs
(rlhf.agents.verifiers_v1): tasksets loaded by its ``load_environment(EnvConfig)``, played by its ``null`` chat
harness (its PEP 723 program run with the job's interpreter) through its interception server and ``EvalClient``
against the rank's endpoint. First against a scripted generator (a tool of an MCP ``Toolset`` rendered, called,
run by verifiers and answered, the sampled ids fed back verbatim, the task's reward returned), then in a PPO job."""
from __future__ import annotations

import asyncio
import os
import sys

import pytest

from helpers import alive, descendants
from test_agent_endpoint import ScriptedGen, bytewise, serve, tok  # noqa: F401 (a fixture)
from test_agent_programs import _job
from test_agent_verifiers import long_actor  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(300)

TASKS = '''
import verifiers.v1 as vf
from verifiers.v1.types import content_text


class QA(vf.TaskData):
    answer: str = ""


def last(trace):
    return content_text(trace.messages[-1].content) if trace.messages else ""


class QATask(vf.Task[QA, vf.State, vf.TaskConfig]):
    @vf.reward
    async def answered(self, trace) -> float:
        """1 when the last reply contains the answer."""
        return float(bool(self.data.answer) and self.data.answer in last(trace))

    @vf.metric
    async def odd(self, trace) -> float:
        """The last reply's length, odd or even."""
        return float(len(last(trace)) % 2)


class QATaskset(vf.Taskset[QATask, vf.TasksetConfig]):
    def load(self):
        yield QATask(QA(prompt="unused", answer="5"))


class ToolTask(QATask):
    @classmethod
    def toolsets(cls, config):
        from vf1_calc import Calc

        return [Calc(vf.ToolsetConfig())]


class ToolTaskset(vf.Taskset[ToolTask, vf.TasksetConfig]):
    def load(self):
        yield ToolTask(QA(prompt="unused", answer="5"))


class BrokenTask(QATask):
    @vf.reward
    async def answered(self, trace) -> float:
        raise RuntimeError("the grader broke")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        yield BrokenTask(QA(prompt="unused"))
'''

CALC = '''
import verifiers.v1 as vf


class Calc(vf.Toolset[vf.ToolsetConfig, vf.State]):
    TOOL_PREFIX = None

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


if __name__ == "__main__":
    Calc.run()
'''

PACKAGES = {"vf1_qa": "QATaskset", "vf1_tools": "ToolTaskset", "vf1_broken": "BrokenTaskset"}

AGENT = '''
from rlhf.agents.verifiers_v1 import episode_agent

ENVS = [episode_agent("vf1_qa"), episode_agent("vf1_tools")]


async def run_agent(client, prompt, label, model, index, **kw):
    """Trajectory i in the single-turn or the tool taskset, by i % 2."""
    return await ENVS[index % 2](client, prompt, label, model=model, index=index, **kw)
'''


@pytest.fixture(scope="module")
def tasksets(tmp_path_factory):
    """The tasksets as verifiers' loaders import them (packages exporting their Taskset via ``__all__``), on the
    path the episode worker inherits; the worker is ended at the module's end."""
    from rlhf.agents.verifiers_v1 import close_worker

    where = tmp_path_factory.mktemp("vf1")
    (where / "vf1_tasks.py").write_text(TASKS)
    (where / "vf1_calc.py").write_text(CALC)
    for pkg, cls in PACKAGES.items():
        (where / pkg).mkdir()
        (where / pkg / "__init__.py").write_text(f"from vf1_tasks import {cls}\n__all__ = [{cls!r}]\n")
    sys.path.insert(0, str(where))
    yield where
    close_worker()
    sys.path.remove(str(where))


def _workers() -> list[int]:
    """Live episode workers of this machine."""
    found = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and b"rlhf.agents.verifiers_v1_worker" in open(f"/proc/{p}/cmdline", "rb").read():
                found.append(int(p))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("answer,reward", [(" it is 5", 1.0), (" it is 6", 0.0)])
def test_a_verifiers_v1_tool_taskset_drives_the_endpoint(tasksets, tok, answer, reward):
    """verifiers 0.4.0's null harness with an MCP Toolset: its tool in OpenAI's format reaches the template, the
    model's call is parsed and run by verifiers' tool server, the second request is fed the first one's prompt and
    sampled ids verbatim, then the tool's result; the task's reward and metric come back as the trajectory's, and
    the job's sampling reaches the generator."""
    from rlhf.agents.verifiers_v1 import episode_agent

    call = ' <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    r1, r2 = bytewise(tok, call) + [tok.eos_token_id], bytewise(tok, answer) + [tok.eos_token_id]
    gen = ScriptedGen([(r1, True), (r2, True)])
    agent = episode_agent("vf1_tools")

    async def go(client, ep, sid):
        return await agent(client, "add 2 and 3", "5", model="m", base_url=ep.url(sid), index=0, max_tokens=100)

    st, out = serve(tok, gen, go)
    assert out["reward"] == reward and out["scores"] == reward, out
    assert out["extra_logs"] == {"odd": float(len(answer) % 2)}, out
    p1, p2 = gen.fed[0]["ids"], gen.fed[1]["ids"]
    assert '"name": "add"' in tok.decode(p1) and tok.decode(p1).endswith("add 2 and 3<|im_end|>\n<|im_start|>assistant\n")
    assert p2[:len(p1) + len(r1)] == p1 + r1
    assert tok.decode(p2[len(p1) + len(r1):]).startswith("\n<|im_start|>tool\n<tool_response>\n5\n")
    assert gen.fed[0]["params"][2] == 100, gen.fed[0]["params"]
    t = st.session.trajectory()
    assert t["observation_tokens"] == p2 + r2
    assert t["endpoint"]["continued"] == 1.0 and t["endpoint"]["new_segments"] == 0.0, t["endpoint"]


def test_a_failing_v1_episode_fails_and_code_harnesses_are_refused(tasksets, tok):
    """A task whose reward raises: verifiers records the error on its trace; the program raises, so the trajectory
    fails with reward 0 and its reason, never a scored success. A harness that runs the model's commands (bash) is
    refused by name."""
    from rlhf.agents import verifiers_v1

    gen = ScriptedGen([(bytewise(tok, " hi") + [tok.eos_token_id], True)])
    agent = verifiers_v1.episode_agent("vf1_broken")

    async def go(client, ep, sid):
        return await agent(client, "say hi", None, model="m", base_url=ep.url(sid), index=0)

    with pytest.raises(RuntimeError, match="verifiers episode failed: .*the grader broke"):
        serve(tok, gen, go)
    bash = verifiers_v1.episode_agent("vf1_qa", harness="bash")

    async def go_bash(client, ep, sid):
        return await bash(client, "say hi", None, model="m", base_url=ep.url(sid), index=0)

    with pytest.raises(RuntimeError, match="harness 'bash' runs the model's commands, and its local runtime is the "
                                           "host: not carried"):
        serve(tok, ScriptedGen([]), go_bash)


class HangingGen(ScriptedGen):
    """A generator that takes every request and answers (an EOS) only when released."""

    def __init__(self):
        super().__init__([])
        self.released = asyncio.Event()

    async def submit(self, j, turn, ids, params):
        self.fed.append({"ids": list(ids), "params": params, "j": j, "turn": turn})
        await self.released.wait()
        return [0], [-0.1], True, 0


def test_closing_the_worker_mid_episode_ends_its_programs(tasksets, tok):
    """The worker closed while an episode waits on the model: the worker and every process it started (the harness
    program and the tool server, each in a session of its own) are gone, and the waiting session fails by name."""
    from rlhf.agents import verifiers_v1

    gen = HangingGen()
    agent = verifiers_v1.episode_agent("vf1_tools")

    async def go(client, ep, sid):
        try:
            await closed_mid_episode(client, ep, sid)
        finally:
            gen.released.set()  # the endpoint's session ends, so the endpoint stops at once

    async def closed_mid_episode(client, ep, sid):
        t = asyncio.ensure_future(agent(client, "add 2 and 3", "5", model="m", base_url=ep.url(sid), index=0))
        for _ in range(600):
            if gen.fed:
                break
            await asyncio.sleep(0.1)
        w = verifiers_v1.worker()
        started = set(descendants(w.proc.pid))
        cmdlines = [open(f"/proc/{p}/cmdline", "rb").read() for p in alive(started)]
        assert any(b"vf1_calc" in c for c in cmdlines) and len(cmdlines) >= 2, cmdlines
        await asyncio.to_thread(verifiers_v1.close_worker)
        assert alive(started | {w.proc.pid}) == []
        with pytest.raises(RuntimeError, match="the verifiers worker exited"):
            await t

    serve(tok, gen, go)


def test_harness_scripts_run_with_the_jobs_packages(caplog, tmp_path):
    """A PEP 723 script's dependencies are read from its block and checked against the job's environment: one the
    job lacks fails by name; one at another version is logged once. The script is published once at its
    content's path and never rewritten (a running episode reads it meanwhile), no temporary file left."""
    from rlhf.agents.verifiers_v1_worker import check_requirements, publish_script, script_requirements

    path = publish_script(str(tmp_path / "scripts"), b"print(1)\n")
    first = os.stat(path)
    os.utime(path, ns=(first.st_atime_ns, first.st_mtime_ns - 10**9))
    assert publish_script(str(tmp_path / "scripts"), b"print(1)\n") == path
    assert os.stat(path).st_mtime_ns == first.st_mtime_ns - 10**9 and os.listdir(tmp_path / "scripts") == [
        os.path.basename(path)]

    script = '# /// script\n# requires-python = ">=3.10"\n# dependencies = ["openai", "mcp==0.0.1"]\n# ///\nprint(1)\n'
    assert script_requirements(script) == ["openai", "mcp==0.0.1"]
    with caplog.at_level("WARNING", logger="rlhf.agents.verifiers_v1"):
        check_requirements(["openai", "mcp==0.0.1"])
        check_requirements(["mcp==0.0.1"])
    assert [r.getMessage() for r in caplog.records].count(
        "verifiers harness script asks for mcp==0.0.1; it runs with the job's mcp "
        f"{__import__('importlib.metadata').metadata.version('mcp')}") == 1, caplog.text
    with pytest.raises(RuntimeError, match="needs 'no-such-package-rlhf>=1', which the job's environment lacks"):
        check_requirements(["no-such-package-rlhf>=1"])


def test_verifiers_v1_tasksets_in_a_ppo_job(tasksets, ppo_setup, long_actor, tmp_path, monkeypatch, capsys):
    """Two tasksets loaded by verifiers 0.4.0's load_environment in one job: the single-turn one (1 call) and the
    tool one (its tool in the prompt; a random model calls none, so 1 call). Every call is trained on its sampled
    tokens and the generator's log-probs equal the trainer's; the task's metric is logged; the worker ends with the
    job."""
    agent = tmp_path / "vf1_agent.py"
    agent.write_text(AGENT)
    m, log = _job(ppo_setup, long_actor, tmp_path / "o", monkeypatch, capsys, agent, "--stop_after_steps", "1",
                  **{"--max_len": "1024"})
    s = m[1]
    assert s["agent/turns"] == 1.0 and s["agent/endpoint/calls"] == 1.0 and s["agent/failures"] == 0.0, s
    assert s["agent/endpoint/untrained_share"] == 0.0 and s["agent/endpoint/new_segments"] == 0.0, s
    assert s["rollout_logprob_drift_max"] < 1e-4, s
    assert "reward_extra/odd" in s and 0.0 <= s["reward"] <= 1.0, s
    assert "verifiers 0.4.0 worker started" in log and not _workers(), "the job's end should end the worker"
