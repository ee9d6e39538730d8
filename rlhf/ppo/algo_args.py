"""``launch/ppo.py``'s algorithm flags (KL, clipping, loss, advantage estimator, reward shaping, dynamic filtering,
old log-probs and TIS, ptx, EMA) and their checks, before any model is loaded. Each check raises ``ValueError``
naming the flag and its value."""
from __future__ import annotations

import argparse
import logging

from rlhf.ppo.critic_optim import check_critic_optim

log = logging.getLogger(__name__)


def add_algo_args(g) -> None:
    """The algorithm's flags (KL, clipping, loss, advantages, reward shaping, dynamic filtering, old log-probs, TIS,
    ptx, EMA)."""
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


def check_algo(args: argparse.Namespace) -> None:
    """The algorithm's flags, before any model: batch sizes, the estimator and the loss, then what shapes the batch
    (``_check_batching_and_rewards``), the critic's optimizer and the KL's place."""
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
    _check_batching_and_rewards(args)
    check_critic_optim(args)
    _check_kl_place(args, estimator)


def _check_batching_and_rewards(args: argparse.Namespace) -> None:
    """Dynamic batching, reward shaping, held-out evaluation, dynamic filtering, normalisation, reward clipping and
    sampling."""
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
    if args.temperature <= 0:
        raise ValueError(f"--temperature must be > 0 for sampling, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.zero_stage not in (None, 0, 1, 2, 3):
        raise ValueError(f"--zero_stage must be 0..3, got {args.zero_stage}")
    if args.vllm_tensor_parallel_size is not None and args.vllm_tensor_parallel_size < 1:
        raise ValueError(f"--vllm_tensor_parallel_size must be >= 1, got {args.vllm_tensor_parallel_size}")


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
