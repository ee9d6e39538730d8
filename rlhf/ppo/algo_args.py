"""``launch/ppo.py``'s algorithm flags (KL, clipping, loss, advantage estimator, reward shaping, dynamic filtering,
old log-probs and TIS, ptx, EMA) and their checks, before any model is loaded. Each check raises ``ValueError``
naming the flag and its value."""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from rlhf.algo.rollout_correction import RolloutCorrectionConfig
from rlhf.config.part import Part, flag

log = logging.getLogger(__name__)


@dataclass
class AlgoPart(Part):
    """The algorithm: KL, clipping and the actor's loss, the advantage estimator, reward shaping, dynamic filtering,
    where the old log-probs come from. Its neighbours in the same flag group are their own parts: the rollout
    corrections (``RolloutCorrectionConfig``), ptx (``PtxPart``), EMA (``EmaPart``)."""

    RESOLVED = ("old_logprobs_source", "old_logprobs_reason")
    init_kl_coef: float = flag(type=float, default=0.01)
    """(--init_kl_coef)"""
    kl_target: float | None = flag(type=float, help="adaptive KL target (default: fixed coefficient)", default=None)
    """(--kl_target) adaptive KL target"""
    kl_horizon: float = flag(type=float, default=10000)
    """(--kl_horizon)"""
    kl_estimator: str = flag(choices=["k1", "k2", "k3"], default="k1")
    """(--kl_estimator) k1 | k2 | k3"""
    use_kl_loss: bool | None = flag(action=argparse.BooleanOptionalAction,
                                    help="the KL penalty (--init_kl_coef x --kl_estimator) in the actor's loss for "
                                         "any estimator (OpenRLHF's --algo.kl.use_loss; k2 or k3 recommended there); "
                                         "--no-use_kl_loss: in the reward for any estimator (OpenRLHF without the "
                                         "flag, which an OpenRLHF command line gets). Default: in the loss for grpo, "
                                         "dr_grpo and group_norm, in the reward otherwise", default=None)
    """(--use_kl_loss) the KL in the loss (True), in the reward (False), by estimator (None)"""
    reward_clip_range: tuple | None = flag(type=float, nargs=2, metavar=("LOW", "HIGH"),
                                           help="clamp each sample's reward to [LOW, HIGH] after its group baseline, "
                                                "before the KL term (OpenRLHF's --reward.clip_range). Default: no "
                                                "clipping; an OpenRLHF command line gets OpenRLHF's -10 10",
                                           default=None)
    """(--reward_clip_range) LOW HIGH"""
    eps_clip: float = flag("--eps_clip", "--actor.eps_clip", type=float, default=0.2)
    """(--eps_clip, --actor.eps_clip)"""
    eps_clip_low_high: tuple | None = flag("--eps_clip_low_high", "--actor.eps_clip_low_high", type=float, nargs=2,
                                           metavar=("LOW", "HIGH"),
                                           help="asymmetric clipping (DAPO's clip-higher): ratios clipped to [1 - "
                                                "LOW, 1 + HIGH]; default: --eps_clip on both sides", default=None)
    """(--eps_clip_low_high) LOW HIGH"""
    dual_clip: float | None = flag("--dual_clip", "--actor.dual_clip", type=float,
                                   help="dual-clip PPO: for negative advantages the loss is at most -C * A (C > 1)",
                                   default=None)
    """(--dual_clip)"""
    policy_loss_type: str = flag("--policy_loss_type", "--actor.policy_loss_type",
                                 choices=["ppo", "gspo", "cispo", "sapo", "clip_cov", "kl_cov"],
                                 help="gspo: one length-normalised importance ratio per sequence (GSPO), "
                                      "sequence-level loss; cispo, sapo, clip_cov, kl_cov: verl's CISPO, SAPO "
                                      "(--tau_pos, --tau_neg), Clip-Cov (--clip_cov_ratio, --clip_cov_lb, "
                                      "--clip_cov_ub) and KL-Cov (--kl_cov_ratio, --ppo_kl_coef)", default="ppo")
    """(--policy_loss_type) ppo | gspo | cispo | sapo | clip_cov | kl_cov (``rlhf.algo.policy_variants``)"""
    loss_agg_mode: str | None = flag(choices=["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"],
                                     help="how per-token losses make the step's loss: token_mean (default; DAPO's "
                                          "token-level loss), seq_mean_token_mean (GRPO's original; the default with "
                                          "gspo), seq_mean_token_sum", default=None)
    """(--loss_agg_mode) None: token_mean (seq_mean_token_mean with gspo)"""
    entropy_coef: float | None = flag("--entropy_coef", "--actor.entropy_coef", type=float,
                                      help="entropy bonus: - coef * entropy joins the actor's loss (aggregated as it)",
                                      default=None)
    """(--entropy_coef)"""
    value_clip: float = flag(type=float, default=0.2)
    """(--value_clip)"""
    gamma: float = flag(type=float, default=1.0)
    """(--gamma)"""
    lambd: float = flag(type=float, default=1.0)
    """(--lambd)"""
    advantage_estimator: str = flag("--advantage_estimator", "--algo.advantage.estimator",
                                    help="gae | grpo (= group_norm, OpenRLHF's name) | dr_grpo | rloo | "
                                         "reinforce_baseline | reinforce_plus_plus (= reinforce)", default="gae")
    """(--advantage_estimator) OpenRLHF's "reinforce" becomes "reinforce_plus_plus" in ``check``"""
    no_std_norm: bool = flag("--no_std_norm", "--algo.advantage.no_std_norm", action="store_true",
                             help="gae, reinforce_plus_plus, reinforce_baseline: normalise advantages by the batch "
                                  "mean only, not the std", default=False)
    """(--no_std_norm)"""
    overlong_buffer_len: float | None = flag("--overlong_buffer_len", "--reward.overlong_buffer_len", type=float,
                                             help="DAPO's overlong penalty: a reply longer than --generate_max_len "
                                                  "minus this many tokens loses up to --overlong_penalty_factor, "
                                                  "linearly", default=None)
    """(--overlong_buffer_len) DAPO's overlong penalty"""
    overlong_penalty_factor: float = flag("--overlong_penalty_factor", "--reward.overlong_penalty_factor", type=float,
                                          default=1.0)
    """(--overlong_penalty_factor)"""
    stop_properly_penalty_coef: float | None = flag("--stop_properly_penalty_coef",
                                                    "--reward.stop_properly_penalty_coef", type=float,
                                                    help="ProRL: the reward of a reply cut at --generate_max_len is "
                                                         "scaled by this (in [0, 1]), or replaced by it when "
                                                         "negative", default=None)
    """(--stop_properly_penalty_coef) ProRL"""
    dynamic_filtering: bool = flag("--dynamic_filtering", "--algo.dynamic_filtering_enable", action="store_true",
                                   help="DAPO's dynamic sampling: drop prompts whose replies all score alike or "
                                        "whose mean score is outside --dynamic_filtering_range, and generate for "
                                        "more prompts until the batch is full", default=False)
    """(--dynamic_filtering) DAPO's dynamic sampling"""
    dynamic_filtering_range: tuple = flag("--dynamic_filtering_range", "--algo.dynamic_filtering_range", type=float,
                                          nargs=2, metavar=("LO", "HI"),
                                          help="a group is kept when LO < its mean score < HI (OpenRLHF's default: 0 "
                                               "1)", default=(0.0, 1.0))
    """(--dynamic_filtering_range) LO HI"""
    dynamic_filtering_max_rounds: int = flag(type=int, help="rollouts per step at most under --dynamic_filtering; a "
                                                            "batch still short after them is filled with the last "
                                                            "groups filtered out (counted)", default=4)
    """(--dynamic_filtering_max_rounds)"""
    old_logprobs_forward: str = flag(choices=["auto", "always"], help="auto: when each batch gets exactly one update "
                                                                      "(--max_epochs 1, --train_batch_size = the "
                                                                      "step's samples) and the KL is not in the "
                                                                      "reward, the policy that generated the batch "
                                                                      "is the one being trained, so its old "
                                                                      "log-probs are the update's own forward, "
                                                                      "detached (TRL does the same): no actor "
                                                                      "forward in make_experience. always: keep that "
                                                                      "forward", default="auto")
    """(--old_logprobs_forward) auto | always"""
    use_rollout_logprobs: bool = flag(action="store_true", help="the generator's log-probs are PPO's old log-probs: "
                                                                "no actor forward in make_experience (TRL reuses its "
                                                                "generation logits the same way); the drift metric "
                                                                "is then not measured", default=False)
    """(--use_rollout_logprobs) the generator's log-probs are the old ones"""
    old_logprobs_source: str = field(default="", init=False)
    """update | forward | rollout: set by ``validate`` (``rlhf.ppo.args.old_logprobs_source``)"""
    old_logprobs_reason: str = field(default="", init=False)
    """why, for the log"""


    def check(self) -> None:
        """The algorithm's own flags; ``check_algo`` checks them against the batch, the rewards and the rest."""
        if self.advantage_estimator == "reinforce":  # OpenRLHF's name
            self.advantage_estimator = "reinforce_plus_plus"
        if self.dynamic_filtering:
            lo, hi = self.dynamic_filtering_range
            if lo >= hi:
                raise ValueError(f"--dynamic_filtering_range {lo:g} {hi:g}: LO must be below HI")
            if self.dynamic_filtering_max_rounds < 1:
                raise ValueError(f"--dynamic_filtering_max_rounds must be >= 1, got "
                                 f"{self.dynamic_filtering_max_rounds}")
        if self.reward_clip_range is not None and not self.reward_clip_range[0] < self.reward_clip_range[1]:
            lo, hi = self.reward_clip_range
            raise ValueError(f"--reward_clip_range {lo:g} {hi:g}: LOW must be below HIGH")


