"""The stages of one PPO step, in order: sync -> generate -> make_experience -> compute_advantages -> update.

Each stage is a function of the roles (``rlhf.ppo.roles.PPORoles``), ``job`` (``rlhf.ppo.args.PPOJobConfig``, of
which each stage reads the parts it needs) and the previous stage's record, timed by phase name, and enters its memory
phase (``rlhf.runtime.offload``) before it runs."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from rlhf.distributed.collectives import dp_all_gather
from rlhf.ppo import routing
from rlhf.ppo.experience import (Experience, collate_sequences, forward_role, generator_logprobs,
                                 prepare_microbatches, select_rows)
from rlhf.ppo.reward_sources import RewardSources
from rlhf.rollout.types import Sample


def sync_weights(roles, timer) -> dict[str, float]:
    """weight_sync: the actor's shards into the generator (after each update, and once at the start)."""
    roles.memory.enter("weight_sync")
    with timer.phase("weight_sync"):
        roles.rollout.wake_up(["weights"])
        return roles.weight_sync.sync(roles.rollout)


@dataclass
class Rollout:
    """What ``generate`` made: every sample of the step, and this DP rank's share."""

    prompt_idx: list[int]
    """the step's prompts, as indices into the prompt dataset"""
    samples: list[Sample]
    """every sample of the step, prompt-major (the same list on every rank)"""
    local: list[Sample]
    """this DP rank's contiguous share of ``samples``"""
    metrics: dict = field(default_factory=dict)
    """what the generation reports (the agents' agent/* figures)"""

    @property
    def tokens(self) -> float:
        """prompt + response tokens of every sample (the throughput figures' numerator)"""
        return float(sum(len(s.prompt_ids) + len(s.response_ids) for s in self.samples))

    @property
    def generated_tokens(self) -> int:
        """The tokens the generator sampled: a multi-turn trajectory's actions, not its environment's tokens."""
        return sum(len(s.response_ids) if s.action_mask is None else sum(s.action_mask) for s in self.samples)


@contextlib.contextmanager
def rollout_phase(roles, timer) -> Iterator[None]:
    """Around a rollout: its memory phase, a weight sync if a CPU engine released its weights after the previous
    rollout, then the engine awake with its KV cache, timed as ``rollout``, and asleep again after."""
    # The fallback generator runs the actor itself, so its parameters stay resident (weight_sync's residency).
    phase = "weight_sync" if roles.rollout.reads_actor_params else "rollout"
    roles.memory.enter(phase)
    if roles.rollout.needs_sync:
        sync_weights(roles, timer)
        roles.memory.enter(phase)
    with timer.phase("rollout"):
        roles.rollout.wake_up(["kv_cache"])
        yield
        roles.rollout.sleep()


def generate(roles, job, prompts: list, prompt_idx: list[int], step: int, mesh,
             timer, round_: int = 0) -> Rollout:
    """rollout: ``--n_samples_per_prompt`` samples per prompt; ``prompts`` are the dataset's PromptSamples.
    ``round_``: the rollout's number within the step (dynamic filtering generates again), in its seed."""
    from rlhf.rollout.types import generation_prompt

    gen, n = job.generation, job.batch.n_samples_per_prompt
    seed, metrics = job.engine.seed * 100_003 + step + 1_000_003 * round_, {}
    with rollout_phase(roles, timer):
        if roles.agent is not None:  # multi-turn trajectories (rlhf.agents.rollout)
            samples, metrics = roles.agent.run(roles.rollout, prompts, prompt_idx, n=n, temperature=gen.temperature,
                                               top_p=gen.top_p, max_tokens=gen.generate_max_len, seed=seed,
                                               version=roles.weight_sync.version)
        else:
            samples = roles.rollout.generate([generation_prompt(prompts[i]) for i in prompt_idx],
                                             n=n, temperature=gen.temperature, top_p=gen.top_p,
                                             max_tokens=gen.generate_max_len, seed=seed, ignore_eos=gen.ignore_eos)
    return make_rollout(prompt_idx, samples, mesh, metrics)


def make_rollout(prompt_idx: list[int], samples: list[Sample], mesh, metrics: dict | None = None) -> Rollout:
    per = len(samples) // mesh.dp
    return Rollout(prompt_idx=prompt_idx, samples=samples, local=samples[mesh.dp_rank * per:(mesh.dp_rank + 1) * per],
                   metrics=metrics or {})


