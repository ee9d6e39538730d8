"""An LLM judge as a reward source (``--judge_pretrain DIR`` or ``--judge_url URL``): each reply is put into a prompt
template with its prompt (and label), a language model answers greedily, and a parser turns the answer into a
reward. The judge joins the other sources of ``rlhf.rewards.sources`` as ``judge`` with ``--judge_weight``.

    --judge_pretrain judge/ --judge_template rubric.txt --judge_parser number:1:10 [--judge_weight 1]
    --judge_url http://host:8000/v1 [--judge_model NAME] ...

* The template is a text file with ``{prompt}`` (the prompt as the policy saw it), ``{response}`` (the decoded
  reply) and optionally ``{label}`` (the record's --label_key field); nothing else in it is special (braces of
  JSON stay as they are). Without ``--judge_template``: ``DEFAULT_TEMPLATE``, a 1-10 rating.
* The judge reads the rendered text as one user message through its own chat template (``--no-judge_chat_template``:
  the text as it is; a URL then gets ``/completions`` instead of ``/chat/completions``).
* ``--judge_parser``: ``number:LO:HI`` (the last number of the answer, which must lie in [LO, HI]; the reward is
  ``(x - LO) / (HI - LO)``, so rubrics of any scale give rewards in [0, 1]); ``choice:[[A]]=1,[[B]]=0`` (the
  choice whose string appears last in the answer; its value); or ``module:function`` (answer text -> a float, or
  None for an answer it cannot read). An answer the parser cannot read, a prompt longer than the judge's context,
  and a request the server refuses (HTTP 4xx) each get ``--judge_fail_reward`` and are counted
  (``judge/parse_failed``, ``judge/too_long``, ``judge/refused``: fractions of the step's replies); none stops the job.
  A server that does not answer at all after the retries does stop it (ValueError naming --judge_url), as
  ``--remote_rm_url`` does, rather than train on made-up rewards.

``--judge_pretrain`` is one more frozen model of the colocated job (HF folder or converted megatron checkpoint, its
own tokenizer): a megatron engine resident in make_experience only (``rlhf.runtime.offload.plan_residency``, like a
reward model), generating with the megatron generator (greedy, one forward per token: no KV cache, so no prefix
caching across a prompt's replies), data-parallel over the step's replies. A large judge is better served by
vLLM on other machines and reached with ``--judge_url`` (OpenAI's API: vLLM's, SGLang's or a hosted one), which
sends each rank's share of the replies, ``--judge_concurrency`` requests at a time."""
from __future__ import annotations

import argparse
import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from rlhf.config.part import Part, flag

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = """Rate how well the reply below answers the request, from 1 (useless or wrong) to 10 (correct, \
helpful and clear).

[Request]
{prompt}

[Reply]
{response}

Answer with the rating alone, in the form: Rating: [[N]]"""
"""the template without --judge_template (parsed with the default ``number:1:10``)"""

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


@dataclass
class JudgeParser:
    """An answer -> a reward, or None when the answer cannot be read (``parse_judge_parser`` builds it)."""

    spec: str
    kind: str
    lo: float = 0.0
    hi: float = 1.0
    choices: dict[str, float] = field(default_factory=dict)
    fn: Callable | None = None

    def __call__(self, text: str) -> float | None:
        if self.kind == "number":
            found = _NUMBER.findall(text)
            if not found:
                return None
            x = float(found[-1])
            if not (math.isfinite(x) and self.lo <= x <= self.hi):
                return None
            return (x - self.lo) / (self.hi - self.lo)
        if self.kind == "choice":
            at = {c: text.rfind(c) for c in self.choices}
            best = max(at, key=lambda c: (at[c], len(c)))  # the last; of two ending together, the longer
            return self.choices[best] if at[best] >= 0 else None
        v = self.fn(text)
        if v is None:
            return None
        v = float(v)
        return v if math.isfinite(v) else None


