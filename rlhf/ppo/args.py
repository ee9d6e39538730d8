"""``launch/ppo.py`` flags: the PPO parameter table users know from OpenRLHF / AIAK-RLHF, checked before any
model is loaded. Each check raises ``ValueError`` naming the flag and its value. Flags shared with other entry
points come from the groups in ``rlhf.config`` and ``rlhf.rewards``."""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

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
    _add_critic_optim_args(g)
    _add_ppo_algo_args(g)
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


CRITIC_OPTIM_FLAGS = {"critic_adam_betas": "adam_betas", "critic_l2": "l2", "critic_lr_scheduler": "lr_scheduler",
                      "critic_lr_warmup_ratio": "lr_warmup_ratio", "critic_max_norm": "max_norm"}
"""The critic's own optimizer flag -> the shared flag it replaces for the critic (OpenRLHF's ``--critic.*``)."""


def _add_critic_optim_args(g) -> None:
    g.add_argument("--critic_adam_betas", type=float, nargs=2, default=None, metavar=("BETA1", "BETA2"),
                   help="the critic's Adam betas (default: --adam_betas)")
    g.add_argument("--critic_l2", type=float, default=None, help="the critic's weight decay (default: --l2)")
    g.add_argument("--critic_lr_scheduler", default=None, help="the critic's schedule (default: --lr_scheduler)")
    g.add_argument("--critic_lr_warmup_ratio", type=float, default=None,
                   help="the critic's warmup ratio (default: --lr_warmup_ratio)")
    g.add_argument("--critic_max_norm", type=float, default=None,
                   help="the critic's gradient clipping (default: --max_norm)")


def critic_optim_config(args: argparse.Namespace, total_steps: int):
    """The critic's optimizer: the shared optimisation flags, each replaced by its ``--critic_*`` flag where given
    (``CRITIC_OPTIM_FLAGS``)."""
    from rlhf.config import optim_config

    shared = argparse.Namespace(**vars(args))
    for own, common in CRITIC_OPTIM_FLAGS.items():
        if getattr(args, own, None) is not None:
            setattr(shared, common, getattr(args, own))
    return optim_config(shared, args.critic_learning_rate, total_steps)


