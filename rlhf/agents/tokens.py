"""Token-exact sessions of the OpenAI endpoint (``rlhf.agents.endpoint``): the chat template as the endpoint renders
it (``ChatFormat``), every call of a session as the generator saw and sampled it (``Call``), and the stitching of a
session's calls into one trajectory (``Session.trajectory``).

The rule: the tokens trained are the tokens sampled. A request that continues a call of its session (its messages
are that call's messages, then the assistant message the call returned, then new ones; for /v1/completions, its
prompt starts with that call's prompt and reply) is fed as that call's prompt ids + its sampled ids, verbatim, + the
template's tokens for what follows (the end of the assistant turn the model did not sample, then the new messages).
The client's copy of the model's text is never re-tokenized: decoding and re-encoding does not give back the sampled
ids (a BPE merge across the boundary, a token of half a UTF-8 character, a template that trims or rewrites the
assistant turn), and training on re-encoded ids trains tokens the model never produced.

A request that continues no call (an edited history, or a template that renders earlier turns differently once
later ones follow, e.g. one that drops earlier turns' thinking) starts a new segment from the template's tokens. A
session's trajectory is the chain of calls that ends at its last request (its first choice); the calls outside it
(earlier segments, other choices of ``n``) are context at most, never trained, and counted.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

SENTINEL = "RLHFSENTINEL7f3a"
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOLS_PROMPT = ("You may call one or more functions to assist with the user query. The functions:\n<tools>\n{tools}\n"
                "</tools>\nTo call a function, reply with a JSON object of its name and arguments within "
                "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}}\n</tool_call>")
"""The system prompt that describes the tools to a template without tools of its own (Hermes' and Qwen2.5's
format, which ``parse_tool_calls`` reads back)."""


def content_text(content) -> str:
    """A message's content as text: a string, None, or OpenAI's list of parts (the text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")


def canonical_arguments(args) -> str:
    """A tool call's arguments as one canonical JSON text (key order and spacing do not matter)."""
    try:
        return json.dumps(json.loads(args) if isinstance(args, str) else args, sort_keys=True)
    except (TypeError, ValueError):
        return str(args)


def norm_message(m: dict) -> tuple:
    """What identifies a message when a client sends it back: role, content text, tool calls (name and arguments,
    not their ids), and a tool result's call id and name."""
    calls = tuple((c.get("function", {}).get("name"), canonical_arguments(c.get("function", {}).get("arguments")))
                  for c in (m.get("tool_calls") or []))
    return (m.get("role"), content_text(m.get("content")), calls, m.get("tool_call_id") or "", m.get("name") or "")


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Hermes' ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of a reply: (the content without
    the blocks that parse, the calls as ``(name, arguments JSON)`` dicts). A block that is not such JSON stays in the
    content."""
    calls, kept, end = [], [], 0
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(args, dict)):
            continue
        kept.append(text[end:m.start()])
        end = m.end()
        calls.append({"name": obj["name"], "arguments": json.dumps(args)})
    kept.append(text[end:])
    return ("".join(kept).strip() if calls else text), calls


class ChatFormat:
    """The actor's chat template as the endpoint renders it: messages (and tools) as text, and ``turn_end``, the
    text the template puts after an assistant turn's content. A template that never reads ``tools`` gets them as a
    system prompt (``TOOLS_PROMPT``) and the assistant's tool calls as Hermes blocks in its content (logged once)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("--agent_func_path with run_agent: --pretrain's tokenizer has no chat template, which "
                             "/v1/chat/completions renders messages with")
        self.native_tools = "tools" in template
        probe = self.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": SENTINEL}], None,
                            False)
        if SENTINEL not in probe:
            raise ValueError("--pretrain's chat template drops an assistant message's content; the endpoint cannot "
                             "place the model's tokens in it")
        self.turn_end = probe[probe.rindex(SENTINEL) + len(SENTINEL):]

    def _prepared(self, messages: list[dict], tools: list | None) -> list[dict]:
        out = []
        for m in messages:
            m = {k: v for k, v in m.items() if v is not None}
            m["content"] = content_text(m.get("content"))
            if not self.native_tools and m.get("tool_calls"):
                m["content"] += "".join(
                    "\n<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                    "arguments": json.loads(canonical_arguments(
                                                        c["function"].get("arguments", "{}")))}) + "\n</tool_call>"
                    for c in m.pop("tool_calls"))
            if not self.native_tools and m.get("role") == "tool":
                m["content"] = "<tool_response>\n" + m["content"] + "\n</tool_response>"
            out.append(m)
        if tools and not self.native_tools:
            desc = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + desc}
            else:
                out.insert(0, {"role": "system", "content": desc})
        return out

    def render(self, messages: list[dict], tools: list | None, generation_prompt: bool) -> str:
        kw = {"tools": tools} if tools and self.native_tools else {}
        return self.tok.apply_chat_template(self._prepared(messages, tools), tokenize=False,
                                            add_generation_prompt=generation_prompt, **kw)

    def encode(self, text: str) -> list[int]:
        """Text the template made (its special tokens written out): no BOS of the tokenizer's own added."""
        return self.tok(text=text, add_special_tokens=False)["input_ids"] if text else []


@dataclass
class Call:
    """One generation of a session: what the generator was fed and what it sampled."""

    request: int
    """the request's number in its session (the choices of ``n`` share it)"""
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finished: bool
    """ended by the model's EOS (not by its budget or a stop string)"""
    version: int
    """the policy version (weight updates) that sampled it"""
    context: tuple | str | None
    """what the client sent: its messages, normalized (chat), its prompt text (completions), None for token ids"""
    reply: tuple | str
    """what the endpoint answered: the assistant message, normalized (chat), or the text (completions)"""
    parent: int | None
    """the call this one continues token for token (None: a new segment)"""


