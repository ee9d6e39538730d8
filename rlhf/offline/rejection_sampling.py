"""Rejection sampling (best-of-N): sample N responses per prompt with the colocated vLLM engine, score them with
one or more reward models (and/or a rule function, ``rlhf/rewards/sources.py``), keep the best per prompt and write a
jsonl that ``launch/sft.py`` trains on as it is.

    torchrun --nproc_per_node 2 launch/rejection_sampling.py --pretrain <policy> --reward_pretrain rm_a,rm_b \
        --reward_weights 0.5,0.5 --dataset prompts.jsonl --input_key prompt --best_of_n 4 --output_path rs.jsonl

One SPMD job: every rank hosts a shard of a vLLM engine (``external_launcher``, TP ``--tp``); engine ``e`` samples
for its contiguous share of the prompts. The policy's weights reach vLLM through ``WeightSync`` from a frozen
megatron engine (so ``--pretrain`` may be an HF folder or a megatron checkpoint), which is freed before scoring.
The reward models are loaded one at a time and score the samples data-parallel; rank 0 writes the output with a
temporary file and ``os.replace``.

Output rows: ``{"input": <the prompt field as read>, "output": <best response text>, "score": <its combined
reward>}``: ``input``/``output`` are ``launch/sft.py``'s default keys; train with the same
``--apply_chat_template``/``--input_template`` as here. ``--candidates_path`` also writes every sample (token ids,
each source's raw score, the combined score, ``kept``). The reward models read ``prompt ids + response ids`` as
generated, as PPO's reward model does (they share the policy's tokenizer).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.config.part import Part, flag

log = logging.getLogger("rlhf")


@dataclass
class RejectionSamplingPart(Part):
    """Rejection sampling's own flags (the rest: ``RewardConfig``, ``SamplingPart``, ``ParallelPart``, ...)."""

    pretrain: str | None = flag(required=True, default=None, help="the policy: HF folder or megatron checkpoint")
    dataset: str | None = flag(required=True, default=None, help="comma-separated prompt files/folders")
    dataset_probs: str | None = flag(default=None)
    output_path: str | None = flag(required=True, default=None,
                                   help="jsonl: one row per prompt, the best response")
    candidates_path: str | None = flag(default=None, help="optional jsonl with every sample and its scores")
    best_of_n: int = flag(type=int, default=4, help="samples per prompt")
    micro_batch_size: int = flag(type=int, default=16, help="sequences per reward-model forward per rank")


def add_args(p: argparse.ArgumentParser) -> None:
    from rlhf.config.job import add_parallel_args, add_rollout_backend_args, add_sampling_args, add_text_args
    from rlhf.config.parts import EnginePart
    from rlhf.rewards.sources import RewardConfig

    own = RejectionSamplingPart.add_args
    g = p.add_argument_group("models")
    own(g, only=("pretrain",))
    RewardConfig.add_args(g)
    g = p.add_argument_group("data")
    own(g, only=("dataset", "dataset_probs"))
    add_text_args(g, input_key=True)
    own(g, only=("output_path", "candidates_path"))
    g = p.add_argument_group("sampling")
    own(g, only=("best_of_n",))
    add_sampling_args(g, max_new_tokens="--max_new_tokens")
    g = p.add_argument_group("placement")
    add_parallel_args(g, pp=False, tp_help="TP of the vLLM engines and of the megatron models", cp=False)
    own(g, only=("micro_batch_size",))
    add_rollout_backend_args(g)
    EnginePart.add_args(g, only=("bf16", "seed"))


