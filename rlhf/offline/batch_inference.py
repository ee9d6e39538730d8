"""Batch inference in one SPMD job: generate-only (vLLM, or the megatron fallback) or reward-only scoring (the
reward models, a rule function, a remote reward server), sharded over the ranks, written to a jsonl that a
killed job resumes (OpenRLHF's batch_inference, minus Ray).

    torchrun --nproc_per_node 2 launch/batch_inference.py --mode generate --pretrain <policy> \
        --dataset prompts.jsonl --input_key prompt --n_samples_per_prompt 4 --max_new_tokens 256 --output_path gen.jsonl
    torchrun --nproc_per_node 2 launch/batch_inference.py --mode reward --reward_pretrain <rm> \
        --dataset gen.jsonl --input_key input --output_key output --output_path scored.jsonl

Rows: ``generate``: ``{"prompt_index", "sample_index", "input": <the prompt field as read>, "output": <reply>,
"finished"}``; ``reward``: the input row plus ``"reward"`` (the combined reward) and ``"scores"`` (each source's).
The work goes in chunks of ``--chunk_size`` prompts (rows); rank 0 appends each finished chunk to
``--output_path`` and fsyncs it. A relaunch with the same flags keeps the complete chunks already written (a torn
tail is cut) and continues after them; sampling seeds depend on the chunk, so the file ends up as an uninterrupted
run's. The reward of a row is the reward model's score of prompt + response + EOS, tokenized as ``launch/rm.py``
trains on it.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from rlhf.config.part import Part, flag
from rlhf.offline.chunked import agreed, append_rows, chunks, resume_point


@dataclass
class BatchInferencePart(Part):
    """Batch inference's own flags (the rest: ``RewardConfig``, ``SamplingPart``, ``ParallelPart``, ...)."""

    mode: str | None = flag(choices=["generate", "reward"], required=True, default=None)
    pretrain: str | None = flag(default=None, help="generate: the policy; reward: the tokenizer (default: the first "
                                                   "--reward_pretrain)")
    dataset: str | None = flag(required=True, default=None,
                               help="comma-separated prompt (generate) or prompt+response files")
    dataset_probs: str | None = flag(default=None)
    output_key: str = flag(default="output", help="reward: the response field")
    output_path: str | None = flag(required=True, default=None,
                                   help="jsonl, appended chunk by chunk (resumable)")
    chunk_size: int = flag(type=int, default=256, help="prompts (generate) or rows (reward) per chunk")
    stop_after_chunks: int = flag(type=int, default=-1, help="stop (as if killed) after N chunks; tests")
    n_samples_per_prompt: int = flag(type=int, default=1)
    micro_batch_size: int = flag(type=int, default=16, help="sequences per reward-model forward per rank")
    max_len: int = flag(type=int, default=2048, help="reward: longer prompt+response keep their start")


def add_args(p: argparse.ArgumentParser) -> None:
    from rlhf.config.job import add_parallel_args, add_rollout_backend_args, add_sampling_args, add_text_args
    from rlhf.config.parts import EnginePart
    from rlhf.rewards.sources import RewardConfig

    own = BatchInferencePart.add_args
    g = p.add_argument_group("job")
    own(g, only=("mode", "pretrain"))
    RewardConfig.add_args(g)
    g = p.add_argument_group("data")
    own(g, only=("dataset", "dataset_probs"))
    add_text_args(g, input_key=True)
    own(g, only=("output_key", "output_path", "chunk_size", "stop_after_chunks"))
    g = p.add_argument_group("generation")
    own(g, only=("n_samples_per_prompt",))
    add_sampling_args(g, max_new_tokens="--max_new_tokens")
    g = p.add_argument_group("placement")
    add_parallel_args(g, pp=False, tp_help="TP of the vLLM engines and of the megatron models", cp=False)
    own(g, only=("micro_batch_size", "max_len"))
    add_rollout_backend_args(g)
    EnginePart.add_args(g, only=("bf16", "seed"))


