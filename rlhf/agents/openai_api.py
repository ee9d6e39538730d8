"""OpenAI's request and response formats for the endpoint (``rlhf.agents.endpoint``): the checks of a
``/v1/chat/completions`` or ``/v1/completions`` body (``parse_request``, an ``OpenAIError`` naming the field), a
reply cut at its stop strings (``cut_at_stop``), and the response bodies, whole or as server-sent events."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 16


class OpenAIError(Exception):
    """A request the endpoint refuses: the HTTP status and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


@dataclass
class Request:
    """One generation request, checked."""

    chat: bool
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    prompt: str | list[int] | None = None
    n: int = 1
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    stream: bool = False
    model: str = ""


def _int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise OpenAIError(f"{key} must be an integer in [{lo}, {hi if hi is not None else 'inf'}], got {v!r}", key)
    return v


def parse_request(body, chat: bool, temperature: float, top_p: float) -> Request:
    """A request body checked against what the endpoint serves. Sampling runs at the job's --temperature and
    --top_p (the trainer's log-probs are taken at them): a request asking for others is refused, not changed."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    for key, job, flag in (("temperature", temperature, "--temperature"), ("top_p", top_p, "--top_p")):
        v = body.get(key)
        if v is not None and (not isinstance(v, (int, float)) or abs(float(v) - job) > 1e-6):
            raise OpenAIError(f"{key} {v!r}: this endpoint samples at the job's {flag} {job:g} (the trainer's "
                              f"log-probs are taken there); leave {key} out or send {job:g}", key)
    for key, default in (("echo", False), ("best_of", 1), ("suffix", None), ("logit_bias", None),
                         ("presence_penalty", 0), ("frequency_penalty", 0)):
        if body.get(key) not in (None, default) and body.get(key) != {}:
            raise OpenAIError(f"{key} {body[key]!r} is not supported by this endpoint", key)
    req = Request(chat=chat, model=str(body.get("model") or ""), n=_int(body, "n", 1, MAX_N) or 1,
                  stream=bool(body.get("stream", False)))
    req.max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise OpenAIError(f"stop must be a string or a list of at most 4 non-empty strings, got {body.get('stop')!r}",
                          "stop")
    req.stop = stop
    if chat:
        _parse_chat(body, req)
    else:
        _parse_completion(body, req)
    return req


def _parse_chat(body: dict, req: Request) -> None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise OpenAIError("messages must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise OpenAIError(f"messages[{i}] must be an object with a role in {ROLES}", f"messages[{i}]")
    req.messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in msgs]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                                  and isinstance(t.get("function"), dict)
                                                  and isinstance(t["function"].get("name"), str) for t in tools):
            raise OpenAIError("tools must be a list of {'type': 'function', 'function': {'name': ...}}", "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise OpenAIError(f"tool_choice {choice!r}: only 'auto' and 'none' (a reply is sampled freely, then its "
                          "tool calls are read)", "tool_choice")
    req.tools = None if choice == "none" else (tools or None)
    if body.get("logprobs"):
        req.logprobs = True
    _int(body, "top_logprobs", 0, 20)


def _parse_completion(body: dict, req: Request) -> None:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    ok_ids = isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)
    if not (isinstance(p, str) and p) and not ok_ids:
        raise OpenAIError("prompt must be one non-empty string or one list of token ids", "prompt")
    req.prompt = p
    req.logprobs = _int(body, "logprobs", 0, 5) is not None


def cut_at_stop(tok, ids: list[int], stop: list[str]) -> tuple[list[int], str, bool]:
    """A reply's ids up to the token that completes its first stop string (the ids kept: what the model sampled
    up to there), its text before that string (OpenAI leaves the stop string out), and whether one ended it."""
    text = tok.decode(ids, skip_special_tokens=True)
    if not any(s in text for s in stop):
        return list(ids), text, False
    for k in range(1, len(ids) + 1):
        part = tok.decode(ids[:k], skip_special_tokens=True)
        hits = [part.find(s) for s in stop if s in part]
        if hits:
            return list(ids[:k]), part[:min(hits)], True
    return list(ids), text, False


@dataclass
class Choice:
    text: str
    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    tool_calls: list[dict] | None = None
    """``{"id", "type": "function", "function": {"name", "arguments"}}`` each"""


def _chat_logprobs(tok, c: Choice) -> dict:
    content = []
    for t, lp in zip(c.ids, c.logprobs):
        s = tok.decode([t])
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
    return {"content": content}


def response(tok, req: Request, rid: str, model: str, prompt_ids: list[int], choices: list[Choice]) -> dict:
    """The whole response body. The log-probs are the sampled tokens' (``top_logprobs`` lists are empty: the
    generator returns no alternatives); ``prompt_token_ids`` and each choice's ``token_ids`` (vLLM's extension)
    are the ids the generator was fed and sampled."""
    out = []
    for i, c in enumerate(choices):
        if req.chat:
            msg = {"role": "assistant", "content": c.text if (c.text or not c.tool_calls) else None}
            if c.tool_calls:
                msg["tool_calls"] = c.tool_calls
            ch = {"index": i, "message": msg, "finish_reason": c.finish_reason,
                  "logprobs": _chat_logprobs(tok, c) if req.logprobs else None}
        else:
            toks = [tok.decode([t]) for t in c.ids]
            offs = [sum(len(x) for x in toks[:k]) for k in range(len(toks))]
            ch = {"index": i, "text": c.text, "finish_reason": c.finish_reason,
                  "logprobs": {"tokens": toks, "token_logprobs": c.logprobs, "top_logprobs": None,
                               "text_offset": offs} if req.logprobs else None}
        ch["token_ids"] = c.ids
        out.append(ch)
    gen = sum(len(c.ids) for c in choices)
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": out, "prompt_token_ids": prompt_ids,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": gen,
                      "total_tokens": len(prompt_ids) + gen}}


def stream_events(body: dict, chat: bool) -> list[dict]:
    """A whole response as the chunks of a stream: each choice's text in one delta, then its finish reason."""
    base = {"id": body["id"], "created": body["created"], "model": body["model"],
            "object": "chat.completion.chunk" if chat else "text_completion"}
    events = []
    for ch in body["choices"]:
        if chat:
            m = ch["message"]
            delta = {"role": "assistant", "content": m["content"]}
            if m.get("tool_calls"):
                delta["tool_calls"] = [{**t, "index": k} for k, t in enumerate(m["tool_calls"])]
            events.append({**base, "choices": [{"index": ch["index"], "delta": delta, "logprobs": ch["logprobs"],
                                                "finish_reason": None}]})
            events.append({**base, "choices": [{"index": ch["index"], "delta": {},
                                                "finish_reason": ch["finish_reason"]}]})
        else:
            events.append({**base, "choices": [{"index": ch["index"], "text": ch["text"], "logprobs": ch["logprobs"],
                                                "finish_reason": ch["finish_reason"]}]})
    return events
