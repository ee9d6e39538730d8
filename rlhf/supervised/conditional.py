"""Conditional SFT (OpenRLHF's "csft"): every training prompt is prefixed with the bucket of its reward score, so
the model learns what a good answer looks like *given* the prefix; at inference, prompt with the top bucket.

    torchrun --nproc_per_node 2 launch/sft.py --conditional --reward_pretrain <rm> --reward_buckets 5 \
        --pretrain <policy> --dataset sft.jsonl --save_path out/csft ...
    torchrun ... launch/sft.py --conditional --score_key score ...   # scores already in the data (no RM)

Scores: the reward model's score of each (prompt, response), rendered exactly as SFT renders it (same template,
``prompt + response + eos``, first ``--max_len`` tokens) with the reward model's tokenizer, on the same megatron
stack and layout as the training run, data-parallel, gathered on every rank; or ``--score_key`` of each record.
Buckets: ``--reward_buckets K`` quantile buckets of the *training* records' scores (edges at the i/K quantiles,
linear interpolation; a score equal to an edge goes to the upper bucket), 0 = worst .. K-1 = best. Eval records
(``--eval_dataset`` / ``--eval_split``) are bucketed with the training edges.
Prefix: ``--conditional_template`` (default ``"<rm_score>: {bucket} "``) is put in front of the prompt field
before any template (a list of messages: in front of its first user message). It is part of the prompt, so it
is never in the loss. The export's config.json gets ``rlhf.supervised.conditional``: template, edges, top bucket and the
prefix to prompt with.
"""
from __future__ import annotations

import argparse
import bisect
import dataclasses
import logging
from typing import Any, Sequence

import torch

from rlhf.config.part import Part, flag

log = logging.getLogger("rlhf")

DEFAULT_TEMPLATE = "<rm_score>: {bucket} "


@dataclasses.dataclass
class ConditionalPart(Part):
    """Conditional SFT (``launch/sft.py --conditional``)."""

    GROUP = "conditional SFT"

    conditional: bool = flag(action="store_true", default=False,
                             help="prefix each prompt with its reward bucket (needs --reward_pretrain or --score_key)")
    """(--conditional) prefix each prompt with its reward bucket"""
    reward_pretrain: str | None = flag(default=None, help="--conditional: reward model that scores the data")
    """(--reward_pretrain) the reward model that scores the data"""
    score_key: str | None = flag(default=None, help="--conditional: a precomputed score field (no reward model)")
    """(--score_key) a precomputed score field"""
    reward_buckets: int = flag(type=int, default=5, help="--conditional: number of quantile buckets")
    """(--reward_buckets) quantile buckets"""
    conditional_template: str = flag(default=DEFAULT_TEMPLATE,
                                     help="--conditional: prefix put in front of the prompt; {bucket} is the bucket "
                                          "(0 = worst)")
    """(--conditional_template) the prefix; {bucket} is the bucket"""

    def check(self) -> None:
        used = [f for f, v in (("--reward_pretrain", self.reward_pretrain), ("--score_key", self.score_key),
                               ("--reward_buckets", self.reward_buckets != 5),
                               ("--conditional_template", self.conditional_template != DEFAULT_TEMPLATE)) if v]
        if not self.conditional:
            if used:
                raise ValueError(f"{used[0]} is a --conditional flag; pass --conditional too")
            return
        if bool(self.reward_pretrain) == bool(self.score_key):
            raise ValueError("--conditional needs exactly one score source: --reward_pretrain <reward model> or "
                             f"--score_key <field>; got --reward_pretrain {self.reward_pretrain!r} and --score_key "
                             f"{self.score_key!r}")
        if self.reward_buckets < 2:
            raise ValueError(f"--reward_buckets must be >= 2, got {self.reward_buckets}")
        try:
            self.conditional_template.format(bucket=0)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"--conditional_template {self.conditional_template!r}: only {{bucket}} may be used "
                             f"({type(e).__name__}: {e})") from None
        if "{bucket}" not in self.conditional_template:
            raise ValueError(f"--conditional_template {self.conditional_template!r} must contain {{bucket}}")
        if self.reward_pretrain and "," in self.reward_pretrain:
            raise ValueError(f"--reward_pretrain {self.reward_pretrain}: --conditional takes one reward model")


add_args = ConditionalPart.add_args


def validate(job) -> None:
    """Against the parallel layout, before any heavy work: the reward model that scores the data
    (``ConditionalPart.check`` checked the flags' own values)."""
    c = job.task["conditional"]
    if c.conditional and c.reward_pretrain:
        from rlhf.rewards.sources import RewardConfig

        RewardConfig(reward_pretrain=c.reward_pretrain).validate_models(job.parallel.tensor_model_parallel_size,
                                                                        job.parallel.pipeline_model_parallel_size)


def quantile_edges(scores: Sequence[float], k: int) -> list[float]:
    """The ``k - 1`` inner edges of ``k`` quantile buckets: the i/k quantiles (i = 1..k-1), linear interpolation
    between order statistics (numpy's default)."""
    t = torch.tensor(list(scores), dtype=torch.float64)
    q = torch.arange(1, k, dtype=torch.float64) / k
    return torch.quantile(t, q).tolist()


