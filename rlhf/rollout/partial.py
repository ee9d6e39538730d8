"""Partial rollouts in the colocated vLLM engine, or the megatron fallback generator (issue 44): generate for more
groups than a step trains, stop the engine with vLLM's own abort once enough whole groups have finished (the
fallback simply stops feeding them), and carry the unfinished samples, with the tokens, per-token log-probs and
per-token policy versions they already have, into the next step, where they continue from prompt + prefix under
the newly synced weights (verl's ``trainer.v1.trainer_mode=colocate_async``, slime's ``--partial-rollout``, Kimi
k1.5's partial rollouts). The prefix is prefilled again under the new weights, as vLLM does for the requests that
OpenRLHF's ``--train.partial_rollout_enable`` pauses (``pause_generation(mode="keep")`` with vLLM's default
``clear_cache=True`` preempts them and frees their KV blocks: vllm 0.27.1, ``vllm/v1/engine/core.py``
``pause_scheduler`` -> ``_reset_caches``).

``PartialSample`` is one sample of a group in flight; ``generate_partial`` runs one engine round over a list of
them; ``PartialRollouts`` keeps what is carried between steps, applies the staleness bound and picks the groups a
step trains (oldest first, so that stopping early does not bias the trained batch toward short answers).

The staleness bound (``--max_staleness K``) discards nothing by default: a group whose oldest token would be more than
K updates old if it were carried once more is *due*, and the round is not stopped until every due group is whole
(it waits for them, as the synchronous step waits for its longest reply), then the step trains the due groups first
(verl's ``trainer.v1.sampler.max_off_policy_strategy: wait``, "dropless"; verl's default is ``drop``, here
``--partial_rollout_drop_stale``; verl's ``max_off_policy_threshold`` counts the versions a trajectory spans, K + 1:
verl/trainer/config/ppo_trainer.yaml at 1dda039b).
A group is thus trained within K + 1 rounds of its first token, whatever its length, and no trained token is older
than K. This needs at most ``--rollout_batch_size`` groups carried at once (what is carried is what was started beyond
the batch), so ``--vllm_generate_batch_size`` is bounded by twice the batch. ``--partial_rollout_drop_stale`` keeps
the earlier rule instead: at the start of a step a carried group with a token more than K updates old is dropped,
finished samples included, and its prompt started again.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Sequence

from rlhf.part import Part
from rlhf.rollout.types import Sample

log = logging.getLogger(__name__)


@dataclass
class PartialRolloutConfig(Part):
    """Partial rollouts and their staleness bound (``launch/ppo.py``; OpenRLHF: ``--train.async_enable
    --train.partial_rollout_enable``)."""

    partial_rollout: bool = False
    """(--partial_rollout) stop generating once a step's groups are whole; carry the rest to the next step"""
    max_staleness: int = 1
    """(--max_staleness) a trained token is at most this many weight updates older than the weights trained"""
    partial_rollout_oversample: float = 0.25
    """(--partial_rollout_oversample) extra groups started per step, a fraction of --rollout_batch_size"""
    vllm_generate_batch_size: int | None = None
    """(--vllm_generate_batch_size) groups in flight per step, carried ones included; replaces the oversample"""
    partial_rollout_drop_stale: bool = False
    """(--partial_rollout_drop_stale) drop a carried group with a token older than --max_staleness at the start of a
    step (its prompt started again) instead of waiting for it to finish within the bound"""
    partial_rollout_correction: str = "decoupled"
    """(--partial_rollout_correction) the correction a carried token is trained with when no --use_tis / --rollout_rs
    is given: ``decoupled`` (AReaL's decoupled PPO loss, ``decoupled_correction``) or ``none``"""
    async_one_step_off: bool = False
    """(--async_one_step_off) OpenRLHF's --train.async_enable alone: every step trains whole groups generated
    --max_staleness updates earlier, each by one policy version, and generates the groups of a later step"""
    correction_used: str = field(default="", init=False)
    """what the trainer corrects carried tokens with, resolved by ``check_partial`` (logged at start)"""

    RESOLVED = ("correction_used",)

    @classmethod
    def add_args(cls, g) -> None:
        g.add_argument("--partial_rollout", action="store_true",
                       help="partial rollouts (verl colocate_async, slime --partial-rollout): generate for more "
                            "prompts than a step trains, stop vLLM once --rollout_batch_size whole groups are done, "
                            "carry the unfinished samples with their tokens into the next step (OpenRLHF: "
                            "--train.async_enable --train.partial_rollout_enable)")
        g.add_argument("--max_staleness", type=int, default=1,
                       help="--partial_rollout: a trained token is at most K weight updates old: a round is not "
                            "stopped before every group that could not be carried once more is whole, and those "
                            "are trained first, so nothing generated is discarded (0: nothing crosses an update, "
                            "the synchronous trainer). NeMo-RL max_trajectory_age_steps, AReaL "
                            "max_head_offpolicyness, prime-rl max_off_policy_steps, TRL max_staleness")
        g.add_argument("--partial_rollout_correction", default="decoupled", choices=PARTIAL_CORRECTIONS,
                       help="--partial_rollout: what corrects for carried tokens' older policy when neither --use_tis "
                            "nor --rollout_rs is given: decoupled (AReaL's decoupled PPO loss: ratio against this "
                            "step's weights, times the behaviour weight p_trainer / p_generator, tokens whose weight "
                            "exceeds 5 masked), mask_offpolicy (slime's --mask-offpolicy-in-partial-rollout: only "
                            "this step's tokens are trained) or none (trained as if on-policy)")
        g.add_argument("--async_one_step_off", action="store_true",
                       help="OpenRLHF's --train.async_enable without --train.partial_rollout_enable: every step trains "
                            "whole groups generated --max_staleness updates earlier (one policy version each) and "
                            "generates those of a later step. In one colocated job it costs the staleness without "
                            "the overlap of generation and training that is its point in OpenRLHF")
        g.add_argument("--partial_rollout_drop_stale", action="store_true",
                       help="--partial_rollout: instead of waiting for the groups that --max_staleness makes due, "
                            "drop a carried group with an older token at the start of a step (finished samples "
                            "included) and start its prompt again")
        g.add_argument("--partial_rollout_oversample", type=float, default=0.25,
                       help="--partial_rollout: groups started per step beyond --rollout_batch_size, as a fraction "
                            "of it")
        g.add_argument("--vllm_generate_batch_size", "--rollout.vllm_generate_batch_size",
                       dest="vllm_generate_batch_size", type=int, default=None,
                       help="--partial_rollout: prompts (groups) in flight per step, carried ones included, at least "
                            "--rollout_batch_size (OpenRLHF's flag; replaces --partial_rollout_oversample)")

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
    flag = "--partial_rollout" if p.partial_rollout else "--async_one_step_off"
    if job.agent.agent_func_path:
        raise ValueError(f"{flag} with --agent_func_path is not supported yet: a multi-turn trajectory "
                         "cannot be carried between turns of the environment yet")
    extra, batch = p.extra_groups(job.batch.rollout_batch_size), job.batch.rollout_batch_size
    if not p.partial_rollout_drop_stale and not p.whole_groups and extra > batch:
        flag = (f"--vllm_generate_batch_size {p.vllm_generate_batch_size}" if p.vllm_generate_batch_size is not None
                else f"--partial_rollout_oversample {p.partial_rollout_oversample:g}")
        raise ValueError(f"{flag} starts {extra} groups beyond --rollout_batch_size {batch}: more groups could come "
                         f"due under --max_staleness {p.max_staleness} at once than a step trains; start at most "
                         f"{batch} extra (--vllm_generate_batch_size <= {2 * batch}), or pass "
                         "--partial_rollout_drop_stale to drop what is too old instead")
    resolve_correction(job)