def parse_judge_parser(spec: str, flag: str = "--judge_parser") -> JudgeParser:
    """``number:LO:HI``, ``choice:STR=VALUE,...`` or ``module:function``; ValueError naming ``flag`` otherwise."""
    kind, _, rest = spec.partition(":")
    if kind == "number":
        try:
            lo, hi = (float(v) for v in rest.split(":"))
        except ValueError:
            raise ValueError(f"{flag} {spec!r}: number:LO:HI takes two numbers, e.g. number:1:10") from None
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"{flag} {spec!r}: LO must be below HI")
        return JudgeParser(spec, "number", lo=lo, hi=hi)
    if kind == "choice":
        choices = {}
        for item in rest.split(","):
            name, eq, value = item.rpartition("=")
            try:
                choices[name] = float(value)
            except ValueError:
                name = ""
            if not eq or not name:
                raise ValueError(f"{flag} {spec!r}: choice:STR=VALUE,... takes each choice with its reward, e.g. "
                                 f"choice:[[A]]=1,[[B]]=0; got {item!r}")
        if len(choices) < 2:
            raise ValueError(f"{flag} {spec!r}: a choice parser needs at least two choices")
        return JudgeParser(spec, "choice", choices=choices)
    if spec.count(":") == 1 and all(spec.split(":")):
        from rlhf.rewards.sources import load_reward_fn

        return JudgeParser(spec, "function", fn=load_reward_fn(spec, flag))
    raise ValueError(f"{flag} must be number:LO:HI, choice:STR=VALUE,... or module:function, got {spec!r}")


def render(template: str, prompt: str, response: str, label=None) -> str:
    """The template with its placeholders filled; only ``{prompt}``, ``{response}`` and ``{label}`` are replaced, in
    one pass (a reply that contains ``{label}`` stays as written)."""
    values = {"{prompt}": prompt, "{response}": response, "{label}": "" if label is None else str(label)}
    return re.sub(r"\{prompt\}|\{response\}|\{label\}", lambda m: values[m.group(0)], template)