def _add_ppo_algo_args(g) -> None:
    g.add_argument("--init_kl_coef", type=float, default=0.01)
    g.add_argument("--kl_target", type=float, default=None, help="adaptive KL target (default: fixed coefficient)")
    g.add_argument("--kl_horizon", type=float, default=10000)
    g.add_argument("--kl_estimator", default="k1", choices=["k1", "k2", "k3"])
    g.add_argument("--use_kl_loss", action=argparse.BooleanOptionalAction, default=None,
                   help="the KL penalty (--init_kl_coef x --kl_estimator) in the actor's loss for any estimator "
                        "(OpenRLHF's --algo.kl.use_loss; k2 or k3 recommended there); --no-use_kl_loss: in the "
                        "reward for any estimator (OpenRLHF without the flag, which an OpenRLHF command line gets). "
                        "Default: in the loss for grpo, dr_grpo and group_norm, in the reward otherwise")
    g.add_argument("--reward_clip_range", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="clamp each sample's reward to [LOW, HIGH] after its group baseline, before the KL term "
                        "(OpenRLHF's --reward.clip_range). Default: no clipping; an OpenRLHF command line gets "
                        "OpenRLHF's -10 10")
    g.add_argument("--eps_clip", "--actor.eps_clip", dest="eps_clip", type=float, default=0.2)
    g.add_argument("--eps_clip_low_high", "--actor.eps_clip_low_high", dest="eps_clip_low_high", type=float, nargs=2,
                   default=None, metavar=("LOW", "HIGH"),
                   help="asymmetric clipping (DAPO's clip-higher): ratios clipped to [1 - LOW, 1 + HIGH]; "
                        "default: --eps_clip on both sides")
    g.add_argument("--dual_clip", "--actor.dual_clip", dest="dual_clip", type=float, default=None,
                   help="dual-clip PPO: for negative advantages the loss is at most -C * A (C > 1)")
    g.add_argument("--policy_loss_type", "--actor.policy_loss_type", dest="policy_loss_type", default="ppo",
                   choices=["ppo", "gspo"],
                   help="gspo: one length-normalised importance ratio per sequence (GSPO), sequence-level loss")
    g.add_argument("--loss_agg_mode", default=None,
                   choices=["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"],
                   help="how per-token losses make the step's loss: token_mean (default; DAPO's token-level "
                        "loss), seq_mean_token_mean (GRPO's original; the default with gspo), seq_mean_token_sum")
    g.add_argument("--entropy_coef", "--actor.entropy_coef", dest="entropy_coef", type=float, default=None,
                   help="entropy bonus: - coef * entropy joins the actor's loss (aggregated as it)")
    g.add_argument("--value_clip", type=float, default=0.2)
    g.add_argument("--gamma", type=float, default=1.0)
    g.add_argument("--lambd", type=float, default=1.0)
    g.add_argument("--advantage_estimator", "--algo.advantage.estimator", dest="advantage_estimator", default="gae",
                   help="gae | grpo (= group_norm, OpenRLHF's name) | dr_grpo | rloo | reinforce_baseline | "
                        "reinforce_plus_plus (= reinforce)")
    g.add_argument("--no_std_norm", "--algo.advantage.no_std_norm", dest="no_std_norm", action="store_true",
                   help="gae, reinforce_plus_plus, reinforce_baseline: normalise advantages by the batch mean only, "
                        "not the std")
    g.add_argument("--overlong_buffer_len", "--reward.overlong_buffer_len", dest="overlong_buffer_len", type=float,
                   default=None, help="DAPO's overlong penalty: a reply longer than --generate_max_len minus this many "
                                      "tokens loses up to --overlong_penalty_factor, linearly")
    g.add_argument("--overlong_penalty_factor", "--reward.overlong_penalty_factor", dest="overlong_penalty_factor",
                   type=float, default=1.0)
    g.add_argument("--stop_properly_penalty_coef", "--reward.stop_properly_penalty_coef",
                   dest="stop_properly_penalty_coef", type=float, default=None,
                   help="ProRL: the reward of a reply cut at --generate_max_len is scaled by this (in [0, 1]), or "
                        "replaced by it when negative")
    g.add_argument("--dynamic_filtering", "--algo.dynamic_filtering_enable", dest="dynamic_filtering",
                   action="store_true",
                   help="DAPO's dynamic sampling: drop prompts whose replies all score alike or whose mean score is "
                        "outside --dynamic_filtering_range, and generate for more prompts until the batch is full")
    g.add_argument("--dynamic_filtering_range", "--algo.dynamic_filtering_range", dest="dynamic_filtering_range",
                   type=float, nargs=2, default=(0.0, 1.0), metavar=("LO", "HI"),
                   help="a group is kept when LO < its mean score < HI (OpenRLHF's default: 0 1)")
    g.add_argument("--dynamic_filtering_max_rounds", type=int, default=4,
                   help="rollouts per step at most under --dynamic_filtering; a batch still short after them is "
                        "filled with the last groups filtered out (counted)")
    g.add_argument("--old_logprobs_forward", choices=["auto", "always"], default="auto",
                   help="auto: when each batch gets exactly one update (--max_epochs 1, --train_batch_size = the "
                        "step's samples) and the KL is not in the reward, the policy that generated the batch is the "
                        "one being trained, so its old log-probs are the update's own forward, detached (TRL does "
                        "the same): no actor forward in make_experience. always: keep that forward")
    g.add_argument("--use_rollout_logprobs", action="store_true",
                   help="the generator's log-probs are PPO's old log-probs: no actor forward in make_experience "
                        "(TRL reuses its generation logits the same way); the drift metric is then not measured")
    g.add_argument("--use_tis", action="store_true",
                   help="truncated importance sampling: weight the policy loss by min(p_trainer/p_vllm, --tis_cap)")
    g.add_argument("--tis_cap", type=float, default=2.0)
    g.add_argument("--tis_floor", type=float, default=None,
                   help="--use_tis: the weight is at least this too (OpenRLHF's --algo.advantage.is_correction_threshold "
                        "LOW HIGH is --tis_floor LOW --tis_cap HIGH; default: no lower bound)")
    g.add_argument("--pretrain_data", "--unsupervised_dataset_name", dest="pretrain_data", default=None,
                   help="PPO-ptx: plain texts whose next-token loss joins each actor step (files, folders, cached Hub "
                        "names); DeepSpeed-Chat's --unsupervised_dataset_name")
    g.add_argument("--pretrain_input_key", default="text", help="--pretrain_data: the text field")
    g.add_argument("--pretrain_max_len", type=int, default=None,
                   help="--pretrain_data: longer texts keep their start (default --prompt_max_len + --generate_max_len)")
    g.add_argument("--ptx_coef", "--unsup_coef", dest="ptx_coef", type=float, default=0.05,
                   help="weight of the ptx loss (OpenRLHF's --ptx_coef; DeepSpeed-Chat's --unsup_coef)")
    g.add_argument("--enable_ema", action="store_true",
                   help="keep an exponential moving average of the actor; exported to <save_path>/ema")
    g.add_argument("--ema_beta", type=float, default=0.992, help="--enable_ema: ema = beta * ema + (1 - beta) * actor")


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
    _check_algo(args)
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