PARTIAL_CORRECTIONS = ("decoupled", "mask_offpolicy", "none")


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


@dataclass
class PartialSample:
    """Sample ``k`` of group ``group`` (one prompt's ``--n_samples_per_prompt`` samples share a group)."""

    group: int
    """a running id of the group, unique within the job (the order groups were started in)"""
    k: int
    prompt_index: int
    """the dataset index of the prompt"""
    prompt_ids: list[int]
    seed: int
    """the seed of the first round; a continuation at version v draws with ``continuation_seed(seed, v)``"""
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """the policy version (weight updates applied) that produced each response token"""
    done: bool = False
    """no more tokens: ended with EOS (``finished``) or at the length limit"""
    finished: bool = False
    """ended with EOS"""
    routed_experts: object = None
    """an MoE generator's routing of a finished sample, ``(tokens, layers, top_k)`` expert ids (``Sample``'s), from
    the round it finished in (that round fed the prefix again: vLLM's prefill of the continued request, the megatron
    fallback's first forward of the round); None otherwise"""

    def to_sample(self) -> Sample:
        return Sample(self.prompt_index, list(self.prompt_ids), list(self.response_ids), list(self.logprobs),
                      self.finished, versions=list(self.versions), routed_experts=self.routed_experts)

    def round_seed(self, version: int) -> int:
        """The seed this sample draws with in a round at ``version``: its own for its first tokens, then a fresh
        stream per continuation (``continuation_seed``)."""
        return self.seed if not self.response_ids else continuation_seed(self.seed, version)


