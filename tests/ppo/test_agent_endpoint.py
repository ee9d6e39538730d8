"""The OpenAI-compatible endpoint of the agents' rollout (rlhf.agents.endpoint, rlhf.agents.tokens), against a
scripted generator and the real ``openai`` client over loopback HTTP.

The tokenizer is a byte-level BPE with merges (" hotel" is one token) and a ChatML template that trims each message's
content, as Llama 3's does: a reply sampled as single bytes, or starting with a space, does not come back as the
same ids when the client's copy of the conversation is rendered and encoded again. The endpoint feeds the sampled
ids verbatim (checked against what the generator was fed); the control stitches the same session as OpenRLHF's
``agent_func_openai_server_executor.py`` does (re-render, re-encode, prefix assumed) and trains other tokens."""
from __future__ import annotations

import asyncio
import json

import pytest

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] | trim) + '<|im_end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
THINK_TEMPLATE = ("{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and not loop.last %}"
                  "{% set c = c.split('</think>')[-1] %}{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + c + "
                  "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def chatml_tokenizer(out, template=TEMPLATE):
    """A 320-token byte-level BPE (merges: whole words) with ChatML's two special tokens, EOS <|im_end|>."""
    from rlhf.models.tiny import make_tokenizer

    tok = make_tokenizer(str(out), vocab_size=320)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = template
    tok.save_pretrained(str(out))
    return tok


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return chatml_tokenizer(tmp_path_factory.mktemp("chatml"))


def bytewise(tok, text: str) -> list[int]:
    """``text`` as the model may sample it: one token per character, never a merge."""
    return [i for ch in text for i in tok(text=ch, add_special_tokens=False)["input_ids"]]


class ScriptedGen:
    """The rollout's queue (``submit``) answering with scripted replies (ids, ended by EOS), log-prob -0.1 * (k + 1)
    for the k-th token; it records every request as the generator got it."""

    def __init__(self, replies):
        self.replies, self.fed = list(replies), []

    async def submit(self, j, turn, ids, params):
        self.fed.append({"ids": list(ids), "params": params, "j": j, "turn": turn})
        out, eos = self.replies.pop(0)
        out = out[: params[2]]
        return list(out), [-0.1 * (k + 1) for k in range(len(out))], eos, 0


def serve(tok, gen, agent, **cfg):
    """``agent(client, endpoint, sid)`` against an endpoint in front of ``gen``: (the session, what agent returned)."""
    import openai

    from rlhf.agents.endpoint import Endpoint, EndpointConfig

    async def go():
        ep = Endpoint(gen, tok, EndpointConfig(**{"temperature": 1.0, "top_p": 1.0, "max_tokens": 128, "max_len": 2048,
                                                  **cfg}))
        await ep.start()
        sid, st = ep.open(3)
        client = openai.AsyncOpenAI(base_url=ep.url(sid), api_key="k", max_retries=0)
        try:
            return st, await agent(client, ep, sid)
        finally:
            await client.close()
            await ep.stop()

    return asyncio.run(go())


def naive_stitch(tok, fed_messages: list[list[dict]], replies: list[list[int]], tools=None) -> dict:
    """The control: a session stitched as OpenRLHF's example does (each request's messages rendered and encoded
    again, the earlier calls assumed to be a prefix), without its assert: the tokens it would train."""
    from rlhf.agents.tokens import ChatFormat

    fmt = ChatFormat(tok)
    prompts = [fmt.encode(fmt.render(m, tools, True)) for m in fed_messages]
    obs = prompts[-1] + replies[-1]
    ranges = [(len(p), len(p) + len(r)) for p, r in zip(prompts, replies)]
    return {"observation_tokens": obs, "action_ranges": ranges, "prompts": prompts}


def test_a_tool_conversation_is_fed_and_trained_on_the_sampled_ids(tok):
    """Turn 1 samples a tool call byte by byte after a space (the trim template drops it, BPE would merge); the
    client sends the conversation back with the tool's result; turn 2 is fed turn 1's prompt and sampled ids
    verbatim, then the template's end of the turn and the tool message. The trajectory's model tokens are the
    sampled ones with their log-probs; re-encoding the client's conversation (the control) gives other ids."""
    call = ' <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    r1 = bytewise(tok, call) + [tok.eos_token_id]
    r2 = bytewise(tok, " the hotel is 5") + [tok.eos_token_id]
    gen = ScriptedGen([(r1, True), (r2, True)])
    sent = []

    async def agent(client, ep, sid):
        msgs = [{"role": "user", "content": "add 2 and 3"}]
        sent.append(list(msgs))
        a = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, logprobs=True)
        m = a.choices[0].message
        assert a.choices[0].finish_reason == "tool_calls" and m.content is None, a
        tc = m.tool_calls[0]
        assert (tc.function.name, json.loads(tc.function.arguments)) == ("add", {"a": 2, "b": 3})
        msgs = msgs + [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": tc.id, "content": "5"}]
        sent.append(list(msgs))
        b = await client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
        assert b.choices[0].message.content == " the hotel is 5" and b.choices[0].finish_reason == "stop"
        return a

    st, first = serve(tok, gen, agent)
    p1, p2 = gen.fed[0]["ids"], gen.fed[1]["ids"]
    assert p2[:len(p1) + len(r1)] == p1 + r1  # the model's tokens are fed back as sampled
    assert tok.decode(p2[len(p1) + len(r1):]).startswith("\n<|im_start|>tool\n<tool_response>\n5")
    assert first.choices[0].logprobs.content[0].logprob == pytest.approx(-0.1)
    t = st.session.trajectory()
    assert t["observation_tokens"] == p2 + r2 and t["prompt_length"] == len(p1)
    assert t["action_ranges"] == [(len(p1), len(p1) + len(r1)), (len(p2), len(p2) + len(r2))]
    for (a, b), r in zip(t["action_ranges"], (r1, r2)):
        assert t["observation_tokens"][a:b] == r
        assert t["rollout_log_probs"][a:b] == pytest.approx([-0.1 * (k + 1) for k in range(len(r))])
    assert t["endpoint"] == {"calls": 2.0, "untrained_calls": 0.0, "continued": 1.0, "retokenize_differs": 1.0,
                             "new_segments": 0.0}
    # The control: the same session re-encoded as a plain server would; its first action's place holds other ids.
    naive = naive_stitch(tok, sent, [r1, r2], TOOLS)
    assert naive["prompts"][1][:len(p1) + len(r1)] != p1 + r1
    a, b = naive["action_ranges"][0]
    assert naive["observation_tokens"][a:b] != r1


def test_a_template_that_rewrites_earlier_turns_starts_a_new_segment(tmp_path):
    """A template that drops an earlier turn's thinking once later turns follow: the second request cannot be fed
    as a continuation (its text before the new message differs from the first call's), so it starts from the
    template's tokens; the first call stays out of training (counted), the second is trained."""
    tok = chatml_tokenizer(tmp_path / "think", THINK_TEMPLATE)
    r1 = tok(text="<think>hm</think>echo", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    r2 = tok(text="golf", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    gen = ScriptedGen([(r1, True), (r2, True)])

    async def agent(client, ep, sid):
        msgs = [{"role": "user", "content": "hi"}]
        a = await client.chat.completions.create(model="m", messages=msgs)
        msgs += [{"role": "assistant", "content": a.choices[0].message.content}, {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="m", messages=msgs)

    st, _ = serve(tok, gen, agent)
    t = st.session.trajectory()
    assert "<think>" not in tok.decode(gen.fed[1]["ids"])
    assert t["observation_tokens"] == gen.fed[1]["ids"] + r2 and t["action_ranges"] == [(len(gen.fed[1]["ids"]),
                                                                                         len(t["observation_tokens"]))]
    assert t["endpoint"]["untrained_calls"] == 1.0 and t["endpoint"]["new_segments"] == 1.0


def test_n_stop_max_tokens_completions_and_stream(tok):
    """n=2 choices (the next request continues the second), a stop string (the text before it returned, the ids
    through the token that completed it kept), max_tokens capped by --generate_max_len, /v1/completions on text and
    on token ids (continued token for token), a stream, /v1/models."""
    import httpx

    a0, a1 = bytewise(tok, "kilo lima") + [tok.eos_token_id], bytewise(tok, "mike echo") + [tok.eos_token_id]
    stop = bytewise(tok, "apple STOP banana") + [tok.eos_token_id]
    gen = ScriptedGen([(a0, True), (a1, True), (stop, True), ([5] * 40, False), (bytewise(tok, " x"), False),
                       (bytewise(tok, " y"), False), (bytewise(tok, " s"), True)])

    async def agent(client, ep, sid):
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], n=2)
        assert [c.message.content for c in r.choices] == ["kilo lima", "mike echo"]
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "mike echo"},
                {"role": "user", "content": "more"}]
        s = await client.chat.completions.create(model="m", messages=msgs, stop=["STOP"])
        assert s.choices[0].message.content == "apple " and s.choices[0].finish_reason == "stop"
        long = await client.completions.create(model="m", prompt="kilo", max_tokens=1000)
        assert long.usage.completion_tokens == 16 and long.choices[0].finish_reason == "length"
        c1 = await client.completions.create(model="m", prompt="golf", logprobs=0)
        c2 = await client.completions.create(model="m", prompt="golf" + c1.choices[0].text + " and")
        ids = c2.model_extra["prompt_token_ids"] + c2.choices[0].model_extra["token_ids"]
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "s"}],
                                                      stream=True)
        chunks = [ch async for ch in stream]
        async with httpx.AsyncClient() as h:
            models = (await h.get(f"http://127.0.0.1:{ep.port}/v1/models")).json()
        return c1, ids, chunks, models, ep.model

    st, (c1, ids, chunks, models, name) = serve(tok, gen, agent, max_tokens=16)
    fed = [f["ids"] for f in gen.fed]
    assert fed[2][:len(fed[0]) + len(a1)] == fed[0] + a1  # the second choice is continued
    calls = st.session.calls
    assert calls[2].completion_ids == bytewise(tok, "apple STOP")
    assert [f["params"][2] for f in gen.fed[:4]] == [16, 16, 16, 16]
    assert c1.choices[0].logprobs.token_logprobs == pytest.approx([-0.1, -0.2])
    assert fed[5][:len(fed[4]) + 2] == fed[4] + bytewise(tok, " x") and ids == fed[5] + bytewise(tok, " y")
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == " s"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert models["data"][0]["id"] == name == "policy" and models["data"][0]["max_model_len"] == 2048


