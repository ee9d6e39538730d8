"""The LLM judge as a reward (``rlhf.rewards.judge``): its parsers and template by hand, its flags' errors before any
model, and two PPO jobs whose judges' verdicts are known: a judge model in the job (tests/ppo/_judge.py, weights
set so that its greedy answer follows a rule, checked against transformers' own generate) at DP 2, and a judge behind
OpenAI's API (a server here whose requests pass the agents endpoint's own OpenAI checks) that also answers what no
parser reads and refuses a request. Each job's dumped rewards are compared, reply by reply, with the rule."""
from __future__ import annotations

import glob
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from _judge import TEMPLATE, make_rule_judge, rule
from ppo_common import TINY_GRPO, ppo_args

from helpers import REPO, run_torchrun, tail

PPO = os.path.join(REPO, "launch/ppo.py")


# ------------------------------------------------------------------------------------------------- by hand
def test_parsers_by_hand():
    from rlhf.rewards.judge import parse_judge_parser

    num = parse_judge_parser("number:1:10")
    assert num("Rating: [[7]]") == pytest.approx(6 / 9)
    assert num("On a scale of 1 to 10 I give it 4.") == pytest.approx(3 / 9)  # the last number
    assert num("Rating: 10") == 1.0 and num("Rating: 1") == 0.0
    assert num("Rating: 11") is None and num("no rating") is None and num("Rating: 0") is None
    assert parse_judge_parser("number:-1:1")("-0.5") == pytest.approx(0.25)
    ab = parse_judge_parser("choice:[[A]]=1,[[B]]=0")
    assert ab("[[B]] at first, but on reflection [[A]]") == 1.0
    assert ab("[[A]] first, then [[B]]") == 0.0
    assert ab("[[A]]? Not [[B]]. Final verdict: [[A]]") == 1.0  # the last appearance, not the first
    assert ab("neither") is None
    assert parse_judge_parser("choice:yes=1,no=-1,maybe=0.5")("it is a maybe") == 0.5
    fn = parse_judge_parser("os.path:basename")  # any text -> float or None; basename returns str
    with pytest.raises(ValueError):
        fn("x")
    for bad, needle in (("number:5:1", "LO must be below HI"), ("number:1", "two numbers"),
                        ("choice:A=1", "at least two"), ("choice:A=1,B", "each choice with its reward"),
                        ("nosuch:f", "nosuch:f"), ("plain", "must be number:LO:HI")):
        with pytest.raises(ValueError, match=needle):
            parse_judge_parser(bad)


def test_render_fills_only_its_placeholders():
    from rlhf.rewards.judge import DEFAULT_TEMPLATE, render

    t = 'Q: {prompt}\nA: {response}\nGold: {label}\n{"json": {x}}'
    out = render(t, "2+2?", "4, or {label}", 4)
    assert out == 'Q: 2+2?\nA: 4, or {label}\nGold: 4\n{"json": {x}}'
    assert render("{response}", "p", "r") == "r" and render("{label}", "p", "r") == ""
    assert "{prompt}" in DEFAULT_TEMPLATE and "{response}" in DEFAULT_TEMPLATE


def test_verdicts_count_failures_and_pay_the_fail_reward():
    from rlhf.rewards.judge import parse_judge_parser, verdicts

    v = verdicts(parse_judge_parser("choice:Y=1,N=0"), ["Y", "what?", None, "N"], [None, None, "too_long", None],
                 fail_reward=0.25)
    assert v.rewards == [1.0, 0.25, 0.25, 0.0]
    assert v.failures == [None, "parse_failed", "too_long", None]


def test_model_judge_prompts_through_its_chat_template_and_skips_what_is_too_long(ppo_setup):
    """``ModelJudge.encode`` is the tokenizer's chat template with the generation prompt; a prompt past the judge's
    context is never generated for and counts as too_long."""
    import transformers

    from rlhf.rewards.judge import JudgePart, ModelJudge

    tok = transformers.AutoTokenizer.from_pretrained(ppo_setup["actor"])
    j = object.__new__(ModelJudge)
    j.cfg = JudgePart(judge_pretrain="x", judge_parser="choice:Y=1,N=0", judge_max_new_tokens=2)
    j.cfg.check()
    j.tokenizer, j.chat, j.max_len = tok, True, 24  # "user: short\nassistant:" is 22 tokens
    assert j.encode("hi") == tok("user: hi\nassistant:").input_ids

    class Gen:
        asked = []

        def generate_requests(self, requests):
            Gen.asked += requests
            return [(tok("Y").input_ids, [0.0], True) for _ in requests]

    j.generator = Gen()
    answers, failures = j.answers(["short", "a reply too long for a 24-token context"])
    assert answers == ["Y", None] and failures == [None, "too_long"]
    assert [(r[1], r[2]) for r in Gen.asked] == [(2, 0.0)]  # greedy, --judge_max_new_tokens
    j.chat = False
    assert j.encode("hi") == tok("hi").input_ids


