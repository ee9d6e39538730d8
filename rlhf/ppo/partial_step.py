"""The rollout stage of a PPO step with ``--partial_rollout`` (issue 44): the carried groups and new prompts go to
the engine (``rlhf.rollout.partial``), the first ``--rollout_batch_size`` whole groups (oldest first) are trained,
the rest is carried. What follows (experience, advantages, update) is the synchronous step's, on those groups; the
generator's per-token log-probs, which may span several policy versions, are the behaviour policy of the rollout
corrections (``--use_tis`` and ``--is_correction_type``).

With ``--dynamic_filtering`` (DAPO's dynamic sampling, as slime filters its partial rollouts) the whole groups a
round yields are scored, the ones ``rlhf.algo.shaping.keep_groups`` passes are kept and the rest dropped (their
prompts are not started again, as in the synchronous step), and further rounds at the same weights ask the engine
for the groups still missing, up to ``--dynamic_filtering_max_rounds``; a batch still short is filled with the
groups filtered out last. With ``--max_staleness 0`` each round is a whole batch of new prompts run to its end: the
synchronous step's dynamic filtering (``rlhf.ppo.stages.generate_filtered``) exactly."""
from __future__ import annotations

import dataclasses

from rlhf.ppo.stages import Rollout, fill_filtered, make_rollout, rollout_phase
from rlhf.rollout.partial import PartialRollouts, PartialSample, generate_partial


def build_partial(job) -> PartialRollouts | None:
    cfg, batch = job.partial, job.batch
    if not cfg.enabled:
        return None
    return PartialRollouts(n=batch.n_samples_per_prompt, batch_groups=batch.rollout_batch_size,
                           oversample_groups=cfg.extra_groups(batch.rollout_batch_size),
                           max_staleness=cfg.max_staleness, drop_stale=cfg.partial_rollout_drop_stale)


def _samples(groups: list[list[PartialSample]]) -> list:
    return [dataclasses.replace(s.to_sample(), prompt_index=g) for g, grp in enumerate(groups) for s in grp]


def _passing(groups: list[list[PartialSample]], rewards, job) -> list[bool]:
    """Dynamic filtering's verdict on whole groups. Every rank scores every sample (the rule reward is cheap, and
    the verdict must be the same everywhere): the scores the synchronous step all-gathers from the ranks' shares."""
    from rlhf.algo.shaping import keep_groups

    samples = _samples(groups)
    rollout = Rollout(prompt_idx=[g[0].prompt_index for g in groups], samples=samples, local=samples)
    rewards.score({}, rollout)  # the reward's "scores" when it gives them (OpenRLHF), else its rewards
    lo, hi = job.algo.dynamic_filtering_range
    return keep_groups(rewards.filter_scores.float().cpu(), job.batch.n_samples_per_prompt, lo, hi).tolist()


def generate_partial_step(roles, job, partial: PartialRollouts, prompts: list, sampler, step: int, mesh, timer,
                          rewards=None, closing: bool = False) -> tuple[Rollout, dict[str, float]]:
    """The step's rollout. ``step`` is the policy version: the weight updates applied so far. ``rewards``
    (``RewardSources``) scores the groups under ``--dynamic_filtering``. ``closing``: a checkpoint follows the
    step, so an agent's sessions all run to their ends (a live session is not data a checkpoint can hold)."""
    gen, algo, want = job.generation, job.algo, partial.batch_groups
    filtering = algo.dynamic_filtering
    metrics = partial.drop_stale(step)
    kept: list[list[PartialSample]] = []
    dropped: list[list[PartialSample]] = []
    rounds = seen = aborted = generated = new_groups = waited = 0
    while True:
        # a round asks for the groups still missing; at K = 0 for a whole batch, as the synchronous step does
        ask = want if partial.max_staleness == 0 else want - len(kept)
        new = partial.take_prompts(partial.new_prompts_needed(ask), lambda: sampler.next_step()[0])
        # the synchronous step's seed (rlhf.ppo.stages.generate, round ``rounds``)
        seed = job.engine.seed * 100_003 + step + 1_000_003 * rounds
        groups = partial.round_groups([(i, prompts[i].prompt_ids.tolist()) for i in new], step_seed=seed)
        due = partial.due(groups, step)  # groups the staleness bound makes this round finish (and the step train)
        waited += sum(due)
        with rollout_phase(roles, timer):  # the synchronous step's memory phase, sync and engine wake-up
            needed = len(groups) if job.partial.whole_groups or (closing and roles.agent is not None) \
                else partial.groups_needed(groups, ask)
            kw = dict(groups_needed=needed, temperature=gen.temperature, top_p=gen.top_p,
                      max_tokens=gen.generate_max_len, version=step, due=due)
            if roles.agent is not None:  # live sessions are parked, not aborted (rlhf.agents.carry)
                from rlhf.agents.carry import agent_round

                groups, counts = agent_round(roles.agent, roles.rollout, prompts, groups, seed=seed, **kw)
            else:
                groups, counts = generate_partial(roles.rollout, groups, ignore_eos=gen.ignore_eos, **kw)
        train, m = partial.settle(groups, step, ask)
        rounds += 1
        aborted, generated, new_groups = aborted + counts["aborted"], generated + counts["generated"], \
            new_groups + len(new)
        if not filtering:
            kept = train
            break
        seen += len(train)
        for g, ok in zip(train, _passing(train, rewards, job)):
            (kept if ok else dropped).append(g)
        if len(kept) >= want or rounds >= algo.dynamic_filtering_max_rounds:
            break
    train, filter_metrics = (fill_filtered(kept, dropped, want, seen=seen, rounds=rounds, generated=generated)
                             if filtering else (kept, {}))
    if len(train) < want:
        raise RuntimeError(f"partial rollout: {len(train)} whole groups after the round, {want} needed (the "
                           "engine stopped early)")
    metrics.update(m)
    metrics.update(partial.trained_metrics(train, step))
    metrics.update({"partial/aborted_samples": float(aborted), "partial/generated_tokens": float(generated),
                    "partial/new_groups": float(new_groups), "partial/due_groups": float(waited)})
    metrics.update(filter_metrics)
    samples = _samples(train)
    if roles.agent is not None:  # the trained trajectories' agent/* metrics, as the synchronous step logs them
        metrics.update(roles.agent._metrics(samples))
    return make_rollout([grp[0].prompt_index for grp in train], samples, mesh), metrics


