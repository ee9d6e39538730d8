"""Rewards from several sources, combined by a weighted sum: reward models and a rule function.

    --reward_pretrain a,b --reward_weights 0.7,0.3 [--normalize_reward] [--reward_fn mod:fn --reward_fn_weight 1]

    reward = sum_i w_i * norm_i(RM_i(prompt + response)) + w_fn * fn(prompts, responses)

Sources are named ``rm0``, ``rm1``, ... (in ``--reward_pretrain`` order) and ``fn``. Default weights are 1.0 each:
the sources are *summed*, as OpenRLHF sums several reward models. ``--normalize_reward`` maps each reward model
through its own ``(r - reward_mean) / reward_std`` (saved by ``launch/rm.py`` in its config.json under ``rlhf``)
before the sum; the rule function is never normalized.

A rule function is ``fn(prompts: list[str], responses: list[str]) -> list[float]``, one call per batch (the same
signature as ``--gold_reward_fn``): ``prompts`` are the prompt texts as the model saw them (template applied),
``responses`` the decoded replies without special tokens.

The reward models are frozen megatron engines (``rlhf.engine.ModelEngine`` with a value head); the score of a
sequence is the head's output at its last token, as HF ``*ForSequenceClassification`` computes it.
"""
from __future__ import annotations

import argparse
import importlib
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from rlhf.models.reward_format import reward_stats
from rlhf.part import Part

RewardFn = Callable[[list, list], list]


BUILTIN_REWARDS = {"code": "rlhf.sandbox.code_reward:code_reward"}
"""``--reward_fn NAME`` for the rewards shipped here: ``code`` runs each reply's program against its prompt's tests
in the sandbox (docs/code_rl.md)"""


def load_reward_fn(spec: str, flag: str = "--reward_fn") -> RewardFn:
    """``module:function`` (or a ``BUILTIN_REWARDS`` name) -> the function. ValueError naming ``flag`` when it
    cannot be imported or called."""
    spec = BUILTIN_REWARDS.get(spec, spec)
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{flag} must be module:function, got {spec!r}")
    mod, name = spec.split(":")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{flag} {spec}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{flag} {spec}: {type(fn).__name__} object is not callable")
    return fn


def takes_labels(fn) -> bool:
    """Whether a rule function has a ``labels`` parameter (then it gets each prompt's ``--label_key`` field)."""
    import inspect

    try:
        return "labels" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def call_reward_fn(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                   flag: str = "--reward_fn", labels: Sequence | None = None) -> torch.Tensor:
    """One float per response, checked. (N,) fp32. A function with a ``labels`` parameter also gets ``labels``
    (e.g. ``rlhf.verifiers:math_reward``)."""
    return call_reward_fn_full(fn, prompts, responses, flag, labels)[0]


def call_reward_fn_full(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                        flag: str = "--reward_fn", labels: Sequence | None = None) -> tuple[torch.Tensor, dict]:
    """``call_reward_fn``, and the function's ``extra_logs`` when it answers in OpenRLHF's reward-function shape
    (a dict with ``rewards`` and ``extra_logs``, as ``--reward_fn code`` does); {} otherwise."""
    out = fn(list(prompts), list(responses), labels=list(labels) if labels is not None else None) \
        if takes_labels(fn) else fn(list(prompts), list(responses))
    extra = {}
    if isinstance(out, dict):
        if "rewards" not in out:
            raise ValueError(f"{flag}: a dict answer needs 'rewards' (OpenRLHF's shape), got keys {sorted(out)}")
        out, extra = out["rewards"], dict(out.get("extra_logs") or {})
    try:
        vals = [float(v) for v in out]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{flag}: must return a list of floats, one per response; got {type(out).__name__} "
                         f"({e})") from None
    if len(vals) != len(responses):
        raise ValueError(f"{flag}: returned {len(vals)} values for {len(responses)} responses")
    return torch.tensor(vals, dtype=torch.float32), extra


