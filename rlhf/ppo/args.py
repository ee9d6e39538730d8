"""``launch/ppo.py`` flags: the PPO parameter table users know from OpenRLHF / AIAK-RLHF, checked before any
model is loaded. Each check raises ``ValueError`` naming the flag and its value. Flags shared with other entry
points come from the groups in ``rlhf.config`` and ``rlhf.rewards``."""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from rlhf.ppo.algo_args import add_algo_args, check_algo
from rlhf.ppo.critic_optim import add_critic_optim_args

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    from rlhf.config import (add_batch_args, add_engine_args, add_optim_args, add_output_args,
                             add_rollout_backend_args, add_sampling_args, add_text_args)
    from rlhf.models.lora import add_lora_args
    from rlhf.rewards import add_reward_args

    g = p.add_argument_group("models and data")
    g.add_argument("--pretrain", required=True, help="actor (and reference) model: HF folder or megatron checkpoint")
    add_reward_args(g)
    g.add_argument("--critic_pretrain", default=None, help="critic init (default: the first --reward_pretrain)")
    g.add_argument("--prompt_data", required=True, help="comma-separated jsonl/json/parquet files or HF disk folders")
    g.add_argument("--prompt_data_probs", default=None, help="mixing probabilities, one per --prompt_data entry")
    add_text_args(g, input_key=True)
    g.add_argument("--label_key", default=None, help="optional field passed through with each prompt")
    g.add_argument("--eval_dataset", "--eval.dataset", dest="eval_dataset", default=None,
                   help="held-out prompts, scored by the rule reward (--reward_fn / --remote_rm_url, --label_key) at "
                        "step 0, every --eval_steps and at the end: eval/reward and eval/pass@k")
    g.add_argument("--eval_steps", "--eval.steps", dest="eval_steps", type=int, default=-1,
                   help="evaluate every N steps (-1: at the start and the end only)")
    g.add_argument("--eval_n_samples_per_prompt", "--eval.n_samples_per_prompt", dest="eval_n_samples_per_prompt",
                   type=int, default=4, help="replies per held-out prompt (the k of pass@k)")
    g.add_argument("--eval_temperature", "--eval.temperature", dest="eval_temperature", type=float, default=0.6)
    g.add_argument("--eval_max_samples", type=int, default=None, help="the first N held-out prompts (default: all)")
    g = p.add_argument_group("batching and generation")
    add_batch_args(g, micro_bs=8, epochs=1)
    g.add_argument("--micro_rollout_batch_size", type=int, default=8, help="samples per experience forward per rank")
    g.add_argument("--use_dynamic_batch", "--train.dynamic_batch_enable", dest="use_dynamic_batch",
                   action="store_true",
                   help="form the forward and update micro-batches by token count (--max_tokens_per_gpu, packed) "
                        "instead of by --micro_*_batch_size")
    g.add_argument("--max_tokens_per_gpu", "--train.max_tokens_per_gpu", dest="max_tokens_per_gpu", type=int,
                   default=16192, help="--use_dynamic_batch: prompt + response tokens per micro-batch at most")
    g.add_argument("--rollout_batch_size", type=int, default=512, help="prompts per rollout (global)")
    g.add_argument("--n_samples_per_prompt", type=int, default=1)
    g.add_argument("--num_episodes", type=int, default=1, help="passes over the prompt data")
    add_sampling_args(g)
    g.add_argument("--ignore_eos", action="store_true",
                   help="generate exactly --generate_max_len tokens per response (benchmarks)")
    from rlhf.agents.flags import add_agent_args

    add_agent_args(g)
    g = p.add_argument_group("optimisation")
    g.add_argument("--actor_learning_rate", type=float, default=1e-6)
    g.add_argument("--critic_learning_rate", type=float, default=9e-6)
    add_optim_args(g)
    add_critic_optim_args(g)
    add_algo_args(g)
    g = p.add_argument_group("placement and memory")
    _add_placement_args(g)
    from rlhf.migration import add_placement_args

    add_placement_args(g)  # OpenRLHF's Ray placement flags: checked, then every role is on every rank
    add_rollout_backend_args(g)
    add_engine_args(g)
    add_lora_args(p)  # --lora_rank etc.: the actor's adapters; --lora_export: the final actor export
    p.add_argument("--critic_lora_rank", type=int, default=0,
                   help="LoRA rank of the critic (0: full fine-tuning); shares --lora_alpha/--target_modules/"
                        "--lora_dropout; its score head always trains")
    g = p.add_argument_group("running")
    add_output_args(g, what="actor")
    g.add_argument("--gold_reward_fn", default=None,
                   help="module:function scoring (prompts, replies) with a rule; logged as gold_reward, never "
                        "optimized (e.g. rlhf.demo.sort_task:gold_rewards)")