@pytest.mark.parametrize("body,status,needle", [
    ({"temperature": 0.5}, 400, "this endpoint samples at the job's --temperature 1"),
    ({"top_p": 0.9}, 400, "--top_p 1"),
    ({"tool_choice": "required", "tools": TOOLS}, 400, "tool_choice 'required'"),
    ({"n": 17}, 400, "n must be an integer in [1, 16]"),
    ({"messages": []}, 400, "messages must be a non-empty list"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop must be a string or a list of at most 4"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty 0.5 is not supported"),
    ({"_url": "/s/nope/v1/chat/completions"}, 404, "no such session"),
])
def test_requests_the_endpoint_cannot_serve_are_refused_by_name(tok, body, status, needle):
    import httpx

    async def agent(client, ep, sid):
        url = f"http://127.0.0.1:{ep.port}" + body.pop("_url", f"/s/{sid}/v1/chat/completions")
        req = {"model": "m", "messages": [{"role": "user", "content": "x"}], **body}
        async with httpx.AsyncClient() as h:
            return await h.post(url, json=req)

    gen = ScriptedGen([])
    st, r = serve(tok, gen, agent)
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text
    assert not gen.fed and st.failure is None


@pytest.mark.parametrize("cfg,needle", [({"max_len": 30}, "leave no room for a reply within --max_len 30"),
                                        ({"max_turns": 1}, "reached --max_turns 1")])