def add_reward_args(g) -> None:
    """The reward sources of PPO and rejection sampling (``RewardConfig``)."""
    g.add_argument("--reward_pretrain", default=None,
                   help="reward model(s), comma-separated: HF *ForSequenceClassification folders or megatron "
                        "checkpoints (rlhf/rewards.py)")
    g.add_argument("--reward_weights", default=None, help="one weight per reward model (default 1.0 each: a sum)")
    g.add_argument("--reward_fn", default=None,
                   help="rule reward module:function, fn(prompts, responses) -> list[float]; alone or added; "
                        "'code': each reply's program run against its prompt's tests in the sandbox "
                        "(docs/code_rl.md)")
    g.add_argument("--reward_fn_weight", type=float, default=1.0, help="weight of --reward_fn in the sum")
    g.add_argument("--remote_rm_url", "--reward.remote_url", dest="remote_rm_url", default=None,
                   help="OpenRLHF's remote reward: an HTTP server (POST {query, prompts, labels} -> {rewards, scores, "
                        "extra_logs}) or a Python file with reward_func(queries, prompts, labels, **kwargs)")
    g.add_argument("--remote_rm_weight", type=float, default=1.0, help="weight of --remote_rm_url in the sum")
    g.add_argument("--remote_rm_timeout", type=float, default=120.0, help="seconds per request (retried 5 times)")
    g.add_argument("--normalize_reward", action="store_true",
                   help="each reward model's score through its saved mean/std (config.json 'rlhf') before the sum")


@dataclass
class RemoteRewards:
    """What OpenRLHF's reward functions and servers answer (``{"rewards", "scores", "extra_logs"}``)."""

    rewards: torch.Tensor
    """(N,) fp32: what the advantages are computed from"""
    scores: torch.Tensor | None = None
    """(N,) fp32 or None: what dynamic filtering looks at (OpenRLHF: "0-1 reward"); None: the rewards"""
    extra_logs: dict = field(default_factory=dict)
    """name -> a number or one number per query, logged as ``reward_extra/<name>`` (their mean)"""


def is_reward_file(url: str | None) -> bool:
    """``--remote_rm_url`` names a Python file with OpenRLHF's ``reward_func`` rather than an HTTP server."""
    return bool(url) and url.endswith(".py") and "://" not in url


def load_reward_file(path: str, flag: str = "--remote_rm_url"):
    """``reward_func`` of an OpenRLHF reward file, loaded as OpenRLHF loads it (a module from the file's path).
    ValueError naming ``flag`` when the file is missing, does not import, or has no callable ``reward_func``."""
    import importlib.util

    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file")
    spec = importlib.util.spec_from_file_location("reward_func", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"{flag} {path}: importing it failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, "reward_func", None)
    if not callable(fn):
        raise ValueError(f"{flag} {path}: defines no function reward_func(queries, prompts, labels, **kwargs)")
    return fn


_reward_files: dict[str, Callable] = {}


def _remote_answer(answer, n: int, flag: str) -> RemoteRewards:
    """OpenRLHF's answer forms: a dict with "rewards" (or "reward"), optional "scores" and "extra_logs"; or the
    rewards alone. Each checked: one float per query."""
    if isinstance(answer, Mapping):
        if "rewards" not in answer and "reward" not in answer:
            raise ValueError(f"{flag}: the answer has no 'rewards' (keys: {sorted(answer)})")
        rewards = answer.get("rewards", answer.get("reward"))
        scores, extra = answer.get("scores"), dict(answer.get("extra_logs") or {})
    else:
        rewards, scores, extra = answer, None, {}

    def vec(v, what):
        v = torch.as_tensor(v.tolist() if isinstance(v, torch.Tensor) else v, dtype=torch.float32).flatten()
        if v.numel() != n:
            raise ValueError(f"{flag}: {what} has {v.numel()} values for {n} queries")
        return v
    return RemoteRewards(rewards=vec(rewards, "rewards"), scores=None if scores is None else vec(scores, "scores"),
                         extra_logs=extra)


def call_remote_rm_full(url: str, queries: Sequence[str], prompts: Sequence[str], labels: Sequence | None = None,
                        *, timeout: float = 120.0, retries: int = 5, backoff: float = 1.0) -> RemoteRewards:
    """OpenRLHF's remote reward: a Python file's ``reward_func(queries, prompts, labels)`` (``is_reward_file``),
    called in this process, or a server: POST ``{"query": [prompt + response], "prompts": [...], "labels": [...]}``
    as JSON, read ``{"rewards": [...], "scores": [...], "extra_logs": {...}}`` (or ``"reward"``). A server is
    retried on connection errors and 5xx answers with exponential backoff; then ValueError naming --remote_rm_url."""
    labels = list(labels) if labels is not None else [None] * len(queries)
    if is_reward_file(url):
        if url not in _reward_files:
            _reward_files[url] = load_reward_file(url)
        return _remote_answer(_reward_files[url](list(queries), list(prompts), labels), len(queries),
                              f"--remote_rm_url {url}")
    import json
    import time
    import urllib.error
    import urllib.request

    body = json.dumps({"query": list(queries), "prompts": list(prompts), "labels": labels}).encode()
    last = ""
    for attempt in range(retries):
        try:
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                answer = json.loads(resp.read())
            break
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code} {e.reason}"
            if e.code < 500:
                raise ValueError(f"--remote_rm_url {url}: {last}") from None
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as e:
            last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        time.sleep(backoff * 2 ** attempt)
    else:
        raise ValueError(f"--remote_rm_url {url}: no answer after {retries} attempts ({last}); is the reward server "
                         f"running?")
    return _remote_answer(answer, len(queries), f"--remote_rm_url {url}")