@dataclass
class JudgePart(Part):
    """The LLM judge (``rlhf.rewards.judge``): where it runs, what it reads, how its answers become rewards."""

    judge_pretrain: str | None = flag(metavar="DIR", default=None,
                                      help="an LLM judge in the job: a causal LM (HF folder or megatron checkpoint, "
                                           "its own tokenizer) answering --judge_template greedily; its answer "
                                           "through --judge_parser is the 'judge' reward (rlhf/rewards/judge.py)")
    """(--judge_pretrain) the judge model, frozen, in the colocated job"""
    judge_url: str | None = flag(metavar="URL", default=None,
                                 help="an LLM judge behind OpenAI's API (vLLM's, SGLang's or a hosted one), e.g. "
                                      "http://host:8000/v1")
    """(--judge_url) an OpenAI-compatible server's base URL"""
    judge_model: str | None = flag(default=None, help="--judge_url: the model name to ask for (default: the first "
                                                      "the server lists at /models)")
    """(--judge_model) the served model's name; None: the first of ``GET /models``"""
    judge_template: str | None = flag(metavar="FILE", default=None,
                                      help="the judge's prompt: a text file with {prompt}, {response} and optionally "
                                           "{label} (default: a 1-10 rating, parsed with number:1:10)")
    """(--judge_template) a text file with ``{prompt}``, ``{response}``, optionally ``{label}``"""
    judge_parser: str = flag(default="number:1:10",
                             help="number:LO:HI (the answer's last number, reward (x-LO)/(HI-LO)), "
                                  "choice:[[A]]=1,[[B]]=0 (the choice appearing last) or module:function "
                                  "(text -> float or None)")
    """(--judge_parser) how an answer becomes a reward (``parse_judge_parser``)"""
    judge_weight: float = flag(type=float, default=1.0, help="weight of the judge's reward in the sum")
    """(--judge_weight) its weight in the sum of the reward sources"""
    judge_max_new_tokens: int = flag(type=int, default=32, help="tokens of the judge's answer at most")
    """(--judge_max_new_tokens)"""
    judge_fail_reward: float = flag(type=float, default=0.0,
                                    help="the reward of a reply whose judgement failed (an answer the parser cannot "
                                         "read, a prompt past the judge's context, a refused request); counted as "
                                         "judge/parse_failed, judge/too_long, judge/refused")
    """(--judge_fail_reward)"""
    judge_chat_template: bool = flag(action=argparse.BooleanOptionalAction, default=True,
                                     help="the rendered template as one user message through the judge's chat "
                                          "template (--no-judge_chat_template: the text as it is; a URL then gets "
                                          "/completions)")
    """(--judge_chat_template / --no-judge_chat_template)"""
    judge_timeout: float = flag(type=float, default=120.0, help="--judge_url: seconds per request (retried 5 times)")
    """(--judge_timeout)"""
    judge_concurrency: int = flag(type=int, default=8, help="--judge_url: requests in flight per rank")
    """(--judge_concurrency)"""
    parser: JudgeParser | None = field(init=False, default=None)
    template: str = field(init=False, default=DEFAULT_TEMPLATE)

    @property
    def enabled(self) -> bool:
        return bool(self.judge_pretrain or self.judge_url)

    def check(self) -> None:
        if self.judge_pretrain and self.judge_url:
            raise ValueError(f"--judge_pretrain {self.judge_pretrain} and --judge_url {self.judge_url}: one judge, "
                             "in the job or behind a URL")
        if not self.enabled:
            for name, default in (("judge_model", None), ("judge_template", None), ("judge_parser", "number:1:10"),
                                  ("judge_weight", 1.0), ("judge_max_new_tokens", 32), ("judge_fail_reward", 0.0),
                                  ("judge_chat_template", True), ("judge_timeout", 120.0),
                                  ("judge_concurrency", 8)):
                if getattr(self, name) != default:
                    raise ValueError(f"--{name} {getattr(self, name)} needs --judge_pretrain or --judge_url (there "
                                     "is no judge)")
            return
        if self.judge_model and not self.judge_url:
            raise ValueError(f"--judge_model {self.judge_model} names a served model: it needs --judge_url")
        for name in ("judge_max_new_tokens", "judge_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if not self.judge_timeout > 0:
            raise ValueError(f"--judge_timeout must be > 0, got {self.judge_timeout}")
        for name in ("judge_weight", "judge_fail_reward"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"--{name} must be finite, got {getattr(self, name)}")
        self.parser = parse_judge_parser(self.judge_parser)
        if self.judge_template:
            try:
                with open(self.judge_template, encoding="utf-8") as f:
                    self.template = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"--judge_template {self.judge_template}: {type(e).__name__}: {e}") from None
            if "{response}" not in self.template:
                raise ValueError(f"--judge_template {self.judge_template}: no {{response}} placeholder, so the judge "
                                 "would never see the reply it grades")

    def describe(self) -> str:
        where = self.judge_pretrain or f"{self.judge_url} ({self.judge_model or 'its first model'})"
        return f"{self.judge_weight:g} x judge ({where}, {self.judge_parser})"


# ------------------------------------------------------------------------------------------------ the judgement
@dataclass
class Verdicts:
    """One judgement per reply: its reward and why it failed, if it did."""

    rewards: list[float]
    failures: list[str | None]
    """None, or "parse_failed" / "too_long" / "refused\""""
    answers: list[str]


def verdicts(parser: JudgeParser, answers: Sequence[str | None], failures: Sequence[str | None],
             fail_reward: float) -> Verdicts:
    """The parser over the judge's answers (None where the request failed, with its reason in ``failures``)."""
    rewards, why = [], []
    for a, f in zip(answers, failures):
        r = None if f is not None else parser(a)
        if r is None and f is None:
            f = "parse_failed"
        rewards.append(fail_reward if r is None else r)
        why.append(f)
    return Verdicts(rewards, why, [a or "" for a in answers])


FAILURES = ("parse_failed", "too_long", "refused")