def validate(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    """Flags, data paths and model configs, before any process group or model."""
    from rlhf.config.job import check_paths_exist
    from rlhf.distributed.mesh import validate_layout
    from rlhf.rewards.sources import RewardConfig

    validate_layout(world_size, args.tensor_model_parallel_size, 1)
    for name in ("chunk_size", "n_samples_per_prompt", "max_new_tokens", "prompt_max_len", "micro_batch_size",
                 "max_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output_path))):
        raise ValueError(f"--output_path {args.output_path}: its folder does not exist")
    check_paths_exist("--dataset", args.dataset)
    if args.mode == "generate":
        if not args.pretrain:
            raise ValueError("--mode generate needs --pretrain (the policy)")
        from rlhf.rollout import plan_policy_generator

        src, rcfg, use_vllm = plan_policy_generator(args, world_size)
        return {"source": src, "rollout": rcfg, "use_vllm": use_vllm}
    rewards = RewardConfig.from_args(args)
    return {"rewards": rewards, "rm_sources": rewards.validate_models(args.tensor_model_parallel_size, 1)}


# ----------------------------------------------------------------------------------------------------- the job
def run(args: argparse.Namespace) -> dict[str, Any]:
    from rlhf.data import DataConfig
    from rlhf.models.source import load_tokenizer
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.observability.metrics import setup_logging

    env = DistEnv.from_environ()
    setup_logging(env.rank)
    v = validate(args, env.world_size)
    tokenizer = load_tokenizer(args.pretrain or v["rewards"].paths[0],
                               "--pretrain" if args.pretrain else "--reward_pretrain")
    cfg = DataConfig.from_args(args, output_key=args.output_key if args.mode == "reward" else None)
    from rlhf.models.source import expert_tensor_parallel_of

    mesh = initialize_mesh(args.tensor_model_parallel_size, 1, env, seed=args.seed,
                           ep=args.expert_model_parallel_size, timeout_s=args.dist_timeout_s,
                           etp=expert_tensor_parallel_of([args.pretrain], args.tensor_model_parallel_size))
    job = generate_chunks if args.mode == "generate" else reward_chunks
    return job(args, v, cfg, tokenizer, mesh)


def generate_chunks(args: argparse.Namespace, v: dict, cfg, tokenizer, mesh) -> dict[str, Any]:
    """--mode generate: every prompt's --n_samples_per_prompt replies, chunk by chunk."""
    from rlhf.data.build import load_prompts_with_raw
    from rlhf.rollout import build_policy_generator, shutdown

    raw, prompts = load_prompts_with_raw(cfg, tokenizer)
    n = args.n_samples_per_prompt
    done = agreed(resume_point(args.output_path, args.chunk_size * n) if mesh.is_rank0 else 0)
    rollout = None
    written = 0
    try:
        rollout = build_policy_generator(mesh, args.pretrain, v["source"], v["rollout"], use_vllm=v["use_vllm"],
                                         out_dir=os.path.dirname(os.path.abspath(args.output_path)),
                                         bf16=args.bf16, transformer_impl=None)
        engines = mesh.world_size // args.tensor_model_parallel_size  # as rejection sampling spreads prompts
        for k, lo, hi in chunks(len(prompts), args.chunk_size, done, args.stop_after_chunks):
            ids = [p.prompt_ids.tolist() for p in prompts[lo:hi]]
            ids += [ids[-1]] * (-len(ids) % engines)  # an equal share per engine; the copies are dropped
            samples = rollout.generate(ids, n=n, temperature=args.temperature, top_p=args.top_p,
                                       max_tokens=args.max_new_tokens, seed=args.seed + k)
            samples = [s for s in samples if s.prompt_index < hi - lo]
            if mesh.is_rank0:
                replies = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
                append_rows(args.output_path, [
                    {"prompt_index": lo + s.prompt_index, "sample_index": j % n, "input": raw[lo + s.prompt_index],
                     "output": reply, "finished": s.finished} for j, (s, reply) in enumerate(zip(samples, replies))])
            written += len(samples)
    finally:
        shutdown(mesh, rollout)
    return {"prompts": len(prompts), "resumed_chunks": done, "rows_written": written}


def reward_chunks(args: argparse.Namespace, v: dict, cfg, tokenizer, mesh) -> dict[str, Any]:
    """--mode reward: each row's prompt + response scored by every reward source, chunk by chunk."""
    from rlhf.data import pad_token_id
    from rlhf.data.build import load_records
    from rlhf.data.formatting import sft_sample
    from rlhf.runtime.role import ModelRole
    from rlhf.rewards.sources import call_remote_rm, call_reward_fn, combine_rewards, load_reward_fn, score_sequences

    rewards = v["rewards"]
    records, _ = load_records(cfg, "sft")
    done = agreed(resume_point(args.output_path, args.chunk_size) if mesh.is_rank0 else 0)
    engines = {name: ModelRole(mesh, path, value_head=True, name=name, bf16=args.bf16)
               for name, path in zip(rewards.rm_names, rewards.paths)}
    fn = load_reward_fn(rewards.reward_fn) if rewards.reward_fn else None
    norms = rewards.norms(v["rm_sources"])
    written = 0
    for _, lo, hi in chunks(len(records), args.chunk_size, done, args.stop_after_chunks):
        chunk = records[lo:hi]
        seqs = [sft_sample(r, cfg, tokenizer)[0].input_ids[: args.max_len].tolist() for r in chunk]
        scores = {name: score_sequences(eng, seqs, pad_token_id(tokenizer), args.micro_batch_size).cpu()
                  for name, eng in engines.items()}
        if mesh.is_rank0:
            prompts = [str(r.data[cfg.input_key]) for r in chunk]
            replies = [str(r.data[cfg.output_key]) for r in chunk]
            if fn is not None:
                scores["fn"] = call_reward_fn(fn, prompts, replies)
            if rewards.remote_rm_url:
                scores["remote"] = call_remote_rm(rewards.remote_rm_url, [p + r for p, r in zip(prompts, replies)],
                                                  prompts, timeout=rewards.remote_rm_timeout)
            total, _ = combine_rewards(scores, rewards.source_weights, norms)
            append_rows(args.output_path, [{**r.data, "reward": total[i].item(),
                                            "scores": {k: t[i].item() for k, t in scores.items()}}
                                           for i, r in enumerate(chunk)])
        written += len(chunk)
    from rlhf.distributed.mesh import destroy_mesh

    destroy_mesh(mesh)
    return {"rows": len(records), "resumed_chunks": done, "rows_written": written}


def main(argv=None) -> int:
    from rlhf.config.job import cli_main

    return cli_main(add_args, run, argv)