def _add_placement_args(g) -> None:
    g.add_argument("--colocate_all", "--colocate_all_models", action=argparse.BooleanOptionalAction, default=True,
                   help="all four roles and vLLM share every rank (the only layout of this trainer)")
    g.add_argument("--ref_reward_offload", action="store_true", help="keep ref/reward weights on host between uses")
    g.add_argument("--adam_offload", action="store_true", help="keep optimizer states on host outside updates")
    g.add_argument("--vllm_num_engines", type=int, default=None, help="must equal world size / vLLM TP")
    g.add_argument("--vllm_tensor_parallel_size", type=int, default=None,
                   help="TP of each vLLM engine; default: chosen per model and device, and logged (CPU: the largest "
                        "the heads allow within a node; CUDA: the smallest whose weights leave room for the KV cache)")
    g.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.95)
    g.add_argument("--vllm_enforce_eager", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--vllm_enable_prefix_caching", action="store_true",
                   help="vLLM's automatic prefix caching: the replies of one prompt, and prompts sharing a start, "
                        "reuse its KV blocks; the cache is reset after every weight sync")
    g.add_argument("--weight_sync_bucket_mb", type=int, default=512)


@dataclass
class PPOSetup:
    """What ``validate`` derives from the flags and the model configs (no weights read)."""

    dp: int
    """data-parallel size: world size / (TP x PP)"""
    engines: int
    """generation engines: world size / vLLM TP (the megatron fallback: one per DP rank)"""
    samples: int
    """samples per step, global: --rollout_batch_size x --n_samples_per_prompt"""
    sources: dict[str, Any]
    """``describe_source`` of each model flag: {"--pretrain": ..., "--critic_pretrain": ..., "--reward_pretrain":
    [one per reward model]}"""
    rewards: Any
    """the ``RewardConfig``"""
    vllm_tp_reason: str = ""
    """why ``--vllm_tensor_parallel_size`` has its value when the trainer chose it ("" when the user did)"""