def mask_offpolicy(exp, version: int, mesh) -> dict[str, float]:
    """``--partial_rollout_correction mask_offpolicy`` (slime's ``--mask-offpolicy-in-partial-rollout``,
    slime/rollout/sglang_rollout.py at 624b824a: a resumed sample's earlier tokens get ``loss_mask`` 0): every token
    a version other than ``version`` produced leaves the batch's action mask, after the advantages; a sample carried
    whole from an earlier round is masked whole, as slime's recycled samples are. Returns the share masked."""
    import torch

    mask = exp.batch["action_mask"]
    fresh = torch.zeros_like(mask, dtype=torch.bool)
    for i, s in enumerate(exp.samples):
        v = torch.as_tensor(s.versions or [], dtype=torch.long)[: mask.shape[1]]
        fresh[i, : v.numel()] = (v == version).to(mask.device)
    from rlhf.distributed.collectives import dp_all_gather

    kept = mask.bool() & fresh
    exp.batch["action_mask"] = kept.to(mask.dtype)
    n = dp_all_gather(torch.tensor([[float(mask.bool().sum()), float(kept.sum())]], device=mask.device), mesh).sum(0)
    return {"partial/masked_offpolicy_frac": 1 - n[1].item() / max(n[0].item(), 1.0)}


def drift_by_age(exp, version: int, mesh) -> dict[str, float]:
    """The generator-vs-trainer log-prob drift (``rollout_logprob_drift``) split by token age, over the global
    batch: ``partial/logprob_drift_fresh`` (and ``_max``) over the tokens this step's weights generated, the weights
    the trainer's old log-probs come from, so only a sync or kernel mismatch shows there, as in a synchronous step;
    ``partial/logprob_drift_carried`` (and ``_max``, ``_min``) over tokens of earlier versions, which the updates
    since have moved (what the rollout corrections weigh; a carried token that did not move is one whose version is
    wrong). Only where the old log-probs are the trainer's own forward."""
    import torch

    from rlhf.algo.ppo_losses import masked_mean
    from rlhf.distributed.collectives import dp_all_gather

    mask = exp.batch["action_mask"]
    fresh = torch.zeros_like(mask, dtype=torch.bool)
    for i, s in enumerate(exp.samples):
        v = torch.as_tensor(s.versions or [], dtype=torch.long)[: mask.shape[1]]
        fresh[i, : v.numel()] = (v == version).to(mask.device)
    diff = dp_all_gather((exp.vllm_logprobs - exp.old_logprobs).abs(), mesh)
    gmask, gfresh = dp_all_gather(mask, mesh).bool(), dp_all_gather(fresh, mesh)
    out = {}
    for name, m in (("fresh", gmask & gfresh), ("carried", gmask & ~gfresh)):
        if m.any():
            out[f"partial/logprob_drift_{name}"] = masked_mean(diff, m).item()
            out[f"partial/logprob_drift_{name}_max"] = diff.masked_fill(~m, 0).max().item()
            out[f"partial/logprob_drift_{name}_min"] = diff.masked_fill(~m, float("inf")).min().item()
    return out
