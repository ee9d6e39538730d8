"""The flags of partial rollouts (``--partial_rollout``, ``--max_staleness``, ...), the job's checks, and which
correction the carried tokens are trained with (docs/async.md); the rollouts themselves are ``rlhf.rollout.partial``."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlhf.config.part import Part, flag

PARTIAL_CORRECTIONS = ("decoupled", "mask_offpolicy", "none")


@dataclass
class PartialRolloutConfig(Part):
    """Partial rollouts and their staleness bound (``launch/ppo.py``; OpenRLHF: ``--train.async_enable
    --train.partial_rollout_enable``)."""

    partial_rollout: bool = flag(action="store_true", help="partial rollouts (verl colocate_async, slime "
                                                           "--partial-rollout): generate for more prompts than a "
                                                           "step trains, stop vLLM once --rollout_batch_size whole "
                                                           "groups are done, carry the unfinished samples with their "
                                                           "tokens into the next step (OpenRLHF: "
                                                           "--train.async_enable --train.partial_rollout_enable)",
                                 default=False)
    """(--partial_rollout) stop generating once a step's groups are whole; carry the rest to the next step"""
    max_staleness: int = flag(type=int, help="--partial_rollout: a trained token is at most K weight updates old: a "
                                             "round is not stopped before every group that could not be carried once "
                                             "more is whole, and those are trained first, so nothing generated is "
                                             "discarded (0: nothing crosses an update, the synchronous trainer). "
                                             "NeMo-RL max_trajectory_age_steps, AReaL max_head_offpolicyness, "
                                             "prime-rl max_off_policy_steps, TRL max_staleness", default=1)
    """(--max_staleness) a trained token is at most this many weight updates older than the weights trained"""
    partial_rollout_oversample: float = flag(type=float, help="--partial_rollout: groups started per step beyond "
                                                              "--rollout_batch_size, as a fraction of it", default=0.25)
    """(--partial_rollout_oversample) extra groups started per step, a fraction of --rollout_batch_size"""
    vllm_generate_batch_size: int | None = flag("--vllm_generate_batch_size", "--rollout.vllm_generate_batch_size",
                                                type=int, help="--partial_rollout: prompts (groups) in flight per "
                                                               "step, carried ones included, at least "
                                                               "--rollout_batch_size (OpenRLHF's flag; replaces "
                                                               "--partial_rollout_oversample)", default=None)
    """(--vllm_generate_batch_size) groups in flight per step, carried ones included; replaces the oversample"""
    partial_rollout_drop_stale: bool = flag(action="store_true", help="--partial_rollout: instead of waiting for the "
                                                                      "groups that --max_staleness makes due, drop a "
                                                                      "carried group with an older token at the "
                                                                      "start of a step (finished samples included) "
                                                                      "and start its prompt again", default=False)
    """(--partial_rollout_drop_stale) drop a carried group with a token older than --max_staleness at the start of a
    step (its prompt started again) instead of waiting for it to finish within the bound"""
    partial_rollout_correction: str = flag(choices=PARTIAL_CORRECTIONS,
                                           help="--partial_rollout: what corrects for carried tokens' older policy "
                                                "when neither --use_tis nor --rollout_rs is given: decoupled "
                                                "(AReaL's decoupled PPO loss: ratio against this step's weights, "
                                                "times the behaviour weight p_trainer / p_generator, tokens whose "
                                                "weight exceeds 5 masked), mask_offpolicy (slime's "
                                                "--mask-offpolicy-in-partial-rollout: only this step's tokens are "
                                                "trained) or none (trained as if on-policy)", default="decoupled")
    """(--partial_rollout_correction) the correction a carried token is trained with when no --use_tis / --rollout_rs
    is given: ``decoupled`` (AReaL's decoupled PPO loss, ``decoupled_correction``) or ``none``"""
    async_one_step_off: bool = flag(action="store_true", help="OpenRLHF's --train.async_enable without "
                                                              "--train.partial_rollout_enable: every step trains "
                                                              "whole groups generated --max_staleness updates "
                                                              "earlier (one policy version each) and generates those "
                                                              "of a later step. In one colocated job it costs the "
                                                              "staleness without the overlap of generation and "
                                                              "training that is its point in OpenRLHF", default=False)
    """(--async_one_step_off) OpenRLHF's --train.async_enable alone: every step trains whole groups generated
    --max_staleness updates earlier, each by one policy version, and generates the groups of a later step"""
    correction_used: str = field(default="", init=False)
    """what the trainer corrects carried tokens with, resolved by ``check_partial`` (logged at start)"""

    RESOLVED = ("correction_used",)


    def check(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"--max_staleness must be >= 0, got {self.max_staleness}")
        if self.partial_rollout_correction not in PARTIAL_CORRECTIONS:
            raise ValueError(f"--partial_rollout_correction {self.partial_rollout_correction!r}: expected one of "
                             f"{', '.join(PARTIAL_CORRECTIONS)}")
        if not 0 <= self.partial_rollout_oversample <= 8:
            raise ValueError(f"--partial_rollout_oversample must be in [0, 8], got {self.partial_rollout_oversample:g}")

    @property
    def enabled(self) -> bool:
        """Samples cross weight updates: partial rollouts, or whole groups one step off."""
        return self.partial_rollout or self.async_one_step_off

    @property
    def whole_groups(self) -> bool:
        """``--async_one_step_off`` alone: every round runs every sample to its end (nothing is aborted)."""
        return self.async_one_step_off and not self.partial_rollout

    def extra_groups(self, batch_groups: int) -> int:
        if self.max_staleness == 0:
            return 0
        if self.whole_groups:  # the batches generated ahead of the one trained
            return self.max_staleness * batch_groups
        if self.vllm_generate_batch_size is not None:
            return self.vllm_generate_batch_size - batch_groups
        return math.ceil(self.partial_rollout_oversample * batch_groups)


