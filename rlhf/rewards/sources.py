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

The reward models are frozen megatron engines (``rlhf.runtime.role.ModelRole`` with a value head); the score of a
sequence is the head's output at its last token, as HF ``*ForSequenceClassification`` computes it.
"""
from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from rlhf.models.reward_format import reward_stats
from rlhf.config.part import Part, flag
from rlhf.rewards.remote import (RemoteRewards, call_remote_rm, call_remote_rm_full,  # noqa: F401 (re-exported)
                            check_remote_rm, is_reward_file, load_reward_file)

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
    (e.g. ``rlhf.rewards.verifiers:math_reward``)."""
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

    DERIVED = ("agent", "judge", "require_source")

    reward_pretrain: str | None = flag(default=None,
                                       help="reward model(s), comma-separated: HF *ForSequenceClassification "
                                            "folders or megatron checkpoints (rlhf/rewards/sources.py)")
    """(--reward_pretrain) comma-separated reward models: HF *ForSequenceClassification folders or megatron
    checkpoints."""
    reward_weights: str | None = flag(default=None, help="one weight per reward model (default 1.0 each: a sum)")
    """(--reward_weights) one weight per reward model, comma-separated; default 1.0 each (a plain sum)."""
    reward_fn: str | None = flag(default=None,
                                 help="rule reward module:function, fn(prompts, responses) -> list[float]; alone or "
                                      "added; 'code': each reply's program run against its prompt's tests in the "
                                      "sandbox (docs/code_rl.md)")
    """(--reward_fn) ``module:function`` rule reward, ``fn(prompts, responses) -> list[float]``."""
    reward_fn_weight: float = flag(type=float, default=1.0, help="weight of --reward_fn in the sum")
    """(--reward_fn_weight) its weight in the sum."""
    normalize_reward: bool = flag(action="store_true", default=False,
                                  help="each reward model's score through its saved mean/std (config.json 'rlhf') "
                                       "before the sum")
    """(--normalize_reward) each reward model's score through its own saved mean/std before the sum."""
    remote_rm_url: str | None = flag("--remote_rm_url", "--reward.remote_url", dest="remote_rm_url", default=None,
                                     help="OpenRLHF's remote reward: an HTTP server (POST {query, prompts, labels} -> "
                                          "{rewards, scores, extra_logs}) or a Python file with reward_func(queries, "
                                          "prompts, labels, **kwargs)")
    """(--remote_rm_url) a reward server in OpenRLHF's protocol (``call_remote_rm``)."""
    remote_rm_weight: float = flag(type=float, default=1.0, help="weight of --remote_rm_url in the sum")
    """(--remote_rm_weight) its weight in the sum."""
    remote_rm_timeout: float = flag(type=float, default=120.0, help="seconds per request (retried 5 times)")
    """(--remote_rm_timeout) seconds per request."""
    agent: bool = False
    """(--agent_func_path) the trajectories' environment rewards (the sum of each one's step rewards), weight 1."""
    judge: float | None = None
    """(--judge_pretrain / --judge_url) the LLM judge's weight (--judge_weight; ``rlhf.rewards.judge``), None
    without a judge"""
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
        if not self.paths and not self.reward_fn and not self.remote_rm_url and not self.agent and self.judge is None:
            raise ValueError("no reward: pass --reward_pretrain (reward models), --reward_fn module:function, "
                             "--remote_rm_url http://host:port/path, --judge_pretrain / --judge_url (an LLM judge) "
                             "and/or --agent_func_path agent.py; or, for pure "
                             "on-policy distillation without a reward, --teacher_pretrain with --task_reward_coef 0")

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
                   agent=bool(getattr(args, "agent_func_path", None)),
                   judge=(getattr(args, "judge_weight", 1.0) if getattr(args, "judge_pretrain", None)
                          or getattr(args, "judge_url", None) else None), require_source=require_source)

    @property
    def rm_names(self) -> list[str]:
        return [f"rm{i}" for i in range(len(self.paths))]

    @property
    def source_weights(self) -> dict[str, float]:
        """``{name: weight}`` of every source: reward models first, then ``fn``, ``remote``, ``judge``, ``agent``."""
        out = dict(zip(self.rm_names, self.weights))
        if self.reward_fn:
            out["fn"] = self.reward_fn_weight
        if self.remote_rm_url:
            out["remote"] = self.remote_rm_weight
        if self.judge is not None:
            out["judge"] = self.judge
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
        if self.judge is not None:
            parts.append(f"{self.judge:g} x judge")
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

    from rlhf.runtime.role import ModelRole

    scores: dict[str, torch.Tensor] = {}
    for name, path in zip(cfg.rm_names, cfg.paths):
        rm = ModelRole(mesh, path, value_head=True, name=name, bf16=bf16, transformer_impl=transformer_impl)
        scores[name] = score_sequences(rm, seqs, pad_id, micro_batch_size).cpu()
        del rm
        gc.collect()
    return scores