def continuation_seed(seed: int, version: int) -> int:
    """The seed of a carried sample's continuation under version ``version``: a fresh stream per round, still a
    function of the sample's own seed only (the same continuation whatever else the engine batches)."""
    return (seed * 1_000_003 + 7_919 * (version + 1)) % (2**63 - 1)


def _engine_share(n_items: int, engines: int, e: int) -> tuple[int, int]:
    return n_items * e // engines, n_items * (e + 1) // engines


def generate_partial(rollout, groups: Sequence[list[PartialSample]], *, groups_needed: int, temperature: float,
                     top_p: float, max_tokens: int, version: int, stop_token_ids: Sequence[int] | None = None,
                     ignore_eos: bool = False, due: Sequence[bool] | None = None
                     ) -> tuple[list[list[PartialSample]], dict]:
    """One engine round over ``groups`` (every rank passes the same list; engine ``e`` takes a contiguous share of
    the groups and stops once its share of ``groups_needed`` groups is whole). Returns every group, updated, in
    the order given (on every rank), and counts: ``aborted`` samples, ``generated`` tokens.

    ``groups_needed`` >= the number of groups: nothing is aborted, every sample runs to its end (K = 0).
    New samples (no tokens yet) draw with their ``seed``, as ``VLLMRollout.generate`` seeds sample k of a prompt,
    so a round with nothing carried and nothing aborted generates exactly what ``generate`` would.
    The megatron fallback (``MegatronRollout.partial_round``) runs one such engine per DP replica; it stops
    generating where vLLM aborts, and seeds each sample apart (its ``generate`` draws a prompt's samples from one
    generator, so its rounds are not its ``generate``'s samples).
    ``stop_token_ids``: vLLM's own, ending a sample as EOS does (``finished``). ``due``: per group, whether the round
    must not stop before it is whole (``PartialRollouts.due``); none by default."""
    if getattr(rollout, "cpu_released", False):
        raise RuntimeError("vLLM's weights were freed after the last rollout (CPU sleep) and not synced since")
    mesh = rollout.mesh
    megatron = hasattr(rollout, "partial_round")  # the fallback: one engine per DP replica, no abort to call
    E, e = (mesh.dp, mesh.dp_rank) if megatron else (rollout.num_engines, rollout.engine_index)
    lo, hi = _engine_share(len(groups), E, e)
    n_lo, n_hi = _engine_share(groups_needed, E, e)
    mine = [[_copy(s) for s in g] for g in groups[lo:hi]]
    kw = dict(temperature=temperature, top_p=top_p, max_tokens=max_tokens, version=version,
              stop_token_ids=list(stop_token_ids or []), ignore_eos=ignore_eos,
              due=list(due[lo:hi]) if due is not None else [False] * len(mine))
    if megatron:
        aborted, generated = rollout.partial_round(mine, n_hi - n_lo, **kw)
        leader = mesh.tp_rank == 0 and mesh.pp_rank == 0
    else:
        aborted, generated = _vllm_round(rollout, mine, n_hi - n_lo, **kw)
        leader = rollout.is_leader
    return _gather(mesh, groups, (lo, mine, aborted, generated) if leader else None)


