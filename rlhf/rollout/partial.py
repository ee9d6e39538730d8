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

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from rlhf.rollout.partial_config import (PARTIAL_CORRECTIONS, PartialRolloutConfig,  # noqa: F401 (re-exported)
                                         check_partial, decoupled_correction, resolve_correction)
from rlhf.rollout.types import Sample, engine_share, sample_from_state, sample_state


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
    agent: Sample | None = None
    """an agent trajectory's sample once it has finished (``rlhf.agents.carry``): its tokens, action mask, outcome
    and versions; an unfinished one lives as a parked session on the rank that started it"""

    def to_sample(self) -> Sample:
        if self.agent is not None:
            return dataclasses.replace(self.agent, prompt_index=self.prompt_index)
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
    lo, hi = engine_share(len(groups), E, e)
    n_lo, n_hi = engine_share(groups_needed, E, e)
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
            engine.add_request(rid, {"prompt_token_ids": list(s.prompt_ids) + list(s.response_ids)}, params,
                               lora_request=rollout.lora_request)
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
                         list(s.logprobs), list(s.versions), s.done, s.finished, s.routed_experts, s.agent)


def _state(s: PartialSample) -> dict:
    d = dict(_copy(s).__dict__)
    if d["routed_experts"] is not None:  # the checkpoint's trainer.json: lists of ints
        d["routed_experts"] = d["routed_experts"].tolist()
    if d["agent"] is not None:
        d["agent"] = sample_state(d["agent"])
    return d


def _from_state(d: dict) -> PartialSample:
    import numpy as np

    s = PartialSample(**d)
    if s.agent is not None:
        s.agent = sample_from_state(s.agent)
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