def check_partial(job) -> None:
    """``--partial_rollout`` against the rest of the job (``PPOJobConfig``), before any model: the combinations not
    built yet are refused by name, with the reason."""
    p = job.partial
    if p.async_one_step_off and not p.partial_rollout and p.vllm_generate_batch_size is not None:
        raise ValueError(f"--vllm_generate_batch_size {p.vllm_generate_batch_size} with --async_one_step_off: the "
                         "groups generated ahead are --max_staleness whole batches; drop one of them")
    if p.async_one_step_off and p.max_staleness < 1:
        raise ValueError("--async_one_step_off needs --max_staleness >= 1 (the batches generated ahead; OpenRLHF's "
                         "--train.async_queue_size)")
    if p.vllm_generate_batch_size is not None and not p.enabled:
        raise ValueError(f"--vllm_generate_batch_size {p.vllm_generate_batch_size} starts more prompts than a step "
                         "trains, which only --partial_rollout carries over (OpenRLHF: --train.partial_rollout_enable)")
    if not p.enabled:
        return
    if p.vllm_generate_batch_size is not None and p.vllm_generate_batch_size < job.batch.rollout_batch_size:
        raise ValueError(f"--vllm_generate_batch_size {p.vllm_generate_batch_size} must be at least "
                         f"--rollout_batch_size {job.batch.rollout_batch_size}")
    if job.agent.agent_func_path and p.partial_rollout_drop_stale:
        raise ValueError("--partial_rollout_drop_stale with --agent_func_path: an agent's carried sessions are parked "
                         "programs, not data, and are never dropped (rlhf.agents.carry); --max_staleness bounds them")
    extra, batch = p.extra_groups(job.batch.rollout_batch_size), job.batch.rollout_batch_size
    if not p.partial_rollout_drop_stale and not p.whole_groups and extra > batch:
        name = (f"--vllm_generate_batch_size {p.vllm_generate_batch_size}" if p.vllm_generate_batch_size is not None
                else f"--partial_rollout_oversample {p.partial_rollout_oversample:g}")
        raise ValueError(f"{name} starts {extra} groups beyond --rollout_batch_size {batch}: more groups could come "
                         f"due under --max_staleness {p.max_staleness} at once than a step trains; start at most "
                         f"{batch} extra (--vllm_generate_batch_size <= {2 * batch}), or pass "
                         "--partial_rollout_drop_stale to drop what is too old instead")
    resolve_correction(job)



