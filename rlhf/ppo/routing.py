"""PPO's side of MoE routing replay (``--moe_router_replay``, ``rlhf.models.routing_replay``): the batch's routing
for the experience forwards and the update, and the routing-flip metric.

- ``rollout`` (R3): the generator's routing (vLLM's ``routed_experts``, or the megatron fallback's record) goes into
  the batch before the experience forwards, so the old log-probs, the reference (the same MoE model) and every
  update forward and backward replay it.
- ``train`` (R2): the routing the actor chose in its first forward of the sample (the old-log-prob forward, or a
  routing forward when that one is skipped) goes into the batch after the experience forwards; the update replays
  it.
- the flip metric, for every MoE actor whose generator returned routing: the share of response tokens (and of
  token-layer pairs) whose top-k set in the trainer's unreplayed forward differs from the generator's, logged as
  ``moe/routing_flip_tokens`` and ``moe/routing_flip_pairs``. Replay makes the replayed forwards' flips 0 by
  construction; this one shows what it saves.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.models.routing_replay import (RoutingRecorder, collate_routing, merge_stages, replay_routers,
                                       routing_flips)


def moe_actor(roles) -> bool:
    return bool(replay_routers(roles.actor.module))


def rollout_routing(samples: list, S: int, spec) -> torch.Tensor | None:
    """The generator's routing of this rank's samples, (B, S, layers, K) ids + 1; None unless every sample has it."""
    if not samples or any(s.routed_experts is None for s in samples):
        return None
    return collate_routing([s.routed_experts for s in samples], S, spec.num_layers, spec.moe_topk)


def attach_rollout_routing(roles, mode: str, samples: list, batch: dict) -> None:
    """``rollout`` mode (``mode``: --moe_router_replay): the generator's routing into the collated batch (before any
    micro-batch is cut from it)."""
    if roles is None or mode != "rollout" or not moe_actor(roles):
        return
    routed = rollout_routing(samples, batch["input_ids"].shape[1], roles.actor.spec)
    if routed is None:
        raise RuntimeError("--moe_router_replay rollout: the generator returned no routing for some samples (vLLM "
                           "needs enable_return_routed_experts; the megatron fallback records it at PP 1; an agent's "
                           "trajectory gets it only when one of its generator calls is a prefix covering its actions)")
    batch["routed_experts"] = routed.to(batch["input_ids"].device)


def recorder_for(roles, mode: str, samples: list, *, actor_forward: bool = True, flip_due: bool = True
                 ) -> RoutingRecorder | None:
    """A recorder for the actor's unreplayed forward when ``train`` mode or the flip metric needs one.
    ``actor_forward``: make_experience runs the actor's forward (the old log-probs); unless replayed (``rollout``)
    it records for free. Otherwise the metric needs one more actor forward (``routing_forward``), run only when
    ``flip_due`` (--moe_routing_flip_interval)."""
    if not moe_actor(roles):
        return None
    if mode == "off" and any(s.routed_experts is None for s in samples):
        return None  # nothing to compare with, nothing to replay
    free = mode != "rollout" and actor_forward  # the experience's actor forward records
    if mode != "train" and not free and not flip_due:
        return None
    return RoutingRecorder(roles.actor.spec.num_layers, model=roles.actor.module)


def record_in(mbs: list[dict], recorder: RoutingRecorder | None, replayed: bool) -> list[dict]:
    """The micro-batches of an unreplayed actor forward that records: ``mbs`` with the recorder and without any
    routing to replay."""
    if recorder is None:
        return mbs
    return [{**{k: v for k, v in mb.items() if not (replayed and k == "routed_experts")},
             "routing_recorder": recorder} for mb in mbs]


def actor_microbatches(mode: str, mbs: list[dict], recorder: RoutingRecorder | None) -> list[dict]:
    """The experience's actor forward records the routing where it is unreplayed (not with ``rollout``)."""
    if recorder is None or mode == "rollout":
        return mbs
    return record_in(mbs, recorder, replayed=False)


def routing_forward(roles, mbs: list[dict], recorder: RoutingRecorder) -> None:
    """A forward of the actor for its routing only (no LM head): when the experience's actor forward is replayed
    (``rollout``) or skipped (old log-probs from the update or the generator)."""
    roles.actor.forward(record_in(mbs, recorder, replayed=True), output="hidden",
                        read=lambda batch, hidden: hidden[:, :1, :1])


def finish(roles, mode: str, rollout, batch: dict, mbs: list[dict], order: list[int],
           recorder: RoutingRecorder | None, timer) -> dict[str, float]:
    """After the experience forwards (``rollout``: the step's ``Rollout``; ``mbs`` in ``order``): the routing
    forward when the actor's forward did not record; ``train`` mode's routing into the batch; the flip metric."""
    if recorder is None:
        return {}
    if not recorder.parts:
        with timer.phase("routing_fwd", tokens=rollout.tokens):
            routing_forward(roles, mbs, recorder)
    samples = rollout.local
    S = batch["input_ids"].shape[1]
    trainer = merge_stages(recorder.result(S), roles.actor.mesh)  # each pipeline stage recorded its own layers
    if order != sorted(order):  # token-budget micro-batches: back to row order
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        trainer = trainer[inverse]
    device = batch["input_ids"].device
    if mode == "train":
        batch["routed_experts"] = trainer.to(device)
    out: dict[str, float] = {}
    generated = rollout_routing(samples, S, roles.actor.spec)
    if generated is not None:
        pos = torch.arange(S).unsqueeze(0)
        prompt = torch.tensor([len(s.prompt_ids) for s in samples]).unsqueeze(1)
        mask = (pos >= prompt) & batch["attention_mask"].bool().cpu()  # response tokens (B, S)
        counts = routing_flips(trainer, generated, mask)
        mesh = roles.actor.mesh
        if mesh.dp > 1:
            counts = counts.to(mesh.device)
            dist.all_reduce(counts, group=mesh.dp_group)
            counts = counts.cpu()
        out["moe/routing_flip_tokens"] = (counts[0] / counts[1]).item() if counts[1] else 0.0
        out["moe/routing_flip_pairs"] = (counts[2] / counts[3]).item() if counts[3] else 0.0
    return out