def call_remote_rm(url: str, queries: Sequence[str], prompts: Sequence[str], labels: Sequence | None = None, *,
                   timeout: float = 120.0, retries: int = 5, backoff: float = 1.0) -> torch.Tensor:
    """The rewards of ``call_remote_rm_full``. (N,) fp32."""
    return call_remote_rm_full(url, queries, prompts, labels, timeout=timeout, retries=retries,
                               backoff=backoff).rewards


def check_remote_rm(url: str) -> None:
    """Before any model loads: a reward file that loads and defines ``reward_func``, or an http(s) URL where
    something listens at its host and port."""
    import socket
    import urllib.parse

    if is_reward_file(url):
        load_reward_file(url)
        return
    u = urllib.parse.urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"--remote_rm_url must be an http(s) URL, got {url!r}")
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=10).close()
    except OSError as e:
        raise ValueError(f"--remote_rm_url {url}: cannot connect to {u.hostname}:{port} ({e}); start the reward "
                         f"server first") from None


def _floats(flag: str, value: str | None, n: int) -> list[float]:
    if value is None:
        return [1.0] * n
    try:
        vals = [float(v) for v in value.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated numbers, got {value!r}") from None
    if len(vals) != n:
        raise ValueError(f"{flag} {value}: {len(vals)} weight(s) for {n} reward model(s) in --reward_pretrain")
    return vals


@dataclass
class RewardConfig(Part):
    """Which reward sources a job uses and how they combine (flags in parentheses): PPO's rewards part."""

    DERIVED = ("agent", "require_source")

    reward_pretrain: str | None = None
    """(--reward_pretrain) comma-separated reward models: HF *ForSequenceClassification folders or megatron
    checkpoints."""
    reward_weights: str | None = None
    """(--reward_weights) one weight per reward model, comma-separated; default 1.0 each (a plain sum)."""
    reward_fn: str | None = None
    """(--reward_fn) ``module:function`` rule reward, ``fn(prompts, responses) -> list[float]``."""
    reward_fn_weight: float = 1.0
    """(--reward_fn_weight) its weight in the sum."""
    normalize_reward: bool = False
    """(--normalize_reward) each reward model's score through its own saved mean/std before the sum."""
    remote_rm_url: str | None = None
    """(--remote_rm_url) a reward server in OpenRLHF's protocol (``call_remote_rm``)."""
    remote_rm_weight: float = 1.0
    """(--remote_rm_weight) its weight in the sum."""
    remote_rm_timeout: float = 120.0
    """(--remote_rm_timeout) seconds per request."""
    agent: bool = False
    """(--agent_func_path) the trajectories' environment rewards (the sum of each one's step rewards), weight 1."""
    require_source: bool = True
    """refuse a config without any source when built; PPO builds its part without and asks ``require_any`` among
    its checks across parts (after the agent's flags)"""
    paths: list[str] = field(init=False)
    weights: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.paths = [p for p in (self.reward_pretrain or "").split(",") if p]
        if self.reward_pretrain is not None and not self.paths:
            raise ValueError(f"--reward_pretrain must name at least one model, got {self.reward_pretrain!r}")
        if not self.paths and self.reward_weights is not None:
            raise ValueError(f"--reward_weights {self.reward_weights} needs --reward_pretrain")
        self.weights = _floats("--reward_weights", self.reward_weights, len(self.paths))
        if self.require_source:
            self.require_any()

    def require_any(self) -> None:
        if not self.paths and not self.reward_fn and not self.remote_rm_url and not self.agent:
            raise ValueError("no reward: pass --reward_pretrain (reward models), --reward_fn module:function, "
                             "--remote_rm_url http://host:port/path and/or --agent_func_path agent.py; or, for pure "
                             "on-policy distillation without a reward, --teacher_pretrain with --task_reward_coef 0")

    @classmethod
    def add_args(cls, g) -> None:
        add_reward_args(g)

    @classmethod
    def from_args(cls, args: argparse.Namespace, require_source: bool = True) -> "RewardConfig":  # type: ignore
        """From the parsed flags of PPO or rejection sampling (those without the agent's flag have no agent)."""
        return cls(reward_pretrain=args.reward_pretrain, reward_weights=getattr(args, "reward_weights", None),
                   reward_fn=getattr(args, "reward_fn", None),
                   reward_fn_weight=getattr(args, "reward_fn_weight", 1.0),
                   normalize_reward=getattr(args, "normalize_reward", False),
                   remote_rm_url=getattr(args, "remote_rm_url", None),
                   remote_rm_weight=getattr(args, "remote_rm_weight", 1.0),
                   remote_rm_timeout=getattr(args, "remote_rm_timeout", 120.0),
                   agent=bool(getattr(args, "agent_func_path", None)), require_source=require_source)

    @property
    def rm_names(self) -> list[str]:
        return [f"rm{i}" for i in range(len(self.paths))]

    @property
    def source_weights(self) -> dict[str, float]:
        """``{name: weight}`` of every source, reward models first, then ``fn``, then ``remote``."""
        out = dict(zip(self.rm_names, self.weights))
        if self.reward_fn:
            out["fn"] = self.reward_fn_weight
        if self.remote_rm_url:
            out["remote"] = self.remote_rm_weight
        if self.agent:
            out["agent"] = 1.0
        return out

    def validate_models(self, tp: int, pp: int) -> list[dict]:
        """Each reward model's config: a sequence classifier that fits the layout, with saved statistics when
        ``--normalize_reward``. Returns ``describe_source`` of each. Reads configs only; loads no weights."""
        from rlhf.models.source import describe_source
        from rlhf.models.spec import check_parallel_fit

        sources = []
        for path in self.paths:
            try:
                src = describe_source(path)
            except ValueError as e:
                raise ValueError(f"--reward_pretrain {path}: {e}") from None
            check_parallel_fit(src["spec"], tp, pp, src["padded_vocab"])
            if not src["spec"].is_seq_cls:
                raise ValueError(f"--reward_pretrain {path}: expected a *ForSequenceClassification model (a trained "
                                 f"reward model), got {src['hf_config'].get('architectures')}")
            if self.normalize_reward and reward_stats(src["hf_config"]) is None:
                raise ValueError(f"--normalize_reward: {path}/config.json has no reward statistics (rlhf.reward_mean/"
                                 f"reward_std saved by launch/rm.py, or OpenRLHF's mean/std); train the reward model "
                                 f"here or drop the flag")
            sources.append(src)
        if self.reward_fn:
            load_reward_fn(self.reward_fn)
        if self.remote_rm_url:
            check_remote_rm(self.remote_rm_url)
        return sources

    def norms(self, sources: Sequence[dict]) -> dict[str, tuple[float, float]]:
        """``{rm name: (mean, std)}`` with ``--normalize_reward``, else empty."""
        if not self.normalize_reward:
            return {}
        out = {}
        for name, src in zip(self.rm_names, sources):
            mean, std = reward_stats(src["hf_config"])
            out[name] = (mean, max(std, 1e-6))
        return out

    def describe(self) -> str:
        parts = [f"{w:g} x {n} ({p})" for n, p, w in zip(self.rm_names, self.paths, self.weights)]
        if self.reward_fn:
            parts.append(f"{self.reward_fn_weight:g} x fn ({self.reward_fn})")
        if self.remote_rm_url:
            parts.append(f"{self.remote_rm_weight:g} x remote ({self.remote_rm_url})")
        if self.agent:
            parts.append("the agent's environment rewards")
        return " + ".join(parts) + ("; reward models normalized by their saved mean/std" if self.normalize_reward
                                    else "")


def combine_rewards(scores: Mapping[str, torch.Tensor], weights: Mapping[str, float],
                    norms: Mapping[str, tuple[float, float]] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure. ``scores[name]`` (B,) raw score of each source. Returns ``(combined, raw_combined)``, both (B,):
    ``sum_k w_k * (s_k - mean_k) / std_k`` (normalized where ``norms`` has the source) and ``sum_k w_k * s_k``."""
    if set(scores) != set(weights):
        raise AssertionError(f"sources {sorted(scores)} vs weights {sorted(weights)}")
    norms = norms or {}
    combined = raw = None
    for name, s in scores.items():
        s = s.float()
        w = float(weights[name])
        mean, std = norms.get(name, (0.0, 1.0))
        c, r = w * (s - mean) / std, w * s
        combined = c if combined is None else combined + c
        raw = r if raw is None else raw + r
    return combined, raw


def source_metrics(scores: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """``reward/<name>``: the mean raw score of each source (over the tensors given, e.g. the global batch)."""
    return {f"reward/{k}": v.float().mean().item() for k, v in scores.items()}


def score_sequences(engine, seqs: Sequence[Sequence[int]], pad_id: int, micro_batch_size: int) -> torch.Tensor:
    """The reward model ``engine``'s score of each token sequence, DP-sharded, on every rank. (N,) fp32.

    Each data-parallel rank scores a contiguous share (the list is padded with copies of its last sequence to a
    multiple of DP); the shares are all-gathered in DP order."""
    from rlhf.distributed.collectives import dp_all_gather, to_all_stages
    from rlhf.models.outputs import sequence_scores

    mesh = engine.mesh
    n = len(seqs)
    per = -(-n // mesh.dp)
    if mesh.pp > 1:  # and one micro-batch size
        per = -(-per // micro_batch_size) * micro_batch_size
    padded = list(seqs) + [seqs[-1]] * (per * mesh.dp - n)
    local = padded[mesh.dp_rank * per:(mesh.dp_rank + 1) * per]
    width = max(len(s) for s in local)  # one width per rank: PP sends one activation shape per schedule call
    mbs = []
    for i in range(0, per, micro_batch_size):
        rows = local[i:i + micro_batch_size]
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for b, s in enumerate(rows):
            ids[b, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
            mask[b, :len(s)] = 1
        mbs.append({"input_ids": ids, "attention_mask": mask})

    from rlhf.models.context_parallel import reads_local_tokens

    outs = engine.forward(mbs, output="head",
                          read=reads_local_tokens(lambda batch, values: sequence_scores(values, batch)))
    mine = torch.cat([o["output"] for o in outs]) if outs else None
    mine = to_all_stages(mine, (per,), mesh)
    return dp_all_gather(mine.float().contiguous(), mesh)[:n]


def score_with_models(cfg: RewardConfig, seqs: Sequence[Sequence[int]], pad_id: int, micro_batch_size: int, mesh, *,
                      bf16: bool = False, transformer_impl: str | None = None) -> dict[str, torch.Tensor]:
    """Each reward model's score of every token sequence, ``{rm name: (N,)}`` on the host: one model resident at a
    time, data-parallel (``score_sequences``)."""
    import gc

    from rlhf.engine import ModelEngine

    scores: dict[str, torch.Tensor] = {}
    for name, path in zip(cfg.rm_names, cfg.paths):
        rm = ModelEngine(mesh, path, value_head=True, name=name, bf16=bf16, transformer_impl=transformer_impl)
        scores[name] = score_sequences(rm, seqs, pad_id, micro_batch_size).cpu()
        del rm
        gc.collect()
    return scores