def _vllm_round(rollout, mine: list[list[PartialSample]], need: int, *, temperature: float, top_p: float,
                max_tokens: int, version: int, stop_token_ids: list[int], ignore_eos: bool,
                due: list[bool]) -> tuple[int, int]:
    """This engine's share of a round (``generate_partial``), ``mine`` updated in place: (aborted, generated). The
    round stops once ``need`` groups are whole and every ``due`` group is."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = rollout.llm.llm_engine
    by_id: dict[str, tuple[int, PartialSample]] = {}
    left = [sum(not s.done for s in g) for g in mine]
    whole = sum(x == 0 for x in left)
    due_left = sum(d and x > 0 for d, x in zip(due, left))
    for gi, g in enumerate(mine):
        for s in g:
            if s.done:
                continue
            remaining = max_tokens - len(s.response_ids)
            params = SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=remaining, logprobs=0,
                                    seed=s.round_seed(version), detokenize=False, stop_token_ids=stop_token_ids,
                                    ignore_eos=ignore_eos)
            params.output_kind = RequestOutputKind.DELTA
            rid = f"partial-{version}-{s.group}-{s.k}"
            engine.add_request(rid, {"prompt_token_ids": list(s.prompt_ids) + list(s.response_ids)}, params)
            by_id[rid] = (gi, s)
    aborted = generated = 0
    stopped = False
    # Every iteration is one has_unfinished_requests() and one step() on every rank: with several engines (vLLM
    # data parallel) both are collective (the first asks every engine; an engine with nothing left runs vLLM's dummy
    # batch in the second while the others work), so the abort, local to this engine, comes before them.
    while True:
        if whole >= need and not due_left and not stopped:  # vLLM's abort: the engine frees the requests' KV blocks
            pending = [rid for rid, (_, s) in by_id.items() if not s.done]
            aborted, stopped = len(pending), True
            engine.abort_request(pending)
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            if stopped:  # nothing of an aborted request comes back; no other request was added
                continue
            gi, s = by_id[o.request_id]
            c = o.outputs[0]
            ids = list(c.token_ids)
            s.response_ids += ids
            s.logprobs += [float(d[t].logprob) for d, t in zip(c.logprobs or [], ids)]
            s.versions += [version] * len(ids)
            generated += len(ids)
            if o.finished:  # vLLM hands a request's routing (enable_return_routed_experts) with its last output
                s.done, s.finished = True, c.finish_reason == "stop"
                s.routed_experts = getattr(c, "routed_experts", None)
                left[gi] -= 1
                whole += left[gi] == 0
                due_left -= due[gi] and left[gi] == 0
    return aborted, generated


def _gather(mesh, groups, mine) -> tuple[list[list[PartialSample]], dict]:
    """Every engine's groups, on every rank, in the order given, and the round's counts."""
    import torch.distributed as dist

    parts: list = [None] * mesh.world_size
    dist.all_gather_object(parts, mine)
    out: list[list[PartialSample]] = [[] for _ in groups]
    counts = {"aborted": 0, "generated": 0}
    for p in parts:
        if p is None:
            continue
        plo, pg, pa, pgen = p
        for i, g in enumerate(pg):
            out[plo + i] = g
        counts["aborted"] += pa
        counts["generated"] += pgen
    return out, counts


def _copy(s: PartialSample) -> PartialSample:
    return PartialSample(s.group, s.k, s.prompt_index, list(s.prompt_ids), s.seed, list(s.response_ids),
                         list(s.logprobs), list(s.versions), s.done, s.finished, s.routed_experts)


def _state(s: PartialSample) -> dict:
    d = dict(_copy(s).__dict__)
    if d["routed_experts"] is not None:  # the checkpoint's trainer.json: lists of ints
        d["routed_experts"] = d["routed_experts"].tolist()
    return d


def _from_state(d: dict) -> PartialSample:
    import numpy as np

    s = PartialSample(**d)
    if s.routed_experts is not None:
        s.routed_experts = np.asarray(s.routed_experts, dtype=np.int16)
    return s


def new_group(group: int, prompt_index: int, prompt_ids: list[int], *, n: int, step_seed: int,
              position: int) -> list[PartialSample]:
    """The ``n`` samples of a new group, seeded as ``VLLMRollout.generate`` seeds the prompt at ``position`` of a
    step whose seed is ``step_seed``."""
    base = step_seed * 1_000_003 + position * n
    return [PartialSample(group, k, prompt_index, list(prompt_ids), base + k) for k in range(n)]


class PartialRollouts:
    """The groups carried between steps (oldest first) and the prompts a staleness drop sends back.

    Step at version ``v`` (the weights after ``v`` updates generate it and are the ones trained): the engine round
    runs over the carried groups, then new ones, and does not stop before every ``due`` group (one that could not be
    carried once more within ``max_staleness``) is whole; ``settle`` picks the due groups, then the first whole ones
    in round order (the oldest first), ``batch_groups`` in all, to train and carries the rest. With ``drop_stale``
    (``--partial_rollout_drop_stale``) nothing is due: ``drop_stale(v)`` instead drops every carried group with a
    token older than ``v - max_staleness`` (its prompt goes back to the queue). With ``max_staleness`` 0 nothing may
    cross an update: the round generates exactly one step's groups and runs every sample to its end, as the
    synchronous trainer does."""

    def __init__(self, *, n: int, batch_groups: int, oversample_groups: int, max_staleness: int,
                 drop_stale: bool = False):
        if max_staleness < 0:
            raise ValueError(f"--max_staleness must be >= 0, got {max_staleness}")
        self.n, self.batch_groups, self.max_staleness = n, batch_groups, max_staleness
        self.drop = drop_stale
        self.oversample_groups = oversample_groups if max_staleness > 0 else 0
        self.carried: list[list[PartialSample]] = []
        self.requeue: list[tuple[int, list[int]]] = []
        """(dataset index, prompt ids) of groups dropped as stale: started again, before new prompts"""
        self.pending: list[int] = []
        """dataset indices drawn from the sampler (whole batches) and not started yet"""
        self.next_group = 0

    def take_prompts(self, k: int, next_batch) -> list[int]:
        """``k`` dataset indices in the sampler's order; ``next_batch()`` gives the sampler's next batch."""
        while len(self.pending) < k:
            self.pending += list(next_batch())
        out, self.pending = self.pending[:k], self.pending[k:]
        return out

    # ---------------------------------------------------------------------------------------------- a step
    def due(self, groups: Sequence[list[PartialSample]], version: int) -> list[bool]:
        """Per group: it has a token that carrying it to version ``version + 1`` would make more than
        ``max_staleness`` updates old, so the round at ``version`` must finish it (never with ``drop_stale``)."""
        if self.drop or self.max_staleness == 0:
            return [False] * len(groups)
        return [version - min((v for s in g for v in s.versions), default=version) >= self.max_staleness
                for g in groups]

    def drop_stale(self, version: int) -> dict[str, float]:
        """``--partial_rollout_drop_stale``: drop (and requeue the prompts of) the carried groups with a token more than
        ``max_staleness`` updates old at ``version``; without it nothing is dropped."""
        if not self.drop:
            return {"partial/dropped_samples": 0.0}
        keep, dropped = [], 0
        for g in self.carried:
            oldest = min((v for s in g for v in s.versions), default=version)
            if version - oldest > self.max_staleness:
                dropped += len(g)
                self.requeue.append((g[0].prompt_index, list(g[0].prompt_ids)))
            else:
                keep.append(g)
        self.carried = keep
        return {"partial/dropped_samples": float(dropped)}

    def new_prompts_needed(self, want: int | None = None) -> int:
        """How many prompts the sampler gives this round: the round holds ``want`` (default ``batch_groups``; a
        dynamic-filtering round asks for the groups still missing) ``+ oversample_groups`` groups, carried and
        requeued ones included."""
        want = self.batch_groups if want is None else want
        return max(0, want + self.oversample_groups - len(self.carried) - len(self.requeue))

    def round_groups(self, new: Sequence[tuple[int, list[int]]], *, step_seed: int) -> list[list[PartialSample]]:
        """Carried groups (oldest first), then requeued and ``new`` prompts (dataset index, prompt ids) as new
        groups."""
        fresh = list(self.requeue) + list(new)
        self.requeue = []
        groups = [g for g in self.carried]
        for pos, (idx, ids) in enumerate(fresh):
            groups.append(new_group(self.next_group, idx, ids, n=self.n, step_seed=step_seed, position=pos))
            self.next_group += 1
        return groups

    def groups_needed(self, groups: Sequence[list[PartialSample]], want: int | None = None) -> int:
        """The engine may stop once this many groups are whole: ``want`` (default ``batch_groups``), or every
        group when ``max_staleness`` is 0 (nothing is carried)."""
        return (self.batch_groups if want is None else want) if self.max_staleness > 0 else len(groups)

    def settle(self, groups: list[list[PartialSample]], version: int,
               want: int | None = None) -> tuple[list[list[PartialSample]], dict]:
        """The groups to train (the first ``want`` whole ones, default ``batch_groups``, in round order: oldest
        first) and the metrics of the round; the rest is carried."""
        want = self.batch_groups if want is None else want
        due = self.due(groups, version)
        whole = [all(s.done for s in g) for g in groups]
        picked = ([i for i in range(len(groups)) if due[i] and whole[i]]
                  + [i for i in range(len(groups)) if whole[i] and not due[i]])[:want]
        late = [i for i in range(len(groups)) if due[i] and i not in picked]
        if late:  # the round waits for due groups and the config check bounds how many there are
            raise RuntimeError(f"partial rollout: {len(late)} group(s) due at version {version} not trained (the "
                               f"round stopped before they were whole, or more than {want} were due)")
        chosen = set(picked)
        train = [g for i, g in enumerate(groups) if i in chosen]  # round order: the oldest first
        carry = [g for i, g in enumerate(groups) if i not in chosen]
        self.carried = carry
        m = {"partial/carried_samples": float(sum(len(g) for g in carry)),
             "partial/carried_unfinished": float(sum(not s.done for g in carry for s in g))}
        return train, {**m, **self.trained_metrics(train, version)}

    def trained_metrics(self, train: Sequence[list[PartialSample]], version: int) -> dict[str, float]:
        """The trained groups' count, their tokens by age (updates since the version that produced them; a bin for
        every age up to the oldest, past ``max_staleness`` too) and the oldest token's age as a number."""
        ages: dict[int, int] = {}
        for g in train:
            for s in g:
                for v in s.versions:
                    ages[version - v] = ages.get(version - v, 0) + 1
        m = {"partial/trained_groups": float(len(train)), "partial/max_token_age": float(max(ages, default=0))}
        for a in range(max(self.max_staleness, max(ages, default=0)) + 1):
            m[f"partial/tokens_age_{a}"] = float(ages.get(a, 0))
        return m

    # ----------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        return {"carried": [[_state(s) for s in g] for g in self.carried],
                "requeue": [(i, list(p)) for i, p in self.requeue], "pending": list(self.pending),
                "next_group": self.next_group}

    def load_state_dict(self, state: dict) -> None:
        self.carried = [[_from_state(d) for d in g] for g in state["carried"]]
        self.requeue = [(i, list(p)) for i, p in state["requeue"]]
        self.pending = list(state["pending"])
        self.next_group = state["next_group"]
