"""The bundled software-engineering tasks (rlhf/demo/swe_task.py), our agent program (rlhf/demo/swe_program.py) and
mini-swe-agent run unchanged (rlhf/demo/swe_mini.py): every command in rlhf.sandbox, the reward from hidden tests; a
scripted model fixing a bug through the endpoint's tool calls, with each agent; both agents in a PPO job (the tiny
model fixes nothing; the sandbox's seconds are logged)."""
from __future__ import annotations

import json
import os

import pytest

from helpers import require

pytestmark = pytest.mark.timeout(300)

FIXES = {"slug": ("textutil.py", "def slugify(s):\n    return '-'.join(s.lower().split())\n"),
         "mean": ("stats.py", "def mean(xs):\n    return sum(xs) / len(xs) if xs else 0.0\n"),
         "chunks": ("seqs.py", "def chunks(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]\n"),
         "palin": ("words.py", "def is_palindrome(s):\n    t = s.replace(' ', '').lower()\n    return t == t[::-1]\n"),
         "kv": ("config.py", "def parse_kv(s):\n    return dict((k.strip(), v.strip()) for k, v in "
                             "(p.split('=') for p in s.split(';') if p))\n"),
         "clamp": ("mathx.py", "def clamp(x, lo, hi):\n    return min(hi, max(lo, x))\n")}
"""The fixes, written here apart from the tasks: each makes its task's hidden tests pass."""
PARTIAL = "def clamp(x, lo, hi):\n    return min(hi, x)\n"
"""clamp's visible test passes (5 -> 3), a hidden one fails (-1 -> -1, not 0)"""


@pytest.fixture(scope="module", autouse=True)
def sandbox_here():
    """Skip where the sandbox's layers are missing (a developer's machine), fail under CI=true."""
    from rlhf.sandbox.core import probe

    missing = {k: v for k, v in probe().items() if v}
    if missing:
        msg = "sandbox layers missing: " + "; ".join(f"{k}: {v}" for k, v in missing.items())
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {msg} (tools/setup_env.sh installs bubblewrap)", pytrace=False)
        pytest.skip(msg)


def test_every_bug_fails_its_tests_and_the_fix_passes_the_hidden_ones():
    """In one sandbox batch: each task's visible test fails on the bug; the hidden tests fail on the bug and pass on
    the fix written here (the reward's reference)."""
    from rlhf.demo.swe_task import RUN_TESTS, TASKS
    from rlhf.sandbox.core import Run, SandboxConfig, run_batch

    runs = []
    for t in TASKS:
        name, fixed = FIXES[t.id]
        hidden = RUN_TESTS.format(module="hidden_tests", tag="")
        runs += [Run(RUN_TESTS.format(module=t.test, tag=""), files=t.files),
                 Run(hidden, files={**t.files, "hidden_tests.py": t.hidden}),
                 Run(hidden, files={**t.files, name: fixed, "hidden_tests.py": t.hidden})]
    out = run_batch(runs, SandboxConfig(timeout_s=20, memory_mb=256))
    for k, t in enumerate(TASKS):
        visible, hidden_bug, hidden_fix = out[3 * k: 3 * k + 3]
        assert visible.exit_code == 1 and "FAIL" in visible.stdout, (t.id, visible)
        assert hidden_bug.exit_code == 1 and hidden_fix.exit_code == 0, (t.id, hidden_bug, hidden_fix)


