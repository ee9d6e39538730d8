"""Offline evaluation of a checkpoint on a dataset in one SPMD job: n samples per prompt from the colocated generator
(vLLM, or the megatron fallback), scored by any reward source (reward models, a rule function or verifier such as
``rlhf.rewards.verifiers:math_reward``, the code sandbox, a remote reward, an LLM judge in the job or behind a URL;
combined by their weights), then pass@k
(the unbiased estimator), avg@k and maj@k (``rlhf.offline.eval_metrics``), as JSON and a table.

    torchrun --nproc_per_node 2 launch/evaluate.py --pretrain <HF dir or megatron checkpoint> --dataset math.jsonl \
        --input_key prompt --label_key answer --reward_fn rlhf.rewards.verifiers:math_reward \
        --n_samples_per_prompt 8 --max_new_tokens 512 --output_dir out/eval

Sharded over the ranks: each generation engine (world size / --tp of them) samples its share of a chunk's prompts,
the reward models score data-parallel, and the rule and remote rewards score each rank's share of the replies. The
work goes in chunks of ``--chunk_size`` prompts; rank 0 appends each to ``<output_dir>/samples.jsonl`` (one row a
sample: ``prompt_index``, ``sample_index``, ``input``, ``label``, ``output``, ``reward``, ``scores``, ``answer``,
``correct``, ``finished``; with a judge ``judge_failure``, None or why its judgement failed). A relaunch with the
same flags keeps the complete chunks (a torn tail is cut) and
continues; sampling seeds depend on the chunk, so the file ends as an uninterrupted run's. The metrics are computed
from the whole file, into ``results.json`` and ``results.md``. A sample is correct when its reward is at least
``--pass_threshold``; its answer (for maj@k) is ``--answer_fn``'s of the reply.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from rlhf.config.part import Part, flag
from rlhf.offline.chunked import agreed, append_rows, chunks, resume_point

log = logging.getLogger("rlhf")
SAMPLES, RESULTS, TABLE = "samples.jsonl", "results.json", "results.md"


@dataclass
class EvaluatePart(Part):
    """The offline evaluation's own flags (the rest: ``RewardConfig``, ``SamplingPart``, ``ParallelPart``, ...)."""

    pretrain: str | None = flag(required=True, default=None, help="the policy: HF folder or megatron checkpoint")
    dataset: str | None = flag(required=True, default=None, help="comma-separated prompt files/folders")
    dataset_probs: str | None = flag(default=None)
    label_key: str | None = flag(default=None, help="the field given to the reward as each prompt's label (the "
                                                    "answer a verifier checks, a program's tests)")
    output_dir: str | None = flag(required=True, default=None, help="samples.jsonl (resumable), results.json, "
                                                                    "results.md")
    n_samples_per_prompt: int = flag(type=int, default=4, help="samples per prompt (the n of pass@k)")
    k: str | None = flag(default=None, help="comma-separated k of pass@k, avg@k, maj@k (each 1..n; default 1, 2, "
                                            "4, ... up to n, and n)")
    pass_threshold: float = flag(type=float, default=1.0, help="a sample is correct when its reward is at least "
                                                               "this")
    answer_fn: str = flag(default="rlhf.rewards.verifiers:answer_of", help="module:function, reply -> answer string "
                                                                           "or None: maj@k's votes")
    chunk_size: int = flag(type=int, default=64, help="prompts per chunk")
    stop_after_chunks: int = flag(type=int, default=-1, help="stop (as if killed) after N chunks; tests")
    micro_batch_size: int = flag(type=int, default=16, help="sequences per reward-model forward per rank")

    def ks(self) -> list[int]:
        from rlhf.offline.eval_metrics import default_ks

        n = self.n_samples_per_prompt
        if self.k is None:
            return default_ks(n)
        try:
            ks = [int(x) for x in self.k.split(",")]
        except ValueError:
            raise ValueError(f"--k {self.k!r}: expected comma-separated integers") from None
        bad = [k for k in ks if not 1 <= k <= n]
        if bad:
            raise ValueError(f"--k {self.k}: each k must be in 1..--n_samples_per_prompt {n}, got {bad}")
        return sorted(set(ks))

    def check(self) -> None:
        for name in ("n_samples_per_prompt", "chunk_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        self.ks()


def add_args(p: argparse.ArgumentParser) -> None:
    from rlhf.config.job import add_parallel_args, add_rollout_backend_args, add_sampling_args, add_text_args
    from rlhf.config.parts import EnginePart
    from rlhf.rewards.judge import JudgePart
    from rlhf.rewards.sources import RewardConfig

    own = EvaluatePart.add_args
    g = p.add_argument_group("models")
    own(g, only=("pretrain",))
    RewardConfig.add_args(g)
    JudgePart.add_args(p.add_argument_group("LLM judge"))
    g = p.add_argument_group("data")
    own(g, only=("dataset", "dataset_probs", "label_key"))
    add_text_args(g, input_key=True)
    g = p.add_argument_group("evaluation")
    own(g, only=("output_dir", "n_samples_per_prompt", "k", "pass_threshold", "answer_fn", "chunk_size",
                 "stop_after_chunks"))
    add_sampling_args(g, max_new_tokens="--max_new_tokens")
    g = p.add_argument_group("placement")
    add_parallel_args(g, pp=False, tp_help="TP of the vLLM engines and of the megatron models", cp=False)
    own(g, only=("micro_batch_size",))
    add_rollout_backend_args(g)
    EnginePart.add_args(g, only=("bf16", "seed"))


def validate(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    """Flags, paths and model configs, before any process group or model."""
    from rlhf.config.job import check_paths_exist
    from rlhf.distributed.mesh import validate_layout
    from rlhf.rewards.judge import JudgePart, check_judge
    from rlhf.rewards.sources import RewardConfig, load_reward_fn
    from rlhf.rollout import plan_policy_generator

    part = EvaluatePart.from_args(args)
    judge = JudgePart.from_args(args)
    validate_layout(world_size, args.tensor_model_parallel_size, 1)
    for name in ("max_new_tokens", "prompt_max_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise ValueError(f"--output_dir {args.output_dir}: not a folder")
    check_paths_exist("--dataset", args.dataset)
    rewards = RewardConfig.from_args(args)
    rm_sources = rewards.validate_models(args.tensor_model_parallel_size, 1)
    check_judge(judge, args.tensor_model_parallel_size, 1)
    load_reward_fn(args.answer_fn, "--answer_fn")
    src, rcfg, use_vllm = plan_policy_generator(args, world_size)
    return {"part": part, "ks": part.ks(), "rewards": rewards, "rm_sources": rm_sources, "source": src,
            "rollout": rcfg, "use_vllm": use_vllm, "judge": judge}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rlhf.data import DataConfig
    from rlhf.data.build import load_prompts_with_raw
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.health import check_config_consistency
    from rlhf.models.source import load_tokenizer
    from rlhf.observability.metrics import setup_logging

    env = DistEnv.from_environ()
    setup_logging(env.rank)
    v = validate(args, env.world_size)
    tokenizer = load_tokenizer(args.pretrain)
    raw, prompts = load_prompts_with_raw(DataConfig.from_args(args, output_key=None), tokenizer)
    from rlhf.models.source import expert_tensor_parallel_of

    mesh = initialize_mesh(args.tensor_model_parallel_size, 1, env, seed=args.seed,
                           ep=args.expert_model_parallel_size, timeout_s=args.dist_timeout_s,
                           etp=expert_tensor_parallel_of([args.pretrain], args.tensor_model_parallel_size))
    check_config_consistency(args)
    path = os.path.join(args.output_dir, SAMPLES)
    if mesh.is_rank0:
        os.makedirs(args.output_dir, exist_ok=True)
        log.info("evaluate: %d prompts x %d samples; reward = %s; correct when >= %g", len(prompts),
                 args.n_samples_per_prompt, v["rewards"].describe(), args.pass_threshold)
    done = agreed(resume_point(path, args.chunk_size * args.n_samples_per_prompt) if mesh.is_rank0 else 0)
    written = sample_chunks(args, v, prompts, raw, tokenizer, mesh, path, done)
    result: dict[str, Any] = {"prompts": len(prompts), "resumed_chunks": done, "rows_written": written}
    if mesh.is_rank0:
        result.update(write_results(args, v, path, len(prompts)))
    return result


def sample_chunks(args, v: dict, prompts: list, raw: list, tokenizer, mesh, path: str, done: int) -> int:
    """Every chunk after the ``done`` first: generate, score, append (rank 0). Returns the rows written."""
    from rlhf.rewards.judge import make_judge
    from rlhf.rewards.sources import load_reward_fn
    from rlhf.rollout import build_policy_generator, shutdown
    from rlhf.runtime.role import ModelRole

    n, rewards = args.n_samples_per_prompt, v["rewards"]
    answer_fn = load_reward_fn(args.answer_fn, "--answer_fn")
    rollout, written = None, 0
    try:
        rollout = build_policy_generator(mesh, args.pretrain, v["source"], v["rollout"], use_vllm=v["use_vllm"],
                                         out_dir=args.output_dir, bf16=args.bf16, transformer_impl=None)
        rms = {name: ModelRole(mesh, p, value_head=True, name=name, bf16=args.bf16)
               for name, p in zip(rewards.rm_names, rewards.paths)}
        judge = make_judge(v["judge"], ModelRole(mesh, v["judge"].judge_pretrain, value_head=False, name="judge",
                                                 bf16=args.bf16) if v["judge"].judge_pretrain else None, mesh)
        engines = mesh.world_size // args.tensor_model_parallel_size
        for k, lo, hi in chunks(len(prompts), args.chunk_size, done, args.stop_after_chunks):
            ids = [p.prompt_ids.tolist() for p in prompts[lo:hi]]
            ids += [ids[-1]] * (-len(ids) % engines)  # an equal share per engine; the copies are dropped
            samples = rollout.generate(ids, n=n, temperature=args.temperature, top_p=args.top_p,
                                       max_tokens=args.max_new_tokens, seed=args.seed + k)
            samples = [s for s in samples if s.prompt_index < hi - lo]
            replies = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
            total, scores, failures = score_chunk(v, rms, samples, replies, prompts[lo:hi], tokenizer, mesh,
                                                  args.micro_batch_size, judge)
            if mesh.is_rank0:
                rows = []
                for j, (s, reply) in enumerate(zip(samples, replies)):
                    p = lo + s.prompt_index
                    rows.append({"prompt_index": p, "sample_index": j % n, "input": raw[p], "label": prompts[p].label,
                                 "output": reply, "reward": total[j].item(),
                                 "scores": {name: t[j].item() for name, t in scores.items()},
                                 "answer": answer_fn(reply), "correct": total[j].item() >= args.pass_threshold,
                                 "finished": s.finished, **({"judge_failure": failures[j]} if judge else {})})
                append_rows(path, rows)
            written += len(samples)
    finally:
        shutdown(mesh, rollout)
    return written


def score_chunk(v: dict, rms: dict, samples: list, replies: list[str], prompts: list, tokenizer, mesh,
                micro_batch_size: int, judge=None):
    """(combined reward (N,), {source: (N,)}, the judge's failure per sample or None) of a chunk's samples, on every
    rank: the reward models data-parallel on prompt + response ids as generated (as PPO's), the rule and remote
    rewards and a URL judge each rank on its share, a judge in the job over every sample (it shares its answers
    out over the ranks itself)."""
    import torch
    import torch.distributed as dist

    from rlhf.data import pad_token_id
    from rlhf.rewards.sources import (call_remote_rm, call_reward_fn, combine_rewards, load_reward_fn,
                                      score_sequences)

    rewards = v["rewards"]
    scores = {name: score_sequences(rm, [s.prompt_ids + s.response_ids for s in samples], pad_token_id(tokenizer),
                                    micro_batch_size).cpu() for name, rm in rms.items()}
    mine = list(range(mesh.rank, len(samples), mesh.world_size))
    texts = [prompts[samples[i].prompt_index].prompt for i in mine]
    labels = [prompts[samples[i].prompt_index].label for i in mine]
    local: dict[str, list[float]] = {}
    if rewards.reward_fn and mine:
        local["fn"] = call_reward_fn(load_reward_fn(rewards.reward_fn), texts, [replies[i] for i in mine],
                                     labels=labels).tolist()
    if rewards.remote_rm_url and mine:
        local["remote"] = call_remote_rm(rewards.remote_rm_url, [t + replies[i] for t, i in zip(texts, mine)], texts,
                                         labels, timeout=rewards.remote_rm_timeout).tolist()
    failures: list = [None] * len(samples)
    if judge is not None and judge.collective:
        verdict = judge.score([prompts[s.prompt_index].prompt for s in samples], replies,
                              [prompts[s.prompt_index].label for s in samples])
        scores["judge"], failures = torch.tensor(verdict.rewards, dtype=torch.float32), list(verdict.failures)
    elif judge is not None and mine:
        verdict = judge.score(texts, [replies[i] for i in mine], labels)
        local["judge"], local["judge_failures"] = verdict.rewards, verdict.failures
    shares: list = [None] * mesh.world_size
    dist.all_gather_object(shares, (mine, local))
    if judge is not None and not judge.collective:
        for idx, got in shares:
            for i, f in zip(idx, got.get("judge_failures", [])):
                failures[i] = f
    for name in [s for s in ("fn", "remote", "judge") if s in rewards.source_weights and s not in scores]:
        full = torch.zeros(len(samples))
        for idx, got in shares:
            if idx:
                full[idx] = torch.tensor(got[name])
        scores[name] = full
    total, _ = combine_rewards(scores, rewards.source_weights, rewards.norms(v["rm_sources"]))
    return total, scores, failures


def write_results(args, v: dict, path: str, n_prompts: int) -> dict[str, Any]:
    """Rank 0: the metrics of the whole samples file into results.json and results.md (when every prompt has its
    samples; a run stopped early writes none)."""
    from rlhf.offline.eval_metrics import evaluate_groups, table

    n = args.n_samples_per_prompt
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    groups: dict[int, list] = {}
    for r in rows:
        groups.setdefault(r["prompt_index"], []).append(r)
    if sorted(groups) != list(range(n_prompts)) or any(len(g) != n for g in groups.values()):
        log.info("evaluate: %d of %d prompts sampled; no results yet (relaunch to continue)", len(groups), n_prompts)
        return {}
    ordered = [sorted(groups[p], key=lambda r: r["sample_index"]) for p in range(n_prompts)]
    metrics = evaluate_groups([[r["correct"] for r in g] for g in ordered], [[r["answer"] for r in g] for g in ordered],
                              [[r["reward"] for r in g] for g in ordered], v["ks"])
    md = table(metrics, v["ks"])
    out = {"metrics": metrics, "prompts": n_prompts, "n_samples_per_prompt": n, "k": v["ks"],
           "pass_threshold": args.pass_threshold, "pretrain": args.pretrain, "dataset": args.dataset,
           "reward": v["rewards"].describe(), "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
           "table": md}
    if v["judge"].enabled:  # the share of samples whose judgement failed, by reason (their judge_failure)
        from rlhf.rewards.judge import FAILURES

        out["judge_failures"] = {k: sum(r.get("judge_failure") == k for r in rows) / len(rows) for k in FAILURES}
    for name, text in ((RESULTS, json.dumps(out, indent=2)), (TABLE, md + "\n")):
        tmp = os.path.join(args.output_dir, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(args.output_dir, name))
    log.info("evaluate: %d prompts x %d samples (mean reward %.4f)\n%s", n_prompts, n, metrics["mean_reward"], md)
    return {"metrics": metrics}


def main(argv=None) -> int:
    from rlhf.config.job import cli_main

    return cli_main(add_args, run, argv)
