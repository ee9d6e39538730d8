"""The OpenAI-compatible endpoint a rank serves during its rollout, in front of the colocated generator (vLLM or
the megatron fallback): ``/v1/models``, ``/v1/chat/completions`` (tools in OpenAI's format through the actor's chat
template, ``n``, ``logprobs``, ``stop``, ``max_tokens``, ``stream``) and ``/v1/completions``, on the loopback
address, one URL per session (``http://127.0.0.1:PORT/s/<session>/v1``). Every request joins the rollout's next
batched round (``rlhf.agents.rollout``); every call is recorded token for token (``rlhf.agents.tokens``).

A session's budget: prompt and reply within --max_len, at most --max_turns requests; a request past it is refused
(HTTP 400) and the session fails with reason ``budget`` (reward 0)."""
from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass, field

from rlhf.agents.openai_api import Choice, OpenAIError, Request, cut_at_stop, parse_request, response, stream_events
from rlhf.agents.tokens import Call, ChatFormat, Session, norm_message, parse_tool_calls

log = logging.getLogger(__name__)


class BudgetExceeded(RuntimeError):
    """A session asked for more than --max_len tokens or --max_turns requests."""


@dataclass
class SessionState:
    """One trajectory's session: its calls (``session``), its seeds' counter, whether a request is in flight (the
    agent's own time, which --agent_timeout_s bounds, is the time with none), and how it failed."""

    j: int
    session: Session
    requests: int = 0
    turns: int = 0
    waiting: int = 0
    idle_since: float = field(default_factory=time.monotonic)
    waited_s: float = 0.0
    """seconds with a request in flight (the rest of the session is the agent's own time)"""
    failure: BaseException | None = None
    closed: bool = False


@dataclass
class EndpointConfig:
    """What every request is sampled with: the job's --temperature and --top_p, --generate_max_len per reply, the
    session budget (--max_len, --max_turns). A call records the policy version of the round that answered it."""

    temperature: float
    top_p: float
    max_tokens: int
    max_len: int
    max_turns: int | None = None