def test_the_judge_is_resident_when_the_reward_models_are():
    from rlhf.runtime.offload import PHASES, plan_residency

    roles = ("actor", "ref", "reward", "judge")
    for p in PHASES:
        off = plan_residency(p, roles, ref_reward_offload=True)
        assert off["judge"] == off["reward"] and off["judge"].params == (p == "make_experience"), p
        assert plan_residency(p, roles, colocate_all=True)["judge"].params == (p == "make_experience"), p


@pytest.mark.parametrize("flags,needle", [
    ({"--judge_pretrain": "J", "--judge_url": "http://127.0.0.1:1/v1"}, "one judge, in the job or behind a URL"),
    ({"--judge_parser": "choice:Y=1,N=0"}, "--judge_parser choice:Y=1,N=0 needs --judge_pretrain or --judge_url"),
    ({"--judge_pretrain": "J", "--judge_template": "NOBRACES"}, "no {response} placeholder"),
    ({"--judge_pretrain": "J", "--judge_template": "/no/such/file"}, "--judge_template /no/such/file"),
    ({"--judge_pretrain": "J", "--judge_parser": "number:3:3"}, "LO must be below HI"),
    ({"--judge_pretrain": "J", "--judge_max_new_tokens": "0"}, "--judge_max_new_tokens must be >= 1"),
    ({"--judge_pretrain": "RM"}, "a sequence classifier"),
    ({"--judge_pretrain": "J", "--judge_model": "m"}, "--judge_model m names a served model: it needs --judge_url"),
    ({"--judge_url": "127.0.0.1:8000"}, "--judge_url must be an http(s) URL"),
    ({"--judge_url": "http://127.0.0.1:1/v1"}, "cannot connect to 127.0.0.1:1"),
    ({"--judge_pretrain": "J", "--dynamic_filtering": "", "--reward_fn": "_rule_reward:length_reward"},
     "does not combine with --reward_pretrain or an LLM judge"),
])
def test_ppo_bad_judge_flags(ppo_setup, judge_model, tmp_path, no_models, capsys, flags, needle):
    from rlhf.ppo import main

    tpl = tmp_path / "t.txt"
    tpl.write_text("no placeholder here")
    subst = {"J": judge_model, "RM": ppo_setup["rm"], "NOBRACES": str(tpl)}
    argv = ppo_args(ppo_setup, str(tmp_path / "o"), **{**TINY_GRPO, **{k: subst.get(v, v) for k, v in flags.items()}})
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and needle in err, err


# ------------------------------------------------------------------------------------------------- the jobs
@pytest.fixture(scope="session")
def judge_model(ppo_setup):
    return make_rule_judge(os.path.join(ppo_setup["work"], "rule_judge"), ppo_setup["actor"])


def test_the_scripted_judge_follows_its_rule_in_transformers(judge_model):
    """The judge's known verdicts, by transformers' own greedy generate, on random replies of the tiny tokenizer."""
    import random

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(judge_model)
    model = transformers.AutoModelForCausalLM.from_pretrained(judge_model)
    rng, seen = random.Random(0), set()
    for _ in range(48):
        reply = tok.decode([rng.randrange(3, len(tok)) for _ in range(rng.randint(1, 8))], skip_special_tokens=True)
        ids = tok.apply_chat_template([{"role": "user", "content": TEMPLATE.replace("{response}", reply)}],
                                      add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out = model.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id)
        answer = tok.decode(out[0, len(ids):])
        assert answer == ("Y" if rule(reply) else "N"), (reply, answer)
        seen.add(answer)
    assert seen == {"Y", "N"}


def _dumped(dump: str) -> list[dict]:
    return [torch.load(f)["experience"] for f in sorted(glob.glob(os.path.join(dump, "step*_rank*.pt")))]


def _replies(actor: str, exp: dict) -> list[str]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(actor)
    ids = exp["response_ids"]
    return tok.batch_decode(ids if isinstance(ids, list) else ids.tolist(), skip_special_tokens=True)