def bucket_of(score: float, edges: Sequence[float]) -> int:
    """0 .. len(edges): how many edges are <= ``score``."""
    return bisect.bisect_right(list(edges), score)


def prefix_prompt(value: Any, prefix: str) -> Any:
    """``prefix`` in front of a prompt string, or of the first user message of a message list."""
    if isinstance(value, str):
        return prefix + value
    msgs = [dict(m) for m in value]
    for m in msgs:
        if m.get("role") == "user":
            m["content"] = prefix + m["content"]
            return msgs
    raise ValueError(f"--conditional: no user message to prefix in {value!r}")


def _record_scores(records: list, key: str) -> list[float]:
    out = []
    for r in records:
        v = r.data.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{r.where}: --score_key {key!r} must be a number, got {v!r}")
        out.append(float(v))
    return out


def _rm_scores(job, cfg, records: list) -> list[float]:
    """The reward model's score of each record's (prompt, response), on the training layout. Builds the process
    group and megatron's groups (the trainer rebuilds the latter); the reward model is freed before returning."""
    import gc

    from rlhf.data import pad_token_id
    from rlhf.models.source import load_tokenizer
    from rlhf.data.formatting import sft_sample
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.runtime.role import ModelRole
    from rlhf.rewards.sources import score_sequences

    path, par, eng = job.task["conditional"].reward_pretrain, job.parallel, job.engine
    tok = load_tokenizer(path, "--reward_pretrain")
    seqs = [sft_sample(r, cfg, tok)[0].input_ids[:cfg.max_len].tolist() for r in records]
    from rlhf.models.source import expert_tensor_parallel_of

    mesh = initialize_mesh(par.tensor_model_parallel_size, par.pipeline_model_parallel_size, DistEnv.from_environ(),
                           seed=eng.seed, ep=par.expert_model_parallel_size, timeout_s=par.dist_timeout_s,
                           cp=par.context_parallel_size,
                           etp=expert_tensor_parallel_of([path], par.tensor_model_parallel_size))
    rm = ModelRole(mesh, path, value_head=True, name="reward", bf16=eng.bf16, transformer_impl=eng.transformer_impl)
    scores = score_sequences(rm, seqs, pad_token_id(tok), job.batch.micro_train_batch_size).tolist()
    del rm
    gc.collect()
    return scores


def load_conditional_split(job, tokenizer) -> tuple[list, list, dict[str, float], dict]:
    """Like ``rlhf.supervised.loop.load_split`` for SFT, with bucket prefixes. Returns (train, evals, data stats, the
    ``rlhf.supervised.conditional`` entry of the exported config)."""
    from rlhf.config.job import data_configs, hold_out
    from rlhf.data import build_sft_dataset
    from rlhf.data.build import load_records

    c = job.task["conditional"]
    cfg, eval_cfg = data_configs(job)
    train_rec, stats = load_records(cfg, "sft")
    if eval_cfg is not None:
        eval_rec, _ = load_records(eval_cfg, "sft")
    else:
        train_rec, eval_rec = hold_out(train_rec, job.data.eval_split)
    if c.score_key:
        scores = _record_scores(train_rec + eval_rec, c.score_key)
        source = f"--score_key {c.score_key}"
    else:
        scores = _rm_scores(job, cfg, train_rec + eval_rec)
        source = f"--reward_pretrain {c.reward_pretrain}"
    edges = quantile_edges(scores[:len(train_rec)], c.reward_buckets)
    buckets = [bucket_of(s, edges) for s in scores]

    def prefixed(recs: list, bks: list[int]) -> list:
        return [dataclasses.replace(r, data={**r.data, cfg.input_key: prefix_prompt(
            r.data[cfg.input_key], c.conditional_template.format(bucket=b))}) for r, b in zip(recs, bks)]

    train, st = build_sft_dataset(cfg, tokenizer, preloaded=(prefixed(train_rec, buckets), stats))
    evals = (build_sft_dataset(cfg, tokenizer, preloaded=(prefixed(eval_rec, buckets[len(train_rec):]),
                                                          type(stats)()))[0] if eval_rec else [])
    top = c.reward_buckets - 1
    counts = [buckets[:len(train_rec)].count(b) for b in range(c.reward_buckets)]
    info = {"template": c.conditional_template, "buckets": c.reward_buckets, "edges": edges,
            "top_bucket": top, "top_prefix": c.conditional_template.format(bucket=top), "score_source": source,
            "train_bucket_counts": counts}
    log.info("--conditional: %s; %d buckets, edges %s, train counts %s; prompt with %r at inference", source,
             c.reward_buckets, [round(e, 4) for e in edges], counts, info["top_prefix"])
    return train, evals, {k.split("/", 1)[1]: v for k, v in st.as_metrics().items() if "/mixed/" not in k}, info