def test_the_repository_lives_on_the_host_and_runs_in_the_sandbox():
    """read, run the tests, a shell command whose file edits come back, the hidden grade: each command a sandbox
    run (counted) as the sandbox's uid, without the host's folders. A written file is what the next command runs; a
    fix that passes the visible test but not the hidden ones, or a module that ends the grader with status 0 before
    any test ran, is graded a fail; a test module that does not import shows its error to the model."""
    from rlhf.demo.swe_task import BY_ID, SweRepo

    repo = SweRepo(BY_ID["clamp"])
    assert repo.read_file("mathx.py") == BY_ID["clamp"].files["mathx.py"]
    assert not repo.hidden_pass()
    out, code = repo.shell("sed -i 's/max(lo, x)/min(hi, max(lo, x))/' mathx.py && id -u && ls /")
    assert code == 0 and "65534" in out and "home" not in out.split(), out
    assert "min(hi" in repo.files["mathx.py"] and repo.run_tests().endswith("1 passed, 0 failed\n")
    assert repo.hidden_pass() and repo.commands == 5 and repo.sandbox_s > 0
    assert "cannot write" in repo.write_file("../x.py", "")
    assert repo.write_file("n.py", "x") == "wrote 1 characters to n.py"
    repo.write_file("mathx.py", PARTIAL)
    assert repo.run_tests().endswith("1 passed, 0 failed\n") and not repo.hidden_pass()
    repo.write_file("mathx.py", "import os\nos._exit(0)\n")
    assert not repo.hidden_pass()
    repo.write_file("mathx.py", "def clamp(x, lo, hi:\n")
    assert "SyntaxError" in repo.run_tests()


