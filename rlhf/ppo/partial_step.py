"""The rollout stage of a PPO step with ``--partial_rollout`` (issue 44): the carried groups and new prompts go to
the engine (``rlhf.rollout.partial``), the first ``--rollout_batch_size`` whole groups (oldest first) are trained,
the rest is carried. What follows (experience, advantages, update) is the synchronous step's, on those groups; the
generator's per-token log-probs, which may span several policy versions, are the behaviour policy of the rollout
corrections (``--use_tis`` and ``--is_correction_type``)."""
from __future__ import annotations

import dataclasses

from rlhf.ppo.stages import Rollout, make_rollout, rollout_phase
from rlhf.rollout.partial import PartialRollouts, generate_partial


def build_partial(job) -> PartialRollouts | None:
    cfg, batch = job.partial, job.batch
    if not cfg.partial_rollout:
        return None
    return PartialRollouts(n=batch.n_samples_per_prompt, batch_groups=batch.rollout_batch_size,
                           oversample_groups=cfg.extra_groups(batch.rollout_batch_size),
                           max_staleness=cfg.max_staleness)


def generate_partial_step(roles, job, partial: PartialRollouts, prompts: list, sampler,
                          step: int, mesh, timer) -> tuple[Rollout, dict[str, float]]:
    """The step's rollout. ``step`` is the policy version: the weight updates applied so far."""
    seed = job.engine.seed * 100_003 + step  # the synchronous step's seed (rlhf.ppo.stages.generate, round 0)
    gen = job.generation
    metrics = partial.drop_stale(step)
    new = partial.take_prompts(partial.new_prompts_needed(), lambda: sampler.next_step()[0])
    groups = partial.round_groups([(i, prompts[i].prompt_ids.tolist()) for i in new], step_seed=seed)
    with rollout_phase(roles, timer):  # the synchronous step's memory phase, sync and engine wake-up
        groups, counts = generate_partial(roles.rollout, groups, groups_needed=partial.groups_needed(groups),
                                          temperature=gen.temperature, top_p=gen.top_p,
                                          max_tokens=gen.generate_max_len, version=step, ignore_eos=gen.ignore_eos)
    train, m = partial.settle(groups, step)
    if len(train) < partial.batch_groups:
        raise RuntimeError(f"partial rollout: {len(train)} whole groups after the round, {partial.batch_groups} "
                           "needed (the engine stopped early)")
    samples = [dataclasses.replace(s.to_sample(), prompt_index=g) for g, grp in enumerate(train) for s in grp]
    metrics.update(m)
    metrics.update({"partial/aborted_samples": float(counts["aborted"]),
                    "partial/generated_tokens": float(counts["generated"]),
                    "partial/new_groups": float(len(new))})
    return make_rollout([grp[0].prompt_index for grp in train], samples, mesh), metrics