def decoupled_correction():
    """AReaL's decoupled PPO loss as a rollout correction: the PPO ratio and clip against the trainer's log-probs at
    this step's weights (the proximal policy; ``old_logprobs`` here), the per-token loss times the detached behaviour
    weight ``w = exp(old_logprobs - generator log-prob)``, and a token whose w exceeds 5 masked (weight 0, its place
    in the loss's denominator kept). AReaL ``areal/utils/functional/functional.py`` ``ppo_actor_loss_fn`` with
    ``apply_rejection_sampling`` at 4aef98d8 and ``rejection_sampling: {level: token, action: mask, metric: ratio,
    upper: 5.0}``, which ``areal/api/cli_args.py`` names as its former default (``behave_imp_weight_cap=5.0``,
    ``token_mask``). Computed here as OpenRLHF's ``icepop`` with bounds [0, 5] (``rlhf.algo.rollout_correction``)."""
    from rlhf.algo.rollout_correction import RolloutCorrectionConfig

    return RolloutCorrectionConfig(use_tis=True, is_correction_type="icepop", tis_floor=None, tis_cap=5.0)


def resolve_correction(job) -> None:
    """What corrects carried tokens, decided once as the job is checked: the flags' own correction (--use_tis,
    --rollout_rs), the ratio against the generator's log-probs (--use_rollout_logprobs: verl's bypass mode), else
    ``--partial_rollout_correction`` (AReaL's decoupled loss by default: ``job.correction`` becomes it). Recorded in
    ``job.partial.correction_used`` and logged at start."""
    p, corr = job.partial, job.correction
    if p.max_staleness == 0 and not corr.enabled:
        p.correction_used = "none needed (--max_staleness 0: every trained token is this step's policy's)"
        return
    if getattr(job.algo, "use_rollout_logprobs", False):
        p.correction_used = ("verl's bypass mode: old log-probs are the generator's, so the clipped PPO ratio is taken "
                             "against the policy that sampled each token")
    elif corr.enabled:
        p.correction_used = "the flags' own: " + ", ".join(
            x for x in (f"--use_tis ({corr.is_correction_type}, [{corr.tis_floor or 0:g}, {corr.tis_cap:g}])"
                        if corr.use_tis else "", f"--rollout_rs {corr.rollout_rs}" if corr.rollout_rs else "") if x)
    elif p.partial_rollout_correction == "mask_offpolicy":
        p.correction_used = ("slime's --mask-offpolicy-in-partial-rollout: tokens of earlier policies leave the loss "
                             "(only this step's tokens are trained)")
    elif p.partial_rollout_correction == "decoupled":
        job.correction = decoupled_correction()
        p.correction_used = ("AReaL's decoupled PPO loss (ratio against this step's weights; behaviour weight "
                             "p_trainer/p_generator, tokens above 5 masked); --partial_rollout_correction none turns "
                             "it off")
    else:
        p.correction_used = ("none (--partial_rollout_correction none): tokens of earlier policies are trained as if "
                             "on-policy")
    if getattr(job.algo, "policy_loss_type", "ppo") == "gspo" and job.correction.use_tis:
        p.correction_used = ("GSPO's sequence ratio taken against the generator's log-probs, clipped (OpenRLHF's GSPO "
                             "with its IS correction: no per-token weight)")