class Endpoint:
    """One rank's endpoint; ``llm`` is the rollout's request queue (``submit(j, turn, ids, params)``)."""

    def __init__(self, llm, tokenizer, cfg: EndpointConfig):
        self.llm, self.tok, self.cfg = llm, tokenizer, cfg
        self.model = getattr(tokenizer, "name_or_path", "") or "policy"
        self.fmt = ChatFormat(tokenizer) if getattr(tokenizer, "chat_template", None) else None
        if self.fmt is not None and not self.fmt.native_tools:
            log.info("endpoint: --pretrain's chat template has no tools of its own; tools are described in a system "
                     "prompt and tool calls read as <tool_call>{json}</tool_call> blocks (Hermes' format)")
        self.sessions: dict[str, SessionState] = {}
        self.runner = None
        self.port = 0

    # ---------------------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/s/{sid}/v1/models", self._models)
        app.router.add_post("/s/{sid}/v1/chat/completions", self._chat)
        app.router.add_post("/s/{sid}/v1/completions", self._completions)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        self.sessions.clear()

    def open(self, j: int) -> tuple[str, SessionState]:
        sid = f"{j}-{secrets.token_hex(6)}"
        st = SessionState(j=j, session=Session(self.tok, self.fmt))
        self.sessions[sid] = st
        return sid, st

    def url(self, sid: str) -> str:
        return f"http://127.0.0.1:{self.port}/s/{sid}/v1"

    def close(self, sid: str) -> None:
        st = self.sessions.pop(sid, None)
        if st is not None:
            st.closed = True

    # ---------------------------------------------------------------------------------------------- handlers
    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                              "owned_by": "rlhf", "max_model_len": self.cfg.max_len}]})

    async def _chat(self, request):
        return await self._serve(request, chat=True)

    async def _completions(self, request):
        return await self._serve(request, chat=False)

    async def _serve(self, request, chat: bool):
        from aiohttp import web

        try:
            st = self.sessions.get(request.match_info["sid"])
            if st is None or st.closed:
                raise OpenAIError("no such session (it ended, or the URL is not one the rollout gave)", status=404,
                                  code="not_found")
            if st.failure is not None:
                raise OpenAIError(f"this session failed: {st.failure}", code="session_failed")
            try:
                body = await request.json()
            except ValueError:
                raise OpenAIError("the request body is not JSON") from None
            req = parse_request(body, chat, self.cfg.temperature, self.cfg.top_p)
            out = await self._generate(st, req)
        except OpenAIError as e:
            return web.json_response(e.body(), status=e.status)
        if not req.stream:
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for ev in stream_events(out, chat):
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---------------------------------------------------------------------------------------------- generation
    def _prompt(self, st: SessionState, req: Request) -> tuple[list[int], int | None, object]:
        if req.chat:
            if self.fmt is None:
                raise OpenAIError("--pretrain's tokenizer has no chat template: use /v1/completions")
            ids, parent = st.session.chat_prompt(req.messages, req.tools)
            return ids, parent, tuple(norm_message(m) for m in req.messages)
        if isinstance(req.prompt, list) and any(t >= len(self.tok) for t in req.prompt):
            raise OpenAIError(f"prompt holds token ids outside the vocabulary ({len(self.tok)})", "prompt")
        ids, parent = st.session.text_prompt(req.prompt)
        return ids, parent, req.prompt if isinstance(req.prompt, str) else None

    def _fail(self, st: SessionState, msg: str) -> OpenAIError:
        st.failure = BudgetExceeded(msg)
        return OpenAIError(msg, code="context_length_exceeded")

    async def _generate(self, st: SessionState, req: Request) -> dict:
        cfg = self.cfg
        if cfg.max_turns is not None and st.requests >= cfg.max_turns:
            raise self._fail(st, f"the session's requests reached --max_turns {cfg.max_turns}")
        ids, parent, context = self._prompt(st, req)
        room = cfg.max_len - len(ids)
        if room < 1:
            raise self._fail(st, f"the prompt's {len(ids)} tokens leave no room for a reply within --max_len "
                                 f"{cfg.max_len}")
        max_tokens = min(req.max_tokens or cfg.max_tokens, cfg.max_tokens, room)
        number, st.requests = st.requests, st.requests + 1
        turns = list(range(st.turns, st.turns + req.n))
        st.turns += req.n
        st.waiting += 1
        t0 = time.monotonic()
        try:
            import asyncio

            outs = await asyncio.gather(*[self.llm.submit(st.j, t, ids, (cfg.temperature, cfg.top_p, max_tokens))
                                          for t in turns])
        finally:
            st.waiting -= 1
            st.idle_since = time.monotonic()
            if not st.waiting:
                st.waited_s += st.idle_since - t0
        choices = [self._choice(st, req, number, ids, parent, context, *o) for o in outs]
        return response(self.tok, req, f"{'chatcmpl' if req.chat else 'cmpl'}-{st.j}-{number}", req.model or self.model,
                        ids, choices)

    def _choice(self, st: SessionState, req: Request, number: int, ids: list[int], parent, context,
                out_ids: list[int], lps: list[float], finished: bool, version: int) -> Choice:
        kept, text, stopped = cut_at_stop(self.tok, out_ids, req.stop)
        finished = finished and not stopped
        calls = None
        if req.chat and req.tools:
            content, parsed = parse_tool_calls(text)
            if parsed:
                text = content
                calls = [{"id": f"call_{st.j}_{number}_{k}", "type": "function", "function": c}
                         for k, c in enumerate(parsed)]
        reason = "tool_calls" if calls else ("stop" if finished or stopped else "length")
        choice = Choice(text=text, ids=kept, logprobs=list(lps[:len(kept)]), finish_reason=reason, tool_calls=calls)
        if req.chat:
            msg = {"role": "assistant", "content": text if (text or not calls) else None}
            if calls:
                msg["tool_calls"] = calls
            reply = norm_message(msg)
        else:
            reply = text
        if not st.closed:
            st.session.record(Call(request=number, prompt_ids=list(ids), completion_ids=kept, logprobs=choice.logprobs,
                                   finished=finished, version=version,
                                   context=context, reply=reply, parent=parent))
        return choice
