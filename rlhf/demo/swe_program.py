"""A software-engineering agent as a plain program against the rollout's OpenAI-compatible endpoint
(``--agent_func_path rlhf/demo/swe_program.py --input_key prompt --label_key task``, prompts from ``python -m
rlhf.demo.swe_task``): the model gets the issue, the repository's file names and the visible test's output, then
at most ``MAX_TURNS`` requests with three tools in OpenAI's format
(``read_file``, ``write_file``, ``run_tests``); every command runs in ``rlhf.sandbox`` with the repository copied in
(``rlhf.demo.swe_task.SweRepo``). Reward 1 when the hidden tests pass on the repository as the agent left it.
``extra_logs``: ``sandbox_seconds``, ``commands``, ``tool_calls``, ``solved``.
"""
from __future__ import annotations

import json

from rlhf.agents.program import in_daemon_thread
from rlhf.demo.swe_task import BY_ID, SweRepo

MAX_TURNS = 6
SYSTEM = "You fix bugs in a Python repository. Use the tools to read files, write files and run the tests."


def _tool(name: str, description: str, **params) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {k: {"type": "string", "description": v} for k, v in params.items()},
        "required": list(params)}}}


TOOLS = [_tool("read_file", "the text of a file", path="a file name"),
         _tool("write_file", "replace a file's text", path="a file name", content="the new text"),
         _tool("run_tests", "run the repository's tests")]


def call_tool(repo: SweRepo, name: str, arguments: str) -> str:
    """A tool call's answer (a bad call is answered, not raised: the model reads the error)."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return f"arguments are not JSON: {arguments!r}"
    try:
        if name == "read_file":
            return repo.read_file(str(args["path"]))
        if name == "write_file":
            return repo.write_file(str(args["path"]), str(args["content"]))
        if name == "run_tests":
            return repo.run_tests()
    except KeyError as e:
        return f"{name}: missing argument {e}"
    return f"no such tool: {name!r}"


async def run_agent(client, prompt, label, model, **kw):
    repo = SweRepo(BY_ID[label])
    files = await in_daemon_thread(repo.list_files)
    tests = await in_daemon_thread(repo.run_tests)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{prompt}\nFiles:\n{files}\nTests:\n{tests.strip()[-500:]}"}]
    calls = 0
    for _ in range(MAX_TURNS):
        r = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        m = r.choices[0].message
        messages.append(m.model_dump(exclude_none=True))
        if not m.tool_calls:
            break
        for c in m.tool_calls:
            calls += 1
            out = await in_daemon_thread(call_tool, repo, c.function.name, c.function.arguments)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": out[-1500:]})
    solved = float(await in_daemon_thread(repo.hidden_pass))
    return {"reward": solved, "extra_logs": {"sandbox_seconds": repo.sandbox_s, "commands": float(repo.commands),
                                             "tool_calls": float(calls), "solved": solved}}