def test_judge_in_the_job_rewards_each_reply_by_its_verdict(ppo_setup, judge_model, tmp_path):
    """DP 2, GRPO, 2 steps: the judge's reward (weight 2) plus a rule reward (weight 0.5). Every rank's dumped raw
    reward of each reply is 2 * verdict + 0.5 * rule: a judge whose answers went to other replies (another rank's
    share, another sample) or whose weight were dropped would differ."""
    tpl = tmp_path / "judge.txt"
    tpl.write_text(TEMPLATE)
    save, dump = str(tmp_path / "o"), str(tmp_path / "dump")
    args = ppo_args(ppo_setup, save, **{**TINY_GRPO, "--rollout_batch_size": "8", "--train_batch_size": "16",
                                        "--micro_train_batch_size": "4", "--micro_rollout_batch_size": "4",
                                        "--max_samples": "16", "--rollout_backend": "megatron",
                                        "--judge_pretrain": judge_model, "--judge_template": str(tpl),
                                        "--judge_parser": "choice:Y=1,N=0", "--judge_max_new_tokens": "1",
                                        "--judge_weight": "2", "--reward_fn": "_rule_reward:length_reward",
                                        "--reward_fn_weight": "0.5", "--dump_experience": dump})
    p = run_torchrun(PPO, 2, args, timeout=300, PYTHONPATH=f"{REPO}{os.pathsep}{os.path.dirname(__file__)}")
    assert p.returncode == 0, tail(p)
    exps = _dumped(dump)
    assert len(exps) == 4  # 2 steps x 2 ranks
    verdicts = []
    for e in exps:
        replies = _replies(ppo_setup["actor"], e)
        want = [2.0 * rule(r) + 0.5 * min(len(r), 12) / 12 for r in replies]
        assert e["raw_rewards"].tolist() == pytest.approx(want, abs=1e-6), replies
        verdicts += [rule(r) for r in replies]
    assert 0 < sum(verdicts) < len(verdicts)  # both verdicts occur
    from rlhf.observability.metrics import read_metrics_jsonl

    rows = read_metrics_jsonl(os.path.join(save, "metrics.jsonl"), "ppo")
    assert all(rows[k]["judge/parse_failed"] == 0 and rows[k]["judge/too_long"] == 0 for k in rows)
    per_step = [sum(verdicts[:16]) / 16, sum(verdicts[16:]) / 16]  # the steps' mean verdicts, before the weight
    assert [rows[k]["reward/judge"] for k in sorted(rows)] == pytest.approx(per_step)


class _OpenAIJudge:
    """An OpenAI-compatible judge: ``/v1/models`` and ``/v1/chat/completions``, each request checked by the agents
    endpoint's own parser of OpenAI's bodies at temperature 0. It reads the reply back out of the template and
    answers ``[[A]]`` when the rule holds, else ``[[B]]``; a reply starting with a byte the tokenizer could not decode
    alone gets an answer no parser reads, and one ending with it HTTP 400."""

    def __init__(self):
        from rlhf.agents.openai_api import OpenAIError, parse_request

        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._send(200, {"object": "list", "data": [{"id": "rule-judge", "object": "model"}]})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                try:
                    req = parse_request(body, chat=True, temperature=0.0, top_p=1.0)
                except OpenAIError as e:
                    return self._send(e.status, e.body())
                assert self.path == "/v1/chat/completions" and req.model == "rule-judge" and req.max_tokens == 8
                reply = req.messages[-1]["content"].rsplit("\nverdict:", 1)[0]
                if reply.endswith("\ufffd"):
                    return self._send(400, {"error": {"message": "refused", "type": "invalid_request_error"}})
                answer = "I cannot tell" if reply.startswith("\ufffd") else "[[A]]" if rule(reply) else "[[B]]"
                self._send(200, {"id": "x", "object": "chat.completion", "model": req.model, "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]})

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def expected_url_verdict(reply: str) -> tuple[float, str | None]:
    if reply.endswith("\ufffd"):
        return 0.25, "refused"
    if reply.startswith("\ufffd"):
        return 0.25, "parse_failed"
    return float(rule(reply)), None


def test_judge_behind_openai_api_counts_what_it_cannot_read(ppo_setup, tmp_path, monkeypatch):
    """One rank in this process, the megatron generator: each reply's dumped raw reward is its verdict (A=1, B=0),
    --judge_fail_reward 0.25 for the unreadable and the refused ones, which the step's judge/* fractions count."""
    from helpers import free_port
    from rlhf.observability.metrics import read_metrics_jsonl
    from rlhf.ppo import main

    server = _OpenAIJudge()
    try:
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        tpl = tmp_path / "judge.txt"
        tpl.write_text(TEMPLATE)
        out, dump = tmp_path / "o", str(tmp_path / "dump")
        argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--rollout_backend": "megatron", "--max_samples": "8",
                                                "--judge_url": server.url, "--judge_template": str(tpl),
                                                "--judge_parser": "choice:[[A]]=1,[[B]]=0",
                                                "--judge_max_new_tokens": "8", "--judge_fail_reward": "0.25",
                                                "--dump_experience": dump})
        assert main(argv) == 0
    finally:
        server.close()
    assert len(server.requests) == 16 and all(r["model"] == "rule-judge" for r in server.requests)
    rows = read_metrics_jsonl(str(out / "metrics.jsonl"), "ppo")
    seen = set()
    for step, e in enumerate(_dumped(dump), start=1):
        replies = _replies(ppo_setup["actor"], e)
        want = [expected_url_verdict(r) for r in replies]
        assert e["raw_rewards"].tolist() == pytest.approx([w for w, _ in want], abs=1e-6), replies
        for k in ("parse_failed", "refused"):
            assert rows[step][f"judge/{k}"] == pytest.approx(sum(f == k for _, f in want) / len(want))
        seen |= {f for _, f in want}
    assert seen >= {None, "parse_failed", "refused"}, seen