def generate_filtered(roles, job, prompts: list, sampler, rewards: "RewardSources", step: int,
                      mesh, timer) -> tuple[Rollout, dict[str, float]]:
    """rollout with DAPO's dynamic sampling (``--dynamic_filtering``): generate for a batch of prompts, keep the
    groups ``rlhf.algo.shaping.keep_groups`` passes (on the rule reward's scores), and generate for the sampler's
    next batch until ``--rollout_batch_size`` groups are kept or ``--dynamic_filtering_max_rounds`` rollouts ran;
    a batch still short is filled with the last groups filtered out. The sampler's position is checkpointed, so
    a resumed run draws the same prompts. Without the flag: one rollout of the sampler's next batch."""
    import dataclasses

    from rlhf.algo.shaping import keep_groups

    rollout = generate(roles, job, prompts, sampler.next_step()[0], step, mesh, timer)
    algo = job.algo
    if not algo.dynamic_filtering:
        return rollout, rollout.metrics
    n, want, (lo, hi) = job.batch.n_samples_per_prompt, job.batch.rollout_batch_size, algo.dynamic_filtering_range
    kept: list[tuple[int, list[Sample]]] = []
    dropped: list[tuple[int, list[Sample]]] = []
    rounds, seen, generated = 0, 0, 0
    while True:
        rounds += 1
        generated += rollout.generated_tokens
        rewards.score({}, rollout)  # the reward's "scores" when it gives them (OpenRLHF), else its rewards
        local = rewards.filter_scores.float().to(mesh.device)
        ok = keep_groups(dp_all_gather(local, mesh).cpu(), n, lo, hi).tolist()  # the same on every rank
        for g, p in enumerate(rollout.prompt_idx):
            (kept if ok[g] else dropped).append((p, rollout.samples[g * n:(g + 1) * n]))
        seen += len(rollout.prompt_idx)
        if len(kept) >= want or rounds >= algo.dynamic_filtering_max_rounds:
            break
        rollout = generate(roles, job, prompts, sampler.next_step()[0], step, mesh, timer, round_=rounds)
    groups, metrics = fill_filtered(kept, dropped, want, seen=seen, rounds=rounds, generated=generated)
    samples = [dataclasses.replace(s, prompt_index=g) for g, (_, grp) in enumerate(groups) for s in grp]
    # agent/*: the trained trajectories' (from every round), as the partial-rollout step logs them
    base = roles.agent._metrics(samples) if roles.agent is not None else rollout.metrics
    return make_rollout([p for p, _ in groups], samples, mesh), {**base, **metrics}


def fill_filtered(kept: list, dropped: list, want: int, *, seen: int, rounds: int, generated: int) -> tuple[list, dict]:
    """Dynamic filtering's batch (the first ``want`` kept groups; short, the groups filtered out last fill it) and
    its metrics; ``seen`` groups were scored in ``rounds`` rollouts of ``generated`` tokens."""
    passed = len(kept)
    return (kept + dropped[::-1])[:want], {
        "dynamic_filtering/pass_rate": passed / seen, "dynamic_filtering/rounds": float(rounds),
        "dynamic_filtering/prompts": float(seen), "dynamic_filtering/filled": float(max(0, want - passed)),
        "dynamic_filtering/generated_tokens": float(generated)}


def experience_microbatches(rollout: Rollout, job, mesh,
                            pad_id: int, roles=None) -> tuple[dict, list, list[int]]:
    """This rank's samples collated on the device (B rows, response width T = --generate_max_len; R3's routing), the
    --micro_rollout_batch_size micro-batches of the experience forwards (packed with --packing_samples; by token
    count with --use_dynamic_batch), and the rows in the order the micro-batches hold them."""
    from rlhf.distributed.device import to_device

    from rlhf.agents.flags import response_width

    width = response_width(job.generation, job.agent, rollout.samples)
    batch = to_device(collate_sequences(rollout.local, pad_id, width), mesh.device)
    routing.attach_rollout_routing(roles, job.router_replay.moe_router_replay, rollout.local, batch)
    trim, mrb = mesh.pp == 1, job.batch.micro_rollout_batch_size
    groups = [list(range(i, min(i + mrb, len(rollout.local)))) for i in range(0, len(rollout.local), mrb)]
    if job.batch.use_dynamic_batch:  # by token count instead (packed); the outputs come back in this order
        groups = token_budget_groups(batch, list(range(len(rollout.local))), job.batch.max_tokens_per_gpu)
    mbs = prepare_microbatches([select_rows(batch, g, trim) for g in groups], packing=job.engine.packing_samples,
                               pp=mesh.pp, pad_id=pad_id)
    return batch, mbs, [i for g in groups for i in g]


