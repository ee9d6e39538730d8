"""Will this PPO job fit? Device memory per role and phase of the colocated schedule, before anything is launched.

    python tools/plan_memory.py --pretrain tools/model_configs/llama2-7b.json \
        --reward_pretrain tools/model_configs/llama2-7b.json --tp 2 --pp 1 --nnodes 1 --gpus_per_node 8 \
        --gpu_memory_gib 80 --bf16 --gradient_checkpointing --zero_stage 1 --micro_train_batch_size 4 \
        --micro_rollout_batch_size 8 --rollout_batch_size 512 --n_samples_per_prompt 4 \
        --prompt_max_len 1024 --generate_max_len 1024 --vllm_tensor_parallel_size 2

--pretrain / --reward_pretrain / --critic_pretrain / --teacher (on-policy distillation's teacher) take an HF folder,
its config.json, or a converted megatron checkpoint; only the config is read. The PPO flags mean what they mean to
launch/ppo.py, with the same defaults.
Prints one table per phase (GiB per GPU, at the pipeline stage that needs most), whether it fits, and which
changes would make it fit. Exit status: 0 fits, 1 does not fit, 2 bad input. The model is in rlhf/planner.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_spec(flag: str, path: str):
    """ModelSpec from an HF folder, a config.json file or a megatron checkpoint folder (rlhf_manifest.json)."""
    from rlhf.models.spec import load_hf_config, spec_from_hf_config

    if os.path.isdir(path) and os.path.exists(os.path.join(path, "rlhf_manifest.json")):
        with open(os.path.join(path, "rlhf_manifest.json")) as f:
            cfg = json.load(f)["hf_config"]
    else:
        try:
            cfg = load_hf_config(path)
        except ValueError as e:
            raise ValueError(f"{flag} {path}: {e}") from None
    try:
        return spec_from_hf_config(cfg, source=path)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models and hardware")
    g.add_argument("--pretrain", required=True, help="actor (and reference): HF folder, config.json or megatron ckpt")
    g.add_argument("--reward_pretrain", required=True, help="reward model config")
    g.add_argument("--critic_pretrain", default=None, help="critic config (default: --reward_pretrain)")
    g.add_argument("--teacher", "--teacher_pretrain", dest="teacher", default=None,
                   help="on-policy distillation teacher config (launch/ppo.py's --teacher_pretrain): one more "
                        "frozen model, forward only, on the student's layout")
    g.add_argument("--tensor_model_parallel_size", "--tp", dest="tp", type=int, default=1)
    g.add_argument("--pipeline_model_parallel_size", "--pp", dest="pp", type=int, default=1)
    g.add_argument("--expert_model_parallel_size", "--ep", dest="ep", type=int, default=1,
                   help="MoE roles: experts spread over this many data-parallel ranks")
    g.add_argument("--context_parallel_size", "--cp", "--ring_attn_size", dest="cp", type=int, default=1,
                   help="split each sequence over this many ranks (needs --layer_impl local)")
    g.add_argument("--nnodes", type=int, default=1)
    g.add_argument("--gpus_per_node", type=int, default=8)
    g.add_argument("--gpu_memory_gib", type=float, default=80.0)
    g.add_argument("--host_memory_gib", type=float, default=2048.0, help="host RAM per node")
    g.add_argument("--reserved_gib", type=float, default=3.0,
                   help="per GPU, for what no tensor accounts for: CUDA context, NCCL buffers, fragmentation")
    g.add_argument("--layer_impl", default="te", choices=["te", "local"],
                   help="te: transformer-engine + flash attention (GPU); local: megatron's torch layers, unfused "
                        "attention (CPU, or GPUs without transformer-engine)")
    g = p.add_argument_group("PPO flags (as in launch/ppo.py)")
    g.add_argument("--micro_train_batch_size", type=int, default=8)
    g.add_argument("--train_batch_size", type=int, default=128)
    g.add_argument("--micro_rollout_batch_size", type=int, default=8)
    g.add_argument("--rollout_batch_size", type=int, default=512)
    g.add_argument("--n_samples_per_prompt", type=int, default=1)
    g.add_argument("--generate_max_len", type=int, default=1024)
    g.add_argument("--prompt_max_len", type=int, default=1024)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--gradient_checkpointing", action="store_true")
    g.add_argument("--zero_stage", type=int, default=None, help="as launch/ppo.py on CUDA: default 1 when DP > 1, else 0")
    g.add_argument("--advantage_estimator", default="gae")
    g.add_argument("--init_kl_coef", type=float, default=0.01)
    g.add_argument("--colocate_all", "--colocate_all_models", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--ref_reward_offload", action="store_true")
    g.add_argument("--adam_offload", action="store_true")
    g.add_argument("--teacher_offload", action="store_true", help="the teacher's weights on host outside make_experience")
    g.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.95)
    g.add_argument("--vllm_tensor_parallel_size", type=int, default=None,
                   help="as launch/ppo.py: default chosen per model (rlhf.rollout.types.choose_tensor_parallel_size)")
    g.add_argument("--weight_sync_bucket_mb", type=int, default=512)
    g = p.add_argument_group("vLLM defaults the trainer does not change")
    g.add_argument("--vllm_max_num_seqs", type=int, default=256)
    g.add_argument("--vllm_max_num_batched_tokens", type=int, default=8192)
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    p.add_argument("--markdown", action="store_true", help="print one markdown row per phase instead of tables")


def config_from_args(args: argparse.Namespace):
    from rlhf.algo.advantages import get_estimator
    from rlhf.planner import PlanConfig

    actor = load_spec("--pretrain", args.pretrain)
    reward = load_spec("--reward_pretrain", args.reward_pretrain)
    needs_critic = get_estimator(args.advantage_estimator).needs_critic
    critic = load_spec("--critic_pretrain", args.critic_pretrain) if args.critic_pretrain else reward
    teacher = load_spec("--teacher", args.teacher) if args.teacher else None
    fields = ("tp", "pp", "ep", "cp", "nnodes", "gpus_per_node", "gpu_memory_gib", "host_memory_gib", "reserved_gib",
              "layer_impl", "micro_train_batch_size", "train_batch_size", "micro_rollout_batch_size",
              "rollout_batch_size", "n_samples_per_prompt", "generate_max_len", "prompt_max_len", "bf16",
              "gradient_checkpointing", "zero_stage", "colocate_all", "ref_reward_offload", "adam_offload",
              "teacher_offload",
              "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "weight_sync_bucket_mb",
              "vllm_max_num_seqs", "vllm_max_num_batched_tokens")
    if args.zero_stage is None:  # launch/ppo.py's default (rlhf.config.job.resolve_zero_stage)
        from rlhf.config.job import resolve_zero_stage

        resolve_zero_stage(args, args.nnodes * args.gpus_per_node // (args.tp * args.pp * args.cp), cuda=True)
    if args.vllm_tensor_parallel_size is None:  # launch/ppo.py's choice on CUDA
        from rlhf.rollout.types import choose_tensor_parallel_size

        args.vllm_tensor_parallel_size, why = choose_tensor_parallel_size(
            actor, args.nnodes * args.gpus_per_node, args.gpus_per_node, cuda=True,
            device_bytes=int(args.gpu_memory_gib * 2**30), dtype_bytes=2 if args.bf16 else 4,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization)
        print(f"--vllm_tensor_parallel_size {args.vllm_tensor_parallel_size} ({why})", file=sys.stderr)
    return PlanConfig(actor=actor, reward=reward, critic=critic if needs_critic else None,
                      with_ref=args.init_kl_coef > 0, teacher=teacher, **{k: getattr(args, k) for k in fields})


def longest_sequence(cfg, step: int = 128, limit: int = 1 << 20) -> int:
    """The longest ``--prompt_max_len + --generate_max_len`` (the prompt kept, the reply grown in ``step``s) whose
    training phases (experience forwards, critic and actor updates: where activations grow with the sequence) fit
    this layout's devices; vLLM's rollout memory is its own question (``--vllm_gpu_memory_utilization``). 0 if
    not even ``step`` reply tokens fit."""
    import dataclasses

    from rlhf.planner import plan

    def fits(gen: int) -> bool:
        phases = plan(dataclasses.replace(cfg, generate_max_len=gen)).phases
        return all(ph.fits for ph in phases if ph.phase in ("make_experience", "critic_update", "actor_update"))

    if not fits(step):
        return 0
    lo, hi = step, step * 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return cfg.prompt_max_len + lo


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    args = p.parse_args(argv)
    from rlhf.planner import advise, format_markdown, format_plan, plan

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = plan(cfg)
    advice = advise(cfg)
    longest = longest_sequence(cfg)
    if args.json:
        print(json.dumps({"fits": result.fits, "problems": result.problems, "advice": advice,
                          "longest_sequence": longest,
                          "phases": [{"phase": ph.phase, "stage": ph.stage, "total": ph.total, "fits": ph.fits,
                                      "rows": ph.rows, "vllm": ph.vllm, "other": ph.other} for ph in result.phases],
                          "vllm": vars(result.vllm), "host_per_node": result.host_per_node}, indent=1))
    elif args.markdown:
        print(format_markdown(result))
        for line in result.problems + advice:
            print(f"* {line}")
    else:
        print(format_plan(result))
        if not cfg.colocate_all:
            print("note: launch/ppo.py runs only with --colocate_all; this is a what-if")
        for line in advice:
            print("advice: " + line)
        print(f"longest sequence the training phases fit at tp {cfg.tp} x pp {cfg.pp} x cp {cfg.cp} (prompt "
              f"{cfg.prompt_max_len} + reply, in 128s): {longest} tokens")
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