@dataclass
class Session:
    """The calls of one trajectory's agent, in order, and how each request's prompt ids are made."""

    tok: object
    fmt: ChatFormat | None = None
    """the chat template (None: /v1/completions only)"""
    calls: list[Call] = field(default_factory=list)
    continued: int = 0
    """requests that continued an earlier call token for token"""
    retokenize_differs: int = 0
    """continued requests whose naive re-tokenization (the template's text re-encoded) differs from the ids fed"""
    new_segments: int = 0
    """requests after the first that continued no call (edited history, or a template that rewrote earlier turns)"""

    def _continue(self, parent: int, rest: str, naive: list[int]) -> tuple[list[int], int]:
        c = self.calls[parent]
        ids = c.prompt_ids + c.completion_ids + (self.tok(text=rest, add_special_tokens=False)["input_ids"]
                                                 if rest else [])
        self.continued += 1
        self.retokenize_differs += ids != naive
        return ids, parent

    def _new_segment(self, naive: list[int]) -> tuple[list[int], None]:
        self.new_segments += bool(self.calls)
        return naive, None

    def chat_prompt(self, messages: list[dict], tools: list | None) -> tuple[list[int], int | None]:
        """The prompt ids of a chat request, and the call it continues (None: a new segment)."""
        norm = [norm_message(m) for m in messages]
        full = self.fmt.render(messages, tools, True)
        naive = self.fmt.encode(full)
        for i in range(len(self.calls) - 1, -1, -1):
            c = self.calls[i]
            k = len(c.context) if isinstance(c.context, tuple) else -1
            if k < 0 or len(norm) <= k or tuple(norm[:k]) != c.context or norm[k] != c.reply:
                continue
            prev = self.fmt.render(messages[:k + 1], tools, False)
            if full.startswith(prev) and prev.endswith(self.fmt.turn_end):
                return self._continue(i, self.closure(c) + full[len(prev):], naive)
            break  # the template rendered the earlier turns otherwise once later ones followed
        return self._new_segment(naive)

    def text_prompt(self, prompt: str | list[int]) -> tuple[list[int], int | None]:
        """The prompt ids of a /v1/completions request (text, or token ids taken as they are)."""
        if not isinstance(prompt, str):
            ids = list(prompt)
            for i in range(len(self.calls) - 1, -1, -1):
                seen = self.calls[i].prompt_ids + self.calls[i].completion_ids
                if ids[:len(seen)] == seen:
                    self.continued += 1
                    return ids, i
            return self._new_segment(ids)
        naive = self.tok(text=prompt)["input_ids"]
        for i in range(len(self.calls) - 1, -1, -1):
            c = self.calls[i]
            if isinstance(c.context, str) and prompt.startswith(c.context + c.reply):
                rest = prompt[len(c.context + c.reply):]
                eos = self._eos_text(c)
                if eos and rest.startswith(eos):  # the client wrote the turn's end the model sampled (not in the text)
                    rest = rest[len(eos):]
                return self._continue(i, rest, naive)
        return self._new_segment(naive)

    def _eos_text(self, c: Call) -> str:
        """The text of the EOS token a call ended with ("" if it did not end with one)."""
        return self.tok.decode(c.completion_ids[-1:], skip_special_tokens=False) if (
            c.finished and c.completion_ids) else ""

    def closure(self, c: Call) -> str:
        """What the template puts after the assistant's content that the model did not sample: the turn's end,
        less the EOS token the model ended with when the turn's end starts with it."""
        end, eos = self.fmt.turn_end, self._eos_text(c)
        if eos and end.startswith(eos):
            return end[len(eos):]
        return end

    def record(self, call: Call) -> None:
        self.calls.append(call)

    def trajectory(self) -> dict | None:
        """The chain of calls that ends at the last request's first choice, as the rollout's result dict
        (OpenRLHF's keys): the last call's prompt and sampled ids, the ranges and log-probs of every call of the
        chain, the policy version of each token; None before any call."""
        if not self.calls:
            return None
        last = max(c.request for c in self.calls)
        i = next(i for i, c in enumerate(self.calls) if c.request == last)
        chain = []
        while i is not None:
            chain.append(self.calls[i])
            i = self.calls[i].parent
        chain.reverse()
        end = chain[-1]
        obs = end.prompt_ids + end.completion_ids
        lps, versions, ranges = [0.0] * len(obs), [end.version] * len(obs), []
        for c in chain:
            a, b = len(c.prompt_ids), len(c.prompt_ids) + len(c.completion_ids)
            assert obs[a:b] == c.completion_ids, "a call of the chain is not where its sampled ids are"
            ranges.append((a, b))
            lps[a:b] = c.logprobs
            versions[a:b] = [c.version] * (b - a)
        return {"observation_tokens": obs, "action_ranges": ranges, "rollout_log_probs": lps, "versions": versions,
                "prompt_length": len(chain[0].prompt_ids), "turns": len(chain),
                "last_finished": end.finished, "endpoint": self.stats(len(chain))}

    def stats(self, trained: int) -> dict[str, float]:
        return {"calls": float(len(self.calls)), "untrained_calls": float(len(self.calls) - trained),
                "continued": float(self.continued), "retokenize_differs": float(self.retokenize_differs),
                "new_segments": float(self.new_segments)}