def validate(args: argparse.Namespace, world_size: int) -> PPOSetup:
    """Flag-only checks (plus model configs), before any process group or model."""
    from rlhf.config import check_paths_exist, check_resumable
    from rlhf.distributed.mesh import validate_layout
    from rlhf.models.gpt import resolve_transformer_impl
    from rlhf.models.lora import lora_config_from_args

    resolve_transformer_impl(args.transformer_impl, lora=bool(getattr(args, "lora_rank", 0)),
                             cp=args.context_parallel_size)  # before any model
    if not args.colocate_all:
        raise ValueError("--no-colocate_all: this trainer runs every role in one SPMD job on every rank; separate "
                         "placement (Ray-style) is not supported")
    dp = validate_layout(world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                         cp=args.context_parallel_size)
    if args.context_parallel_size > 1 and args.rollout_backend == "megatron":
        raise ValueError(f"--context_parallel_size {args.context_parallel_size} with --rollout_backend megatron: the "
                         "megatron fallback generator decodes with a KV cache that is not split over CP ranks; "
                         "generate with vLLM (the default)")
    check_algo(args)
    from rlhf.agents.flags import check_agent_args

    check_agent_args(args)
    check_paths_exist("--prompt_data", args.prompt_data)
    check_resumable(args)
    lora_config_from_args(args)
    lora_config_from_args(args, "critic_lora_rank")
    from rlhf.ppo.ema import check_ema_args

    check_ema_args(args)
    _check_ptx(args)
    rewards, sources = _check_models(args)
    from rlhf.agents.flags import check_agent_fit
    from rlhf.models.source import check_tokenizer_folder

    check_agent_fit(args, sources["--pretrain"]["hf_config"])

    check_tokenizer_folder(args.pretrain, "--pretrain")  # the prompts and replies are tokenized with it
    why = resolve_vllm_tp(args, sources["--pretrain"]["spec"], world_size)
    engines = _check_batch_sizes(args, world_size, dp)
    args.old_logprobs_source, args.old_logprobs_reason = old_logprobs_source(args)
    return PPOSetup(dp=dp, engines=engines, samples=args.rollout_batch_size * args.n_samples_per_prompt,
                    sources=sources, rewards=rewards, vllm_tp_reason=why)


def resolve_vllm_tp(args: argparse.Namespace, spec, world_size: int) -> str:
    """Sets ``--vllm_tensor_parallel_size`` when it was not given (from ``--vllm_num_engines`` when that is, else
    ``choose_tensor_parallel_size``); returns why, for the log ("" when the user chose)."""
    if args.vllm_tensor_parallel_size is not None:
        return ""
    if args.vllm_num_engines is not None:
        if args.vllm_num_engines < 1 or world_size % args.vllm_num_engines:
            raise ValueError(f"--vllm_num_engines {args.vllm_num_engines} must divide the world size {world_size}")
        args.vllm_tensor_parallel_size = world_size // args.vllm_num_engines
        return f"world size {world_size} / --vllm_num_engines {args.vllm_num_engines}"
    import torch

    from rlhf.distributed.env import local_world_size
    from rlhf.rollout.types import choose_tensor_parallel_size

    cuda = torch.cuda.is_available()
    tp, why = choose_tensor_parallel_size(
        spec, world_size, min(local_world_size(), world_size), cuda=cuda,
        device_bytes=torch.cuda.get_device_properties(0).total_memory if cuda else 0,
        dtype_bytes=2 if args.bf16 else 4, gpu_memory_utilization=args.vllm_gpu_memory_utilization)
    args.vllm_tensor_parallel_size = tp
    return why


def _check_ptx(args: argparse.Namespace) -> None:
    if not args.pretrain_data:
        return
    from rlhf.config import check_paths_exist

    check_paths_exist("--pretrain_data", args.pretrain_data)
    if args.ptx_coef < 0:
        raise ValueError(f"--ptx_coef must be >= 0, got {args.ptx_coef}")
    if args.pipeline_model_parallel_size > 1 or args.packing_samples:
        raise ValueError("--pretrain_data with --pipeline_model_parallel_size > 1 or --packing_samples is not "
                         "supported yet (the ptx micro-batches are padded and shaped apart from the experience's)")


