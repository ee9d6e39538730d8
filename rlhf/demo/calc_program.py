"""The calculator task of ``rlhf.demo.calc_agent`` written as a plain program against the rollout's OpenAI-compatible
endpoint (``--agent_func_path rlhf/demo/calc_program.py``, rlhf.agents.program): the same conversation (calc_task's
system line, its worked exchange, then the question), the same tool, the same turns and the same reward, through
``client.chat.completions`` instead of OpenRLHF's environment API. Its prompts are the bare questions
(``program_records``); the endpoint applies the chat template.

The model may write ``<calc>EXPRESSION</calc>``; the program answers with the value as the next user message; a
trajectory ends when the model answers without calling the tool, or after ``MAX_CALLS`` calls. Reward 1 when the
last number of the final answer equals the record's answer, else 0.
"""
from __future__ import annotations

from rlhf.demo.calc_agent import CALL, MAX_CALLS, correct, evaluate
from rlhf.demo.calc_task import SHOT, SYSTEM


async def run_agent(client, prompt, label, model, **kw):
    messages = [{"role": "system", "content": SYSTEM}, *SHOT, {"role": "user", "content": prompt}]
    calls = 0
    while True:
        r = await client.chat.completions.create(model=model, messages=messages)
        reply = r.choices[0].message.content or ""
        call = CALL.search(reply)
        if call is None or calls >= MAX_CALLS:
            break
        calls += 1
        value = evaluate(call.group(1))
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"Calculator: {'error' if value is None else value}"}]
    ok = float(correct(reply, label or ""))
    return {"reward": ok, "scores": ok,
            "extra_logs": {"tool_calls": float(calls), "used_tool": float(calls > 0), "correct": ok}}


def program_records(records: list[dict]) -> list[dict]:
    """calc_task's records (``prompt``: the conversation) as this program's (``prompt``: the question alone)."""
    return [{"prompt": r["prompt"][-1]["content"], "answer": r["answer"]} for r in records]