def test_a_session_past_its_budget_fails(tok, cfg, needle):
    """Past --max_len or --max_turns a request is refused (400) and the session has failed (reason budget); later
    requests are refused too."""
    import openai

    gen = ScriptedGen([([7, 8], True)])

    async def agent(client, ep, sid):
        msgs = [{"role": "user", "content": "word " * (1 if "max_turns" in cfg else 20)}]
        if "max_turns" in cfg:
            await client.chat.completions.create(model="m", messages=msgs)
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="m", messages=msgs)
        with pytest.raises(openai.BadRequestError, match="this session failed"):
            await client.chat.completions.create(model="m", messages=msgs)
        return str(e.value)

    st, err = serve(tok, gen, agent, **cfg)
    assert needle in err and type(st.failure).__name__ == "BudgetExceeded" and needle in str(st.failure)


def test_a_completion_client_writing_the_sampled_eos_gets_it_once(tok):
    """/v1/completions: a reply ended by EOS returns its text without it; a client that writes the turn's end
    itself before its next text (as a chat loop over raw ChatML does) is fed the sampled EOS once, not twice."""
    r1 = bytewise(tok, "golf") + [tok.eos_token_id]
    gen = ScriptedGen([(r1, True), ([9], True)])

    async def agent(client, ep, sid):
        a = await client.completions.create(model="m", prompt="<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")
        assert a.choices[0].text == "golf" and a.choices[0].finish_reason == "stop"
        await client.completions.create(model="m", prompt="<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
                                        "golf<|im_end|>\n<|im_start|>user\nr<|im_end|>\n")

    serve(tok, gen, agent)
    p1, p2 = gen.fed[0]["ids"], gen.fed[1]["ids"]
    assert p2[:len(p1) + len(r1)] == p1 + r1
    assert tok.decode(p2[len(p1) + len(r1):]) == "\n<|im_start|>user\nr<|im_end|>\n"