class Judge:
    """The judge of a job: ``score(prompts, responses, labels)`` -> ``Verdicts`` (a reward and a failure reason
    per reply). ``collective``: every rank must call with the same, global lists (the in-job model); else each rank
    calls with its own share (a URL)."""

    collective = False

    def __init__(self, cfg: JudgePart):
        self.cfg = cfg

    def answers(self, texts: list[str]) -> tuple[list[str | None], list[str | None]]:  # pragma: no cover
        raise NotImplementedError

    def score(self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence | None = None) -> Verdicts:
        labels = list(labels) if labels is not None else [None] * len(prompts)
        texts = [render(self.cfg.template, p, r, lab) for p, r, lab in zip(prompts, responses, labels)]
        answers, failures = self.answers(texts)
        return verdicts(self.cfg.parser, answers, failures, self.cfg.judge_fail_reward)


class ModelJudge(Judge):
    """``--judge_pretrain``: a frozen megatron engine (``role``) generating greedily with the megatron generator,
    the replies shared over the data-parallel ranks (``MegatronRollout.generate_requests``)."""

    collective = True

    def __init__(self, cfg: JudgePart, role, mesh):
        from rlhf.models.source import load_tokenizer
        from rlhf.rollout.megatron_generator import MegatronRollout
        from rlhf.rollout.types import RolloutConfig

        super().__init__(cfg)
        self.role, self.mesh = role, mesh
        self.tokenizer = load_tokenizer(cfg.judge_pretrain, "--judge_pretrain")
        self.generator = MegatronRollout(mesh, role, RolloutConfig(backend="megatron"), announce=False)
        hf = role.source["hf_config"]
        self.max_len = int(hf.get("max_position_embeddings") or 1 << 30)
        self.chat = cfg.judge_chat_template and getattr(self.tokenizer, "chat_template", None) is not None

    def encode(self, text: str) -> list[int]:
        if self.chat:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer(text).input_ids)

    def answers(self, texts: list[str]) -> tuple[list[str | None], list[str | None]]:
        ids = [self.encode(t) for t in texts]
        room = self.max_len - self.cfg.judge_max_new_tokens
        fits = [i for i, x in enumerate(ids) if 0 < len(x) <= room]
        requests = [(ids[i], self.cfg.judge_max_new_tokens, 0.0, 1.0, i) for i in fits]
        out = self.generator.generate_requests(requests) if requests else []
        answers: list[str | None] = [None] * len(texts)
        failures: list[str | None] = ["too_long"] * len(texts)
        for i, (toks, _, _) in zip(fits, out):
            answers[i], failures[i] = self.tokenizer.decode(toks, skip_special_tokens=True), None
        return answers, failures


def base_url(url: str) -> str:
    """``http://host:port[/v1]`` or a full ``.../chat/completions`` / ``.../completions`` URL -> the API's base."""
    url = url.rstrip("/")
    for tail in ("/chat/completions", "/completions"):
        if url.endswith(tail):
            return url[: -len(tail)]
    return url


