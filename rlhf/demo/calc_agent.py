"""A calculator tool for multi-turn agent RL (``--agent_func_path rlhf/demo/calc_agent.py``; the task's prompts
come from ``rlhf.demo.calc_task``): the model may write ``<calc>EXPRESSION</calc>`` (the closing tag optional); the environment answers with
the value as the next user turn, and the model then gives its answer. A trajectory ends when the model answers
without calling the tool, or after the tool's answer has been used, or after ``MAX_CALLS`` calls.

Reward: 1 when the last number of the final answer equals the record's ``answer`` (``--label_key answer``), else 0;
nothing for calling the tool as such, so the tool is used only as far as it pays. ``extra_logs``: ``tool_calls``
(calls in the trajectory) and ``used_tool`` (0/1), ``correct``.

Written as an OpenRLHF agent file (its import line is ours); the chat turns are SmolLM2's (ChatML) when the
prompt is ChatML, plain text otherwise.
"""
from __future__ import annotations

import ast
import operator
import re

from rlhf.agents import AgentInstanceBase, MultiTurnAgentExecutor

CALL = re.compile(r"<calc>\s*([0-9+\-*x×·() ]*[0-9)])")
"""A call: ``<calc>`` then an expression (the closing ``</calc>`` is optional)."""
MAX_CALLS = 2
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def evaluate(expression: str) -> int | None:
    """The value of an integer expression of + - * and parentheses, or None (no names, no calls, no powers)."""
    try:
        tree = ast.parse(expression.strip().replace("x", "*").replace("×", "*").replace("·", "*"), mode="eval")
    except SyntaxError:
        return None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and abs(node.value) < 10**9:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("not an integer expression")

    try:
        value = ev(tree)
    except (ValueError, TypeError, RecursionError):
        return None
    return value if abs(value) < 10**18 else None


def correct(reply: str, answer: str) -> bool:
    """``rlhf.rewards.verifiers``' grading of the reply's answer (its last number), tool calls left out."""
    from rlhf.rewards.verifiers import answer_of, grade_answer

    return grade_answer(answer_of(CALL.sub("", reply)), answer)


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.calls = 0
        self.chatml = False

    async def reset(self, states, **kwargs):
        self.chatml = "<|im_start|>" in states["observation"]
        return {"observation": states["observation"]}

    def _user(self, text: str) -> str:
        if self.chatml:
            return f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        return f"\n{text}\n"

    async def step(self, states, **kwargs):
        action = states["action_text"]
        call = CALL.search(action)
        if call is not None and self.calls < MAX_CALLS:
            self.calls += 1
            value = evaluate(call.group(1))
            result = "error" if value is None else str(value)
            return {"rewards": 0.0, "environment_feedback": self._user(f"Calculator: {result}"), "done": False,
                    "sampling_params": states.get("sampling_params")}
        ok = correct(action, states["label"] or "")
        return {"rewards": float(ok), "scores": float(ok), "environment_feedback": "", "done": True,
                "extra_logs": {"tool_calls": float(self.calls), "used_tool": float(self.calls > 0),
                               "correct": float(ok)}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