def token_budget_groups(batch: dict, rows: list[int], max_tokens: int) -> list[list[int]]:
    """``--use_dynamic_batch``: ``rows`` (indices into ``batch``) split into micro-batches of at most
    ``--max_tokens_per_gpu`` prompt + response tokens each, about equal (``kernels.balance_microbatches``), each in
    row order. The step's loss is a sum over tokens (or sequences) divided by the step's global count, so the
    gradient does not depend on how the rows are grouped (tests/ppo/test_dynamic_batch.py)."""
    import rlhf.kernels as kernels

    lens = batch["attention_mask"][rows].sum(dim=1).tolist()
    try:
        parts = kernels.balance_microbatches(lens, max_tokens, dp_size=1)[0]
    except ValueError as e:
        raise ValueError(str(e).replace("--max_tokens_per_microbatch", "--max_tokens_per_gpu")) from None
    return [[rows[i] for i in part] for part in parts if part]


def frozen_forwards(roles, job, mbs: list, tokens: float, timer, recorder=None) -> dict:
    """make_experience's forwards, one role after another: actor, ref and teacher log-probs (B, T) at the sampling
    temperature (no actor forward with --use_rollout_logprobs), critic values (B, T), reward scores (B,)."""
    roles.memory.enter("make_experience")
    out = {}
    engines = roles.engines
    order = ("ref", "teacher", *roles.reward_models, "critic")
    replay, temperature = job.router_replay.moe_router_replay, job.generation.temperature
    for role in ("actor", *order) if job.algo.old_logprobs_source == "forward" else order:
        if role in engines:
            with timer.phase(f"{role}_fwd", tokens=tokens):
                out[role] = forward_role(engines[role], "reward" if role in roles.reward_models else role,
                                         routing.actor_microbatches(replay, mbs, recorder) if role == "actor" else mbs,
                                         temperature if role in ("actor", "ref", "teacher") else 1.0)
    return out


def make_experience(roles, job, rollout: Rollout, rewards: RewardSources, mesh, pad_id: int,
                    timer, step: int = 0) -> tuple[Experience, torch.Tensor, dict[str, float]]:
    """make_experience: the frozen forwards and the rewards of this rank's samples. Returns the experience,
    the raw (unnormalized) combined rewards (B,) and the reward metrics. ``step``: the steps done (the routing-flip
    metric's interval)."""
    replay = job.router_replay.moe_router_replay
    batch, mbs, order = experience_microbatches(rollout, job, mesh, pad_id, roles)
    every = job.router_replay.moe_routing_flip_interval
    recorder = routing.recorder_for(roles, replay, rollout.local,
                                    actor_forward=job.algo.old_logprobs_source == "forward",
                                    flip_due=every > 0 and step % every == 0)
    out = frozen_forwards(roles, job, mbs, rollout.tokens, timer, recorder)
    if order != sorted(order):  # token-budget micro-batches: back to row order
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        out = {k: v[inverse.to(v.device)] for k, v in out.items()}
    vllm_lp = generator_logprobs(rollout.local, batch["action_mask"].shape[1])  # the collated response width
    with timer.phase("reward_fn"):  # the rule rewards (a code reward's sandboxed runs: most of it)
        combined, raw, metrics = rewards.score({r: out[r] for r in roles.reward_models}, rollout)
    metrics["microbatches/forward"] = float(len(mbs))
    metrics.update(routing.finish(roles, replay, rollout, batch, mbs, order, recorder, timer))
    combined, raw = shape_rewards(combined, raw, rollout, job, mesh, metrics)
    vllm_lp = vllm_lp.to(batch["action_mask"].device)
    exp = Experience(samples=rollout.local, batch=batch,
                     old_logprobs=out["actor"] if job.algo.old_logprobs_source == "forward" else vllm_lp,
                     vllm_logprobs=vllm_lp,
                     rewards=combined, ref_logprobs=out.get("ref"), values=out.get("critic"),
                     teacher_logprobs=out.get("teacher"))
    metrics.update(correct_experience(exp, job, mesh))
    return exp, raw, metrics