def add_algo_args(g) -> None:
    """The flag group "optimisation" ends with: the algorithm, the rollout corrections, ptx, EMA (four parts)."""
    from rlhf.ppo.ema import EmaPart
    from rlhf.ppo.ptx import PtxPart

    AlgoPart.add_args(g)
    RolloutCorrectionConfig.add_args(g)  # --use_tis, --tis_cap, --tis_floor, --is_correction_type, --rollout_rs*
    PtxPart.add_args(g)
    EmaPart.add_args(g)


def check_algo(job) -> None:
    """The algorithm's flags against the rest of the job (``PPOJobConfig``), before any model: the estimator and
    the loss, then what shapes the batch (``_check_batching_and_rewards``) and the KL's place. Each part checked
    its own values when it was built."""
    from rlhf.algo.advantages import get_estimator

    algo, corr, batch = job.algo, job.correction, job.batch
    if algo.use_rollout_logprobs and corr.use_tis:
        raise ValueError("--use_tis weighs by the trainer's old log-probs over the generator's, but with "
                         "--use_rollout_logprobs they are the same; verl's bypass mode takes --rollout_is / "
                         "--rollout_rs with it (computed against the current policy in the loss)")
    if algo.use_rollout_logprobs and corr.rollout_is_batch_normalize:
        raise ValueError("--rollout_is_batch_normalize with --use_rollout_logprobs (verl's bypass mode): the weights "
                         "are computed per micro-batch in the loss there; not supported")
    if corr.rollout_rs is not None and job.ptx.pretrain_data:
        raise ValueError(f"--rollout_rs {corr.rollout_rs} with --pretrain_data: the ptx loss is scaled by the step's "
                         "response tokens counted before the rejection; not supported together")
    estimator = get_estimator(algo.advantage_estimator)
    if estimator.needs_groups and batch.n_samples_per_prompt < 2:
        raise ValueError(f"--advantage_estimator {algo.advantage_estimator} needs --n_samples_per_prompt >= 2, "
                         f"got {batch.n_samples_per_prompt}")
    if algo.advantage_estimator in ("rloo", "reinforce_baseline") and algo.gamma != 1.0:
        raise ValueError(f"--advantage_estimator {algo.advantage_estimator} with --gamma {algo.gamma}: its return is "
                         "undiscounted (OpenRLHF sets gamma to 1 for it); drop --gamma")
    from rlhf.algo.ppo_losses import ActorLossConfig

    loss_cfg = ActorLossConfig.from_parts(algo, job.correction, estimator)  # the loss flags' own checks
    if algo.policy_loss_type == "gspo" and estimator.needs_critic:
        raise ValueError(f"--policy_loss_type gspo with --advantage_estimator {algo.advantage_estimator}: GSPO's "
                         "sequence-level ratio needs sequence-level advantages; use a critic-free estimator (grpo, "
                         "rloo, reinforce_baseline, ...)")
    if algo.policy_loss_type == "gspo" and loss_cfg.loss_agg_mode != "seq_mean_token_mean":
        raise ValueError(f"--policy_loss_type gspo with --loss_agg_mode {algo.loss_agg_mode}: GSPO's loss is a mean "
                         "over sequences of their token means (seq_mean_token_mean)")
    if loss_cfg.loss_agg_mode != "token_mean" and job.ptx.pretrain_data:
        raise ValueError(f"--pretrain_data with --loss_agg_mode {loss_cfg.loss_agg_mode} (or --policy_loss_type gspo): "
                         "the ptx loss is combined with a token-level policy loss only")
    _check_batching_and_rewards(job)
    _check_kl_place(algo, estimator)