def _http_json(url: str, body: dict | None, timeout: float) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def served_model(url: str, timeout: float = 30.0) -> str:
    """The first model a server lists at ``GET <base>/models``; ValueError naming --judge_url when there is none
    or the server does not answer."""
    import urllib.error

    try:
        data = _http_json(base_url(url) + "/models", None, timeout)
        return str(data["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"--judge_url {url}: GET {base_url(url)}/models gave no model ({type(e).__name__}: {e}); "
                         "is the server running? Or name the model with --judge_model") from None


class URLJudge(Judge):
    """``--judge_url``: OpenAI's ``/chat/completions`` (or ``/completions`` with --no-judge_chat_template) at
    temperature 0, ``--judge_concurrency`` requests in flight; connection errors and 5xx answers retried with
    exponential backoff, 4xx answers counted as ``refused``."""

    def __init__(self, cfg: JudgePart, retries: int = 5, backoff: float = 1.0):
        super().__init__(cfg)
        self.base = base_url(cfg.judge_url)
        self.model = cfg.judge_model or served_model(cfg.judge_url)
        self.retries, self.backoff = retries, backoff

    def _one(self, text: str) -> tuple[str | None, str | None]:
        import time
        import urllib.error

        cfg = self.cfg
        common = {"model": self.model, "temperature": 0.0, "max_tokens": cfg.judge_max_new_tokens, "n": 1}
        if cfg.judge_chat_template:
            url, body = self.base + "/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
        else:
            url, body = self.base + "/completions", {**common, "prompt": text}
        last = ""
        for attempt in range(self.retries):
            try:
                data = _http_json(url, body, cfg.judge_timeout)
                choice = data["choices"][0]
                text_out = choice["message"]["content"] if cfg.judge_chat_template else choice["text"]
                return text_out or "", None
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} {e.reason}"
                if e.code < 500:
                    log.warning("--judge_url %s: a request was refused (%s); counted as judge/refused", url, last)
                    return None, "refused"
            except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            except (KeyError, IndexError, TypeError) as e:
                raise ValueError(f"--judge_url {url}: the answer is not OpenAI's ({type(e).__name__}: {e})") from None
            time.sleep(self.backoff * 2 ** attempt)
        raise ValueError(f"--judge_url {url}: no answer after {self.retries} attempts ({last}); is the judge's server "
                         "running?")

    def answers(self, texts: list[str]) -> tuple[list[str | None], list[str | None]]:
        from concurrent.futures import ThreadPoolExecutor

        if not texts:
            return [], []
        with ThreadPoolExecutor(min(self.cfg.judge_concurrency, len(texts))) as pool:
            out = list(pool.map(self._one, texts))
        return [a for a, _ in out], [f for _, f in out]


def check_judge(cfg: JudgePart, tp: int, pp: int) -> dict | None:
    """Before any model loads: the judge model's config (a causal LM that fits the layout, with a tokenizer;
    its ``describe_source``), or a server that lists a model. None without a judge or with a URL."""
    if cfg.judge_url:
        from rlhf.rewards.remote import check_remote_rm

        if not cfg.judge_url.startswith(("http://", "https://")):  # never a reward file, as --remote_rm_url may be
            raise ValueError(f"--judge_url must be an http(s) URL (an OpenAI-compatible server), got "
                             f"{cfg.judge_url!r}")
        check_remote_rm(cfg.judge_url, flag="--judge_url", what="the judge's server")
        if cfg.judge_model is None:
            cfg.judge_model = served_model(cfg.judge_url)
        return None
    if not cfg.judge_pretrain:
        return None
    from rlhf.models.source import check_tokenizer_folder, describe_source
    from rlhf.models.spec import check_parallel_fit

    try:
        src = describe_source(cfg.judge_pretrain)
    except ValueError as e:
        raise ValueError(f"--judge_pretrain {cfg.judge_pretrain}: {e}") from None
    if src["spec"].is_seq_cls:
        raise ValueError(f"--judge_pretrain {cfg.judge_pretrain}: a sequence classifier "
                         f"({src['hf_config'].get('architectures')}) gives scores, not answers; pass it as "
                         "--reward_pretrain, or give a causal LM as the judge")
    check_parallel_fit(src["spec"], tp, pp, src["padded_vocab"])
    check_tokenizer_folder(cfg.judge_pretrain, "--judge_pretrain")
    return src


def judge_metrics(failures: Sequence[str | None], mesh) -> dict[str, float]:
    """``judge/<reason>``: the fraction of the step's replies (all ranks') whose judgement failed so."""
    from rlhf.distributed.collectives import dp_all_gather

    local = torch.tensor([[float(f == k) for k in FAILURES] for f in failures], dtype=torch.float32)
    if local.numel() == 0:
        local = torch.zeros(0, len(FAILURES))
    every = dp_all_gather(local.to(mesh.device), mesh).cpu()
    if every.shape[0] == 0:
        return {}
    return {f"judge/{k}": v for k, v in zip(FAILURES, every.mean(dim=0).tolist())}


def make_judge(cfg: JudgePart, role, mesh) -> Judge | None:
    """The job's judge: ``ModelJudge`` over the judge's engine (``role``), ``URLJudge``, or None without one."""
    if cfg.judge_pretrain:
        return ModelJudge(cfg, role, mesh)
    if cfg.judge_url:
        return URLJudge(cfg)
    return None