def _check_algo(args: argparse.Namespace) -> None:
    from rlhf.algo.advantages import get_estimator

    if args.tis_floor is not None and not 0 <= args.tis_floor < args.tis_cap:
        raise ValueError(f"--tis_floor {args.tis_floor:g}: must be in [0, --tis_cap {args.tis_cap:g})")
    if args.use_rollout_logprobs and args.use_tis:
        raise ValueError("--use_tis corrects for the generator's log-probs differing from the trainer's, but with "
                         "--use_rollout_logprobs they are the same; use one of them")
    for name in ("micro_train_batch_size", "train_batch_size", "micro_rollout_batch_size", "rollout_batch_size",
                 "n_samples_per_prompt", "max_epochs", "num_episodes", "generate_max_len", "prompt_max_len",
                 "logging_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.advantage_estimator == "reinforce":  # OpenRLHF's name
        args.advantage_estimator = "reinforce_plus_plus"
    estimator = get_estimator(args.advantage_estimator)
    if estimator.needs_groups and args.n_samples_per_prompt < 2:
        raise ValueError(f"--advantage_estimator {args.advantage_estimator} needs --n_samples_per_prompt >= 2, "
                         f"got {args.n_samples_per_prompt}")
    if args.advantage_estimator in ("rloo", "reinforce_baseline") and args.gamma != 1.0:
        raise ValueError(f"--advantage_estimator {args.advantage_estimator} with --gamma {args.gamma}: its return is "
                         "undiscounted (OpenRLHF sets gamma to 1 for it); drop --gamma")
    from rlhf.algo.ppo_losses import ActorLossConfig

    loss_cfg = ActorLossConfig.from_args(args, estimator)  # the loss flags' own checks
    if args.policy_loss_type == "gspo" and estimator.needs_critic:
        raise ValueError(f"--policy_loss_type gspo with --advantage_estimator {args.advantage_estimator}: GSPO's "
                         "sequence-level ratio needs sequence-level advantages; use a critic-free estimator (grpo, "
                         "rloo, reinforce_baseline, ...)")
    if args.policy_loss_type == "gspo" and loss_cfg.loss_agg_mode != "seq_mean_token_mean":
        raise ValueError(f"--policy_loss_type gspo with --loss_agg_mode {args.loss_agg_mode}: GSPO's loss is a mean "
                         "over sequences of their token means (seq_mean_token_mean)")
    if loss_cfg.loss_agg_mode != "token_mean" and args.pretrain_data:
        raise ValueError(f"--pretrain_data with --loss_agg_mode {loss_cfg.loss_agg_mode} (or --policy_loss_type gspo): "
                         "the ptx loss is combined with a token-level policy loss only")
    from rlhf.algo.shaping import ShapingConfig
    from rlhf.ppo.evaluation import EvalConfig

    if args.use_dynamic_batch:
        if not args.packing_samples:
            raise ValueError("--use_dynamic_batch forms micro-batches by token count, which only pays without padding: "
                             "add --packing_samples")
        if args.pipeline_model_parallel_size > 1:
            raise ValueError("--use_dynamic_batch with --pipeline_model_parallel_size > 1: a pipeline needs the same "
                             "number of micro-batches on every stage of each step; not supported yet")
        if args.max_tokens_per_gpu < args.prompt_max_len + args.generate_max_len:
            raise ValueError(f"--max_tokens_per_gpu {args.max_tokens_per_gpu} is below --prompt_max_len "
                             f"{args.prompt_max_len} + --generate_max_len {args.generate_max_len}: a sample may not fit")
    ShapingConfig.from_args(args)
    if EvalConfig.from_args(args) is not None:
        from rlhf.config import check_paths_exist

        check_paths_exist("--eval_dataset", args.eval_dataset)
        if not (args.reward_fn or args.remote_rm_url):
            raise ValueError("--eval_dataset scores the held-out replies with the run's rule reward (--reward_fn or "
                             "--remote_rm_url); this run has none")
    if args.dynamic_filtering:
        lo, hi = args.dynamic_filtering_range
        if lo >= hi:
            raise ValueError(f"--dynamic_filtering_range {lo:g} {hi:g}: LO must be below HI")
        if args.n_samples_per_prompt < 2:
            raise ValueError(f"--dynamic_filtering with --n_samples_per_prompt {args.n_samples_per_prompt}: it keeps "
                             "prompts whose replies score differently, which needs at least 2 replies per prompt")
        if args.reward_pretrain or not (args.reward_fn or args.remote_rm_url or args.agent_func_path):
            raise ValueError("--dynamic_filtering filters on the scores of a rule reward (--reward_fn, "
                             "--remote_rm_url or an agent's) before any model runs; it does not combine with "
                             "--reward_pretrain")
        if args.dynamic_filtering_max_rounds < 1:
            raise ValueError(f"--dynamic_filtering_max_rounds must be >= 1, got {args.dynamic_filtering_max_rounds}")
    if args.no_std_norm and args.advantage_estimator not in ("gae", "reinforce_plus_plus", "reinforce_baseline"):
        raise ValueError(f"--no_std_norm with --advantage_estimator {args.advantage_estimator}: only gae, "
                         "reinforce_plus_plus and reinforce_baseline normalise by a batch std (dr_grpo is grpo "
                         "without its group std)")
    if args.reward_clip_range is not None and not args.reward_clip_range[0] < args.reward_clip_range[1]:
        lo, hi = args.reward_clip_range
        raise ValueError(f"--reward_clip_range {lo:g} {hi:g}: LOW must be below HIGH")
    _check_critic_optim(args)
    _check_kl_place(args, estimator)
    if args.temperature <= 0:
        raise ValueError(f"--temperature must be > 0 for sampling, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.zero_stage not in (None, 0, 1, 2, 3):
        raise ValueError(f"--zero_stage must be 0..3, got {args.zero_stage}")
    if args.vllm_tensor_parallel_size is not None and args.vllm_tensor_parallel_size < 1:
        raise ValueError(f"--vllm_tensor_parallel_size must be >= 1, got {args.vllm_tensor_parallel_size}")


def _check_critic_optim(args: argparse.Namespace) -> None:
    """The critic's own optimizer flags, checked as the shared ones are (``OptimConfig``), naming the flag."""
    from rlhf.engine import OptimConfig

    if args.critic_max_norm is not None and args.critic_max_norm < 0:
        raise ValueError(f"--critic_max_norm must be >= 0, got {args.critic_max_norm}")
    if args.critic_l2 is not None and args.critic_l2 < 0:
        raise ValueError(f"--critic_l2 must be >= 0, got {args.critic_l2}")
    if args.critic_adam_betas is not None and not all(0 <= b < 1 for b in args.critic_adam_betas):
        raise ValueError(f"--critic_adam_betas {' '.join(f'{b:g}' for b in args.critic_adam_betas)}: each must be in "
                         "[0, 1)")
    for flag, kw in (("lr_scheduler", "scheduler"), ("lr_warmup_ratio", "warmup_ratio")):
        value = getattr(args, f"critic_{flag}")
        if value is not None:
            try:
                OptimConfig(**{kw: value})
            except ValueError as e:
                raise ValueError(str(e).replace(f"--{flag}", f"--critic_{flag}")) from None


def _check_kl_place(args: argparse.Namespace, estimator) -> None:
    """--use_kl_loss: logs where the KL goes when the estimator is not the recommended one for that place (as
    OpenRLHF prints it)."""
    from rlhf.algo.kl import kl_in_loss

    if args.use_kl_loss is None or args.init_kl_coef == 0:
        return
    if kl_in_loss(estimator, args.use_kl_loss) and args.kl_estimator not in ("k2", "k3"):
        log.info("--use_kl_loss with --kl_estimator %s: k2 or k3 is recommended for a KL loss (OpenRLHF)",
                 args.kl_estimator)
    elif not kl_in_loss(estimator, args.use_kl_loss) and args.kl_estimator != "k1":
        log.info("--no-use_kl_loss with --kl_estimator %s: k1 is recommended for a KL in the reward (OpenRLHF)",
                 args.kl_estimator)


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