def _check_batching_and_rewards(job) -> None:
    """Dynamic batching, reward shaping, held-out evaluation, dynamic filtering and normalisation against the
    batch, the layout and the rewards."""
    from rlhf.algo.shaping import ShapingConfig

    algo, batch, gen, rewards = job.algo, job.batch, job.generation, job.rewards
    if batch.use_dynamic_batch:
        if not job.engine.packing_samples:
            raise ValueError("--use_dynamic_batch forms micro-batches by token count, which only pays without padding: "
                             "add --packing_samples")
        if job.parallel.pp > 1:
            raise ValueError("--use_dynamic_batch with --pipeline_model_parallel_size > 1: a pipeline needs the same "
                             "number of micro-batches on every stage of each step; not supported yet")
        if batch.max_tokens_per_gpu < gen.prompt_max_len + gen.generate_max_len:
            raise ValueError(f"--max_tokens_per_gpu {batch.max_tokens_per_gpu} is below --prompt_max_len "
                             f"{gen.prompt_max_len} + --generate_max_len {gen.generate_max_len}: a sample may not fit")
    ShapingConfig.from_parts(gen, algo)  # the penalties' own checks
    if job.eval.dataset and not (rewards.reward_fn or rewards.remote_rm_url or rewards.agent):
        raise ValueError("--eval_dataset scores the held-out replies with the run's rule reward (--reward_fn or "
                         "--remote_rm_url) or its agent's environments (--agent_func_path); this run has none")
    if algo.dynamic_filtering:
        if batch.n_samples_per_prompt < 2:
            raise ValueError(f"--dynamic_filtering with --n_samples_per_prompt {batch.n_samples_per_prompt}: it keeps "
                             "prompts whose replies score differently, which needs at least 2 replies per prompt")
        if (rewards.reward_pretrain or rewards.judge is not None
                or not (rewards.reward_fn or rewards.remote_rm_url or job.agent.agent_func_path)):
            raise ValueError("--dynamic_filtering filters on the scores of a rule reward (--reward_fn, "
                             "--remote_rm_url or an agent's) before any model runs; it does not combine with "
                             "--reward_pretrain or an LLM judge (--judge_pretrain, --judge_url)")
    if algo.no_std_norm and algo.advantage_estimator not in ("gae", "reinforce_plus_plus", "reinforce_baseline"):
        raise ValueError(f"--no_std_norm with --advantage_estimator {algo.advantage_estimator}: only gae, "
                         "reinforce_plus_plus and reinforce_baseline normalise by a batch std (dr_grpo is grpo "
                         "without its group std)")


def _check_kl_place(args: AlgoPart, estimator) -> None:
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