def test_a_scripted_model_fixes_a_bug_through_the_tools(tmp_path):
    """The program against the endpoint, the model scripted: read the file, write the fix, run the tests, answer;
    reward 1 from the hidden tests. The same with a fix that passes the visible test only: reward 0."""
    from test_agent_endpoint import ScriptedGen, chatml_tokenizer, serve

    from rlhf.demo import swe_program

    tok = chatml_tokenizer(tmp_path / "tok")
    ids = lambda s: tok(text=s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # noqa: E731

    def call(name, **args):
        return ids("<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>")

    def episode(fix):
        gen = ScriptedGen([(call("read_file", path="mathx.py"), True), (call("write_file", path="mathx.py",
                                                                                 content=fix), True),
                           (call("run_tests"), True), (ids("done"), True)])

        async def agent(client, ep, sid):
            return await swe_program.run_agent(client, "clamp is broken", "clamp", model="m")

        st, out = serve(tok, gen, agent, max_len=8192, max_tokens=512)
        return st, out

    st, out = episode(FIXES["clamp"][1])
    assert out["reward"] == 1.0 and out["extra_logs"]["tool_calls"] == 3.0, out
    assert out["extra_logs"]["commands"] == 5.0  # the listing, the first test run, read, run_tests, the grade
    t = st.session.trajectory()
    assert t["turns"] == 4 and t["endpoint"]["untrained_calls"] == 0.0
    _, wrong = episode(PARTIAL)
    assert wrong["reward"] == 0.0 and wrong["extra_logs"]["commands"] == 5.0, wrong


@pytest.mark.parametrize("agent", ["swe_program.py", "swe_mini.py"])
def test_the_swe_agents_in_a_job(agent, ppo_setup, tmp_path, monkeypatch, capsys):
    """Each agent in PPO (the tiny model): every trajectory ends without a failure, is graded 0 in the sandbox (the
    model fixes nothing) and logs the sandbox's seconds. Our program (2 tasks x 2 trajectories) runs its listing and
    visible tests first. mini-swe-agent (1 task x 2, its prompt alone about 3,100 tokens here; its step limit set to
    1 by a wrapper file, as a user's own configuration would) reads no tool call in the tiny model's reply and stops,
    unsubmitted."""
    from ppo_common import DIMS, TINY_GRPO, ppo_args
    from test_agent_endpoint import chatml_tokenizer

    from helpers import free_port
    from rlhf.demo.swe_task import records
    from rlhf.models.tiny import make_tiny_hf
    from rlhf.observability.metrics import read_metrics_jsonl
    from rlhf.ppo import main

    mini = agent == "swe_mini.py"
    agent_file, tasks = f"rlhf/demo/{agent}", 2
    if mini:
        require("minisweagent", "mini-swe-agent runs against the endpoint")
        agent_file, tasks = tmp_path / "one_step.py", 1
        agent_file.write_text("from rlhf.demo.swe_mini import run_agent as run\n\n\n"
                              "def run_agent(client, prompt, label, **kw):\n"
                              "    return run(client, prompt, label, max_steps=1, **kw)\n")
    chatml_tokenizer(tmp_path / "tok")
    actor = make_tiny_hf(str(tmp_path / "actor"), "llama", seed=4, tokenizer_dir=str(tmp_path / "tok"),
                         **{**DIMS, "max_position_embeddings": 4096 if mini else 2048})
    prompts = tmp_path / "swe.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records()[:tasks]))
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    flags = {**TINY_GRPO, "--rollout_backend": "megatron", "--pretrain": actor, "--prompt_data": str(prompts),
             "--label_key": "task", "--agent_func_path": str(agent_file), "--max_len": "4096" if mini else "1800",
             "--prompt_max_len": "64", "--generate_max_len": "4", "--rollout_batch_size": str(tasks),
             "--n_samples_per_prompt": "2", "--train_batch_size": str(2 * tasks),
             "--micro_train_batch_size": str(2 * tasks), "--micro_rollout_batch_size": str(2 * tasks),
             "--max_samples": str(tasks), "--agent_timeout_s": "120"}
    assert main(ppo_args(ppo_setup, str(tmp_path / "o"), **flags) + ["--stop_after_steps", "1"]) == 0
    capsys.readouterr()
    s = read_metrics_jsonl(str(tmp_path / "o" / "metrics.jsonl"), "ppo")[1]
    assert s["agent/failures"] == 0.0 and s["reward"] == 0.0 and s["reward_extra/solved"] == 0.0, s
    assert s["reward_extra/sandbox_seconds"] > 0.0, s
    if mini:
        assert s["reward_extra/steps"] == 1.0 and s["reward_extra/submitted"] == 0.0, s
        assert s["reward_extra/commands"] == 1.0, s  # the grade alone
    else:
        assert s["reward_extra/commands"] >= 3.0, s


def test_mini_swe_agent_fixes_a_bug_through_the_endpoint_in_the_sandbox(tmp_path):
    """mini-swe-agent (PyPI, unchanged: its DefaultAgent, LitellmModel and mini.yaml) against the endpoint, the model
    scripted in Hermes' tool-call format: a sed through its bash tool, then its submit command. Each command ran in
    the sandbox (SweRepo counts them); the hidden tests pass: reward 1, submitted, 2 model calls, every call
    trained. The same with a fix that passes the visible test only: reward 0."""
    require("minisweagent", "mini-swe-agent runs against the endpoint")
    import asyncio

    from test_agent_endpoint import ScriptedGen, chatml_tokenizer, serve

    from rlhf.demo import swe_mini

    tok = chatml_tokenizer(tmp_path / "tok")
    ids = lambda s: tok(text=s, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # noqa: E731

    def bash(command):
        return ids("Fixing.\n<tool_call>" + json.dumps({"name": "bash", "arguments": {"command": command}})
                   + "</tool_call>")

    def episode(sed):
        gen = ScriptedGen([(bash(f"sed -i '{sed}' mathx.py"), True),
                           (bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"), True)])

        async def agent(client, ep, sid):
            return await asyncio.to_thread(swe_mini.run_agent, None, "clamp is broken", "clamp", model="m",
                                           base_url=ep.url(sid), api_key="k")

        return serve(tok, gen, agent, max_len=16384, max_tokens=512)

    st, out = episode("s/max(lo, x)/min(hi, max(lo, x))/")
    assert out["reward"] == 1.0 and out["extra_logs"]["submitted"] == 1.0, out
    assert out["extra_logs"]["steps"] == 2.0 and out["extra_logs"]["commands"] == 3.0, out  # 2 commands, the grade
    t = st.session.trajectory()
    assert t["turns"] == 2 and t["endpoint"]["untrained_calls"] == 0.0, t["endpoint"]
    _, wrong = episode("s/max(lo, x)/min(hi, x)/")
    assert wrong["reward"] == 0.0 and wrong["extra_logs"]["submitted"] == 1.0, wrong