def correct_experience(exp: Experience, job, mesh) -> dict[str, float]:
    """verl's decoupled mode (the trainer's old log-probs from this step's forward): --rollout_rs takes its
    rejected tokens out of the batch's ``action_mask`` before the advantages and the critic (the response as
    generated stays as ``reward_mask``, where the rewards and the KL penalty are placed), and --rollout_is's
    weights, normalised over the global batch with --rollout_is_batch_normalize, join the batch
    (``rlhf.algo.rollout_correction.experience_correction``)."""
    from rlhf.algo.rollout_correction import experience_correction

    corr = job.correction
    if job.algo.old_logprobs_source != "forward" or (corr.rollout_rs is None and corr.rollout_is is None):
        return {}
    mask = exp.batch["action_mask"]

    def total(t: torch.Tensor) -> torch.Tensor:  # summed over the DP ranks: the global batch
        return dp_all_gather(t.unsqueeze(0).to(mesh.device), mesh).sum(dim=0).cpu()

    keep, weights, metrics = experience_correction(exp.old_logprobs, exp.vllm_logprobs.to(exp.old_logprobs.device),
                                                   mask, corr, total)
    if keep is not None:
        exp.batch["reward_mask"] = mask.clone()
        exp.batch["action_mask"] = (mask.bool() & keep.to(mask.device)).to(mask.dtype)
    if weights is not None:
        exp.batch["rollout_is_weights"] = weights.to(mask.device)
    return metrics