def validate(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    """Flags and model configs, before any process group or model."""
    from rlhf.config.job import check_paths_exist
    from rlhf.distributed.mesh import validate_layout
    from rlhf.rewards.sources import RewardConfig
    from rlhf.rollout import plan_policy_generator

    tp = args.tensor_model_parallel_size
    validate_layout(world_size, tp, 1)
    for name in ("best_of_n", "max_new_tokens", "prompt_max_len", "micro_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    for flag, path in (("--output_path", args.output_path), ("--candidates_path", args.candidates_path)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"{flag} {path}: its folder does not exist")
    check_paths_exist("--dataset", args.dataset)
    rewards = RewardConfig.from_args(args)
    rm_sources = rewards.validate_models(tp, 1)
    src, rcfg, use_vllm = plan_policy_generator(args, world_size)
    return {"source": src, "rewards": rewards, "rm_sources": rm_sources, "rollout": rcfg, "use_vllm": use_vllm}


def load_prompts(args: argparse.Namespace, tokenizer) -> tuple[list, list]:
    """(raw prompt field values, PromptSamples), in data order (``--dataset_probs`` mixing and shuffling apply)."""
    from rlhf.data import DataConfig
    from rlhf.data.build import load_prompts_with_raw

    return load_prompts_with_raw(DataConfig.from_args(args, output_key=None), tokenizer)


def pick_best(total: torch.Tensor, n_prompts: int, n: int) -> list[int]:
    """Index (into the prompt-major samples) of the best of each prompt's ``n`` samples; the first on ties."""
    return [p * n + int(torch.argmax(total[p * n:(p + 1) * n])) for p in range(n_prompts)]


def write_jsonl_atomic(path: str, rows: list[dict]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rlhf.data import pad_token_id
    from rlhf.models.source import load_tokenizer
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.health import check_config_consistency
    from rlhf.observability.metrics import setup_logging
    from rlhf.rewards.sources import score_with_models
    from rlhf.rollout import build_policy_generator

    env = DistEnv.from_environ()
    setup_logging(env.rank)
    v = validate(args, env.world_size)
    rewards = v["rewards"]
    tokenizer = load_tokenizer(args.pretrain)
    raw_inputs, prompts = load_prompts(args, tokenizer)
    from rlhf.models.source import expert_tensor_parallel_of

    mesh = initialize_mesh(args.tensor_model_parallel_size, 1, env, seed=args.seed,
                           ep=args.expert_model_parallel_size, timeout_s=args.dist_timeout_s,
                           etp=expert_tensor_parallel_of([args.pretrain], args.tensor_model_parallel_size))
    check_config_consistency(args)
    if mesh.is_rank0:
        log.info("rejection sampling: %d prompts x best of %d; reward = %s", len(prompts), args.best_of_n,
                 rewards.describe())
    rollout = None
    try:
        rollout = build_policy_generator(mesh, args.pretrain, v["source"], v["rollout"], use_vllm=v["use_vllm"],
                                         out_dir=os.path.dirname(os.path.abspath(args.output_path)),
                                         bf16=args.bf16, transformer_impl=getattr(args, "transformer_impl", None))
        ids = [p.prompt_ids.tolist() for p in prompts]
        engines = env.world_size // args.tensor_model_parallel_size
        ids += [ids[-1]] * (-len(ids) % engines)  # every engine gets an equal share; the copies are dropped
        samples = rollout.generate(ids, n=args.best_of_n, temperature=args.temperature, top_p=args.top_p,
                                   max_tokens=args.max_new_tokens, seed=args.seed)
        samples = [s for s in samples if s.prompt_index < len(prompts)]
        assert len(samples) == len(prompts) * args.best_of_n, "prompt-major, best_of_n samples per prompt"
        gc.collect()
        scores = score_with_models(rewards, [s.prompt_ids + s.response_ids for s in samples], pad_token_id(tokenizer),
                                   args.micro_batch_size, mesh, bf16=args.bf16,
                                   transformer_impl=getattr(args, "transformer_impl", None))
        result: dict[str, Any] = {"prompts": len(prompts), "samples": len(samples)}
        if mesh.is_rank0:
            result.update(write_best(args, v, samples, scores, prompts, raw_inputs, tokenizer))
        return result
    finally:
        from rlhf.rollout import shutdown

        shutdown(mesh, rollout)


def write_best(args: argparse.Namespace, v: dict, samples: list, scores: dict, prompts: list, raw_inputs: list,
               tokenizer) -> dict[str, float]:
    """Rank 0: the rule reward, the combined score, the best sample per prompt -> --output_path (and every
    sample -> --candidates_path). Returns the mean scores."""
    from rlhf.rewards.sources import call_remote_rm, call_reward_fn, combine_rewards, load_reward_fn

    rewards = v["rewards"]
    replies = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    texts = [prompts[s.prompt_index].prompt for s in samples]
    if rewards.reward_fn:
        scores["fn"] = call_reward_fn(load_reward_fn(rewards.reward_fn), texts, replies)
    if rewards.remote_rm_url:
        scores["remote"] = call_remote_rm(rewards.remote_rm_url, [t + r for t, r in zip(texts, replies)], texts,
                                          [prompts[s.prompt_index].label for s in samples],
                                          timeout=rewards.remote_rm_timeout)
    total, _ = combine_rewards(scores, rewards.source_weights, rewards.norms(v["rm_sources"]))
    best = pick_best(total, len(prompts), args.best_of_n)
    rows = [{"input": raw_inputs[samples[i].prompt_index], "output": replies[i], "score": total[i].item()}
            for i in best]
    write_jsonl_atomic(args.output_path, rows)
    if args.candidates_path:
        kept = set(best)
        write_jsonl_atomic(args.candidates_path, [
            {"prompt_index": s.prompt_index, "output": replies[i], "prompt_ids": s.prompt_ids,
             "response_ids": s.response_ids, "scores": {k: t[i].item() for k, t in scores.items()},
             "score": total[i].item(), "kept": i in kept} for i, s in enumerate(samples)])
    result = dict(mean_score_all=total.mean().item(), mean_score_best=total[best].mean().item(),
                  **{f"mean_{k}": t.mean().item() for k, t in scores.items()})
    log.info("rejection sampling: wrote %d rows to %s; mean score of all samples %.4f, of the kept %.4f",
             len(rows), args.output_path, result["mean_score_all"], result["mean_score_best"])
    return result


def main(argv=None) -> int:
    from rlhf.config.job import cli_main

    return cli_main(add_args, run, argv)