def _check_batch_sizes(args: argparse.Namespace, world_size: int, dp: int) -> int:
    """The batch flags against each other and the layout; returns the number of generation engines."""
    engines = (world_size // args.vllm_tensor_parallel_size if args.rollout_backend != "megatron" else dp)
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    checks = [
        (args.rollout_batch_size % max(engines, 1) == 0,
         f"--rollout_batch_size {args.rollout_batch_size} must be divisible by the number of generation engines "
         f"{engines} (world size {world_size} / --vllm_tensor_parallel_size {args.vllm_tensor_parallel_size})"),
        (samples % dp == 0, f"--rollout_batch_size x --n_samples_per_prompt = {samples} must be divisible by the "
                            f"data-parallel size {dp}"),
        ((samples // dp) % args.micro_rollout_batch_size == 0,
         f"--micro_rollout_batch_size {args.micro_rollout_batch_size} must divide the samples per data-parallel rank "
         f"({samples} / dp {dp} = {samples // dp})"),
        (samples % args.train_batch_size == 0,
         f"--train_batch_size {args.train_batch_size} must divide --rollout_batch_size x --n_samples_per_prompt "
         f"= {samples}"),
        (args.train_batch_size % (args.micro_train_batch_size * dp) == 0,
         f"--train_batch_size {args.train_batch_size} is not divisible by --micro_train_batch_size "
         f"{args.micro_train_batch_size} x data-parallel size {dp}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
    return engines


def _check_models(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """Every model flag's config: the reward models, the actor, the critic (when the estimator needs one)."""
    from rlhf.algo.advantages import get_estimator
    from rlhf.models.source import describe_source
    from rlhf.models.spec import check_parallel_fit
    from rlhf.rewards import RewardConfig

    needs_critic = get_estimator(args.advantage_estimator).needs_critic
    rewards = RewardConfig.from_args(args)
    critic = args.critic_pretrain or (rewards.paths[0] if rewards.paths else None)
    if needs_critic and critic is None:
        what = f"--reward_fn {args.reward_fn}" if args.reward_fn else f"--remote_rm_url {args.remote_rm_url}"
        raise ValueError(f"{what} without --reward_pretrain: the critic of --advantage_estimator "
                         f"{args.advantage_estimator} needs --critic_pretrain")
    sources = {"--reward_pretrain": rewards.validate_models(args.tensor_model_parallel_size,
                                                            args.pipeline_model_parallel_size)}
    for flag, path in (("--pretrain", args.pretrain), ("--critic_pretrain", critic if needs_critic else None)):
        if path is None:
            continue
        try:
            src = describe_source(path)
        except ValueError as e:
            raise ValueError(f"{flag} {path}: {e}") from None
        check_parallel_fit(src["spec"], args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                           src["padded_vocab"])
        from rlhf.models.context_parallel import check_cp_flags

        check_cp_flags(args.context_parallel_size, src["spec"], flag)
        sources[flag] = src
    return rewards, sources


def log_compat(args: argparse.Namespace, dp: int, cuda: bool) -> None:
    from rlhf.config import log_compat_mappings

    log_compat_mappings(args, dp, cuda)
    log.info("--colocate_all: actor, critic, reference, reward and vLLM share every rank (one SPMD job)")


def old_logprobs_source(args: argparse.Namespace) -> tuple[str, str]:
    """Where PPO's old log-probs come from, and why: ``rollout`` (--use_rollout_logprobs: the generator's),
    ``update`` (one on-policy update per batch: the update's own forward, detached; no actor forward in
    make_experience) or ``forward`` (the actor's forward in make_experience)."""
    from rlhf.algo.advantages import get_estimator

    if args.use_rollout_logprobs:
        return "rollout", "--use_rollout_logprobs"
    one_update = args.max_epochs == 1 and args.train_batch_size == args.rollout_batch_size * args.n_samples_per_prompt
    from rlhf.algo.kl import kl_in_loss

    estimator = get_estimator(args.advantage_estimator)
    kl_in_reward = not kl_in_loss(estimator, args.use_kl_loss) and args.init_kl_coef > 0
    if args.old_logprobs_forward == "always":
        return "forward", "--old_logprobs_forward always"
    if not one_update:
        return "forward", "each batch gets several updates (--max_epochs or --train_batch_size)"
    if kl_in_reward:
        return "forward", f"the KL penalty is in the reward (--advantage_estimator {args.advantage_estimator}, " \
                          f"--init_kl_coef {args.init_kl_coef:g}) and needs them before the update"
    return "update", "one on-policy update per batch: the update's own forward, detached"