def shape_rewards(combined: torch.Tensor, raw: torch.Tensor, rollout: Rollout, job, mesh,
                  metrics: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The length penalties (``rlhf.algo.shaping``) on this rank's rewards, optimized and raw alike (the logged
    reward includes them, as OpenRLHF's); their global counts join ``metrics``."""
    from rlhf.algo.shaping import ShapingConfig, apply_length_penalties

    cfg = ShapingConfig.from_parts(job.generation, job.algo)
    if not cfg.active:
        return combined, raw
    lengths = torch.tensor([len(s.response_ids) for s in rollout.local], device=combined.device)
    truncated = torch.tensor([not s.finished for s in rollout.local], device=combined.device)
    combined, penalized, touched = apply_length_penalties(combined, lengths, truncated, cfg)
    raw, _, _ = apply_length_penalties(raw, lengths, truncated, cfg)
    flags = dp_all_gather(torch.stack([penalized, touched]).T.float(), mesh)  # (N, 2)
    metrics["overlong_penalized_frac"], metrics["stop_properly_penalized_frac"] = flags.mean(dim=0).tolist()
    return combined, raw


def compute_advantages(exp: Experience, raw_rewards: torch.Tensor, estimator, kl_coef: float,
                       job, mesh) -> dict[str, float]:
    """advantages: the per-token KL estimate, then the estimator over the global batch (gathered over DP, so
    GRPO groups and whitening see every sample); fills ``exp.kl``, ``exp.advantages``, ``exp.returns``.
    Returns the global reward, KL and advantage statistics (and the generator-vs-trainer log-prob drift)."""
    from rlhf.algo.advantages import add_reward_kl, whiten_openrlhf
    from rlhf.algo.kl import kl_in_loss
    from rlhf.algo.ppo_losses import kl_estimate, masked_mean, masked_whiten

    algo, mask = job.algo, exp.batch["action_mask"]
    reward_mask = exp.batch.get("reward_mask")  # the response as generated, where --rollout_rs rejected tokens
    exp.kl = (kl_estimate(exp.old_logprobs, exp.ref_logprobs, algo.kl_estimator,
                          mask if reward_mask is None else reward_mask)
              if exp.ref_logprobs is not None else torch.zeros_like(exp.old_logprobs))
    g = lambda t: dp_all_gather(t, mesh) if t is not None else None  # noqa: E731
    gmask, gkl = g(mask), g(exp.kl)
    in_loss = kl_in_loss(estimator, algo.use_kl_loss)  # where the KL goes: --use_kl_loss, else the estimator's place
    res = estimator(rewards=g(exp.rewards), kl=gkl, values=g(exp.values), action_mask=gmask,
                    kl_coef=0.0 if in_loss else kl_coef, gamma=algo.gamma, lambd=algo.lambd,
                    n_samples_per_prompt=job.batch.n_samples_per_prompt, std_norm=not algo.no_std_norm,
                    reward_clip=tuple(algo.reward_clip_range) if algo.reward_clip_range is not None else None,
                    reward_mask=g(reward_mask))
    if estimator.kl_in_loss and not in_loss:  # a group estimator with its KL in the reward (--no-use_kl_loss)
        res = add_reward_kl(res, gkl, gmask, kl_coef)
    adv = res["advantages"]
    if estimator.whiten:  # GAE: over the global batch; --no_std_norm subtracts the mean only (OpenRLHF)
        adv = masked_whiten(adv, gmask) if not algo.no_std_norm else whiten_openrlhf(adv, gmask, std_norm=False)
    lo, B = mesh.dp_rank * mask.shape[0], mask.shape[0]
    exp.advantages, exp.returns = adv[lo:lo + B], res["returns"][lo:lo + B]
    graw = g(raw_rewards)
    out = {"reward": graw.mean().item(), "reward_std": graw.std().item() if graw.numel() > 1 else 0.0,
           "kl": masked_mean(gkl, gmask).item(), "advantages_abs": masked_mean(adv.abs(), gmask).item()}
    n = job.batch.n_samples_per_prompt
    if n > 1 and graw.numel() % n == 0:  # groups whose replies all scored the same (what dynamic filtering drops)
        grp = graw.reshape(-1, n)
        out["reward_equal_groups_frac"] = (grp.max(dim=1).values == grp.min(dim=1).values).float().mean().item()
    if algo.old_logprobs_source == "forward":  # otherwise the update measures it (or there is nothing to compare)
        out.update(logprob_drift(exp, mesh))
    if exp.teacher_logprobs is not None:  # on-policy distillation's per-token term (rlhf.ppo.distill)
        from rlhf.ppo.distill import add_distill_advantages

        out.update(add_distill_advantages(exp, job.distill, mesh))
    return out


def logprob_drift(exp: Experience, mesh) -> dict[str, float]:
    """The generator's log-probs against the trainer's for the same weights and tokens, over the global batch:
    mean and max |logp_vLLM - logp_trainer| on response tokens (a weight-sync or kernel mismatch shows here)."""
    from rlhf.algo.ppo_losses import masked_mean

    gmask = dp_all_gather(exp.batch["action_mask"], mesh)
    gdiff = (dp_all_gather(exp.vllm_logprobs, mesh) - dp_all_gather(exp.old_logprobs, mesh)).abs()
    return {"rollout_logprob_drift": masked_mean(gdiff, gmask).item(),
            "rollout_logprob_drift_max": gdiff.masked_fill(~gmask, 0).max().item()}


def update_plans(B: int, batch, seed: int, dp: int, step: int) -> list[list[list[int]]]:
    """Each optimizer step's micro-batches (row indices into this rank's B samples): --max_epochs shuffled
    passes, --train_batch_size samples (global) per step, --micro_train_batch_size per micro-batch (``batch``: the
    job's batch part; ``seed``: --seed)."""
    per_update = batch.train_batch_size // dp // batch.micro_train_batch_size
    m = batch.micro_train_batch_size
    plans = []
    for epoch in range(batch.max_epochs):
        gen = torch.Generator().manual_seed(seed * 7919 + step * 31 + epoch)
        perm = torch.randperm(B, generator=gen).tolist()
        micro = [perm[i:i + m] for i in range(0, B, m)]
        plans += [micro[i:i + per_update] for i in range(0, len(micro), per_update)]
    return plans


def update(roles, exp: Experience, job, estimator, kl_coef: float, step: int, mesh,
           pad_id: int, tokens: float, timer, after_actor_step=None, ptx=None, dump=None) -> dict[str, float]:
    """critic_update then actor_update over the same plans; metrics averaged over the optimizer steps.
    ``after_actor_step()`` runs after each actor optimizer step (--enable_ema); ``ptx`` (``rlhf.ppo.ptx.PtxData``)
    adds its pretraining micro-batches and loss to each actor step; ``dump`` (``rlhf.ppo.dump.ExperienceDump``,
    --dump_experience) records each micro-batch's loss."""
    from rlhf.algo.ppo_losses import (ACTOR_METRICS, CRITIC_METRICS, ActorLossConfig, make_actor_loss,
                                      make_critic_loss)
    from rlhf.models.context_parallel import reads_local_tokens
    from rlhf.models.outputs import response_logprobs, response_values

    bat, algo, epochs = job.batch, job.algo, job.batch.max_epochs
    plans = update_plans(exp.old_logprobs.shape[0], bat, job.engine.seed, mesh.dp, step)
    if bat.use_dynamic_batch:  # each optimizer step's rows regrouped by token count
        plans = [token_budget_groups(exp.batch, [i for mb in plan for i in mb], bat.max_tokens_per_gpu)
                 for plan in plans]
    trim = mesh.pp == 1

    def microbatches(plan: list[list[int]]) -> list[dict]:
        return prepare_microbatches([exp.select(ix, trim) for ix in plan], packing=job.engine.packing_samples,
                                    pp=mesh.pp, pad_id=pad_id)

    sums: dict[str, float] = {}
    keep = (lambda role, f: f) if dump is None else dump.loss  # noqa: E731
    seen = (lambda role, f: f) if dump is None else dump.model  # noqa: E731
    if dump is not None:
        dump.plans("actor", plans)
        dump.plans("critic", plans)
    if roles.critic is not None:
        critic_loss = reads_local_tokens(keep("critic", make_critic_loss(seen("critic", response_values),
                                                                         value_clip=algo.value_clip)))
        _train_role(roles, "critic", plans, lambda plan: (microbatches(plan), critic_loss), CRITIC_METRICS, "head",
                    sums, tokens * epochs, timer)
    loss_cfg = ActorLossConfig.from_parts(algo, job.correction, estimator, job.policy)
    actor_loss = reads_local_tokens(keep("actor", make_actor_loss(  # the readers take a CP rank's own tokens
        seen("actor", lambda batch, hidden: response_logprobs(roles.actor, batch, hidden, job.generation.temperature,
                                                              entropy=True)),
        loss_cfg, kl_coef=kl_coef, seed=job.engine.seed * 7919 + step)))
    keys = ACTOR_METRICS + (("kl_loss",) if loss_cfg.kl_in_loss else ()) + (
        ("rollout_logprob_drift", "rollout_logprob_drift_max") if algo.old_logprobs_source == "update" else ()
    ) + loss_cfg.correction_metric_keys()  # rlhf.algo.rollout_correction.METRICS

    def actor_batches(plan: list[list[int]]) -> tuple[list[dict], object]:
        mbs = microbatches(plan)
        if ptx is None:
            return mbs, actor_loss
        extra = ptx.next_microbatches()
        return mbs + extra, keep("actor_step", ptx.combined_loss(actor_loss, mbs, extra, keys))

    _train_role(roles, "actor", plans, actor_batches, keys + (("ptx_loss",) if ptx else ()), "hidden", sums,
                tokens * epochs, timer, after_step=after_actor_step)
    out = {k: v / len(plans) for k, v in sums.items()}
    out["entropy"] = out.pop("actor/entropy")
    out["microbatches/update"] = sum(len(p) for p in plans) / len(plans)  # per optimizer step
    for k in ("rollout_logprob_drift", "rollout_logprob_drift_max"):  # measured by the update's forward
        if f"actor/{k}" in out:
            out[k] = out.pop(f"actor/{k}")
    return out


def _train_role(roles, role: str, plans: list, batches, keys: tuple, output: str, sums: dict,
                tokens: float, timer, after_step=None) -> None:
    """``batches(plan) -> (micro-batches, loss_fn)`` of each optimizer step."""
    roles.memory.enter(f"{role}_update")
    engine = roles.engines[role]
    with timer.phase(f"{role}_update", tokens=tokens):
        for plan in plans:
            mbs, loss_fn = batches(plan)
            for k, v in engine.train_step(mbs, loss_fn, keys, output=output).items():
                sums[f"{role}/{k}"] = sums.get(f"{role}/{k}", 0.0) + v
            if after_step is not None:
                after_step()
