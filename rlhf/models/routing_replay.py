"""MoE routing replay: the generator's experts (R3) or the trainer's first forward's (R2) replayed in the trainer's
forwards and backwards, through megatron-core's own ``RouterReplay`` (``megatron/core/transformer/moe/
router_replay.py``, one instance per MoE layer when ``TransformerConfig.moe_enable_routing_replay``); and the
routing-flip metric. No second router: megatron's router takes the replayed top-k indices and gathers its own
scores for them, so gradients reach the router as without replay.

A sample's routing is a tensor ``(L, layers, top_k)`` of expert ids + 1 (0: no routing known, e.g. a pad token, the
last token that a generator never feeds back), int16: ``layers x top_k`` small integers per token. A batch carries it
as ``routed_experts`` (B, S, layers, top_k) beside ``input_ids`` (B, S), so it follows the sample through
micro-batching, trimming, token-budget batches and packing (``pack_routing``). Expert ids are global (megatron's
router scores every expert; expert parallelism only moves the tokens afterwards), so EP needs nothing more.

megatron's router flattens its input ``(S, B, H)`` sequence-first: token ``s * B + b``; ``_layer_targets`` lays the
batch's routing out the same way.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from rlhf.config.part import Part, flag

MODES = ("off", "rollout", "train")
ALIASES = {"disabled": "off", "R3": "rollout", "R2": "train"}
"""verl's ``router_replay.mode`` values"""


def _mode(value: str) -> str:
    mode = ALIASES.get(value, value)
    if mode not in MODES:
        raise ValueError(f"--moe_router_replay {value!r}: expected one of off, rollout, train (verl's disabled, R3, "
                         "R2)")
    return mode


@dataclass
class RouterReplayPart(Part):
    """How the MoE actor's expert routing is kept equal between the generator and the trainer."""

    moe_router_replay: str = flag(
        type=str, default="off", metavar="{off,rollout,train}",
        help="MoE actors: replay the generator's routing (rollout, R3) or the trainer's first forward's (train, R2) "
             "in the trainer's forwards and backwards; verl's names R3, R2, disabled are accepted (docs/ppo.md)",
        switches=((("--use-rollout-routing-replay", "--use_rollout_routing_replay"), "rollout",
                   "slime's name for --moe_router_replay rollout"),
                  (("--use-routing-replay", "--use_routing_replay"), "train",
                   "slime's name for --moe_router_replay train")))
    """``rollout`` (R3): the generator's experts for every prompt and response token are replayed in every forward
    and backward of the actor (old log-probs, the update); ``train`` (R2): the routing of the trainer's first
    forward of the sample is replayed in the update; ``off``. The reference routes itself in every mode. slime:
    ``--use-rollout-routing-replay`` / ``--use-routing-replay``; verl: ``router_replay.mode`` R3 / R2 / disabled."""
    moe_routing_flip_interval: int = flag(
        type=int, default=0,
        help="MoE actors: every N steps log moe/routing_flip_tokens where measuring it costs one more actor forward "
             "(with --moe_router_replay rollout, or when make_experience runs no actor forward); 0 (default): not "
             "there. Elsewhere it is measured every step at no cost")
    """every N steps measure the routing-flip metric where it costs an extra actor forward (R3, or no actor forward
    in make_experience); 0: never there. Where the actor's own experience forward records the routing (off or R2
    with that forward) it is measured every step, free"""

    def check(self) -> None:
        self.moe_router_replay = _mode(self.moe_router_replay)
        if self.moe_routing_flip_interval < 0:
            raise ValueError(f"--moe_routing_flip_interval must be >= 0 (0: never where it costs a forward), got "
                             f"{self.moe_routing_flip_interval}")


def check_router_replay(part: RouterReplayPart, spec, *, backend: str, model: str) -> None:
    """The mode against the actor (``spec``: its ``ModelSpec``), the layout and the generator (``backend``:
    --rollout_backend), before any model loads."""
    mode = part.moe_router_replay
    if mode == "off":
        return
    if not spec.num_experts:
        raise ValueError(f"--moe_router_replay {mode}: the actor {model} ({spec.model_type}) is not a "
                         "mixture-of-experts model; routing replay is for MoE actors (mixtral, qwen3_moe)")
    import importlib.util

    vllm = backend == "vllm" or (backend == "auto" and importlib.util.find_spec("vllm") is not None)
    if mode == "rollout" and vllm and not torch.cuda.is_available():
        raise ValueError("--moe_router_replay rollout needs the generator's routing: vLLM 0.32 returns it only with "
                         "its V2 model runner, which needs Triton and so does not run on CPU ('AuxOutput Connector "
                         "requires Model Runner V2'); use --rollout_backend megatron on CPU")


def replay_routers(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """``(layer index from 0, RouterReplay)`` of every MoE router of this model stage that has one."""
    cached = getattr(model, "_rlhf_replay_routers", None)
    if cached is not None:
        return cached
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter) and getattr(m, "router_replay", None)]
    model._rlhf_replay_routers = [(int(m.layer_number) - 1, m.router_replay) for m in routers]
    model._rlhf_replay_recompute = any(m.config.recompute_granularity == "full" for m in routers)
    return model._rlhf_replay_routers


def _layer_targets(routed: torch.Tensor, layer: int) -> torch.Tensor:
    """routed (B, S, layers, K) ids + 1 -> megatron's top-k indices (S * B, K) of ``layer``, sequence-first; a token
    without a known routing (0) gets experts 0..K-1 (a pad or last token: nothing that is read depends on it)."""
    idx = routed[:, :, layer].transpose(0, 1).reshape(-1, routed.shape[-1]).long() - 1  # (S*B, K)
    unknown = (idx < 0).any(dim=1, keepdim=True)
    return torch.where(unknown, torch.arange(idx.shape[1], device=idx.device).expand_as(idx), idx)


def _cp_layout(batch: dict):
    """The micro-batch's context-parallel split (``rlhf.models.context_parallel``), or None without CP: the decoder
    routes this rank's tokens only, so the routing replayed is split the same way and the routing recorded is
    gathered back."""
    from rlhf.models import context_parallel as cpm

    return cpm.layout_for_batch(batch["input_ids"], batch.get("packed_seq_params"))


def _reset(routers: list) -> None:
    for _, rr in routers:
        rr.clear_indices()
        rr.clear_router_replay_action()


def _start(routers: list) -> None:
    """A micro-batch's forward starts: no action or indices from another forward. The backward list keeps what
    forwards still in flight (pipeline parallelism with recompute) left for their backwards."""
    for _, rr in routers:
        rr.target_topk_idx = rr.recorded_topk_idx = None
        rr.clear_router_replay_action()


def _action_for_backward(routers: list, replayed: bool):
    """A gradient hook on a micro-batch's output: when its backward reaches this stage, the recompute of its layers
    (full recompute) routes as its forward did: ``replay_backward`` pops this micro-batch's indices (megatron's
    list is first in, first out, as the schedule runs the backwards in the forwards' order), else the router's own
    top-k."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    def hook(grad):
        for _, rr in routers:
            if replayed:
                rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                rr.clear_router_replay_action()
        return grad
    return hook


@contextlib.contextmanager
def routing_for_forward(model: torch.nn.Module, batch: dict) -> Iterator[Callable[[torch.Tensor], None]]:
    """Around one micro-batch's ``model(...)``: replay ``batch["routed_experts"]`` when the batch carries it; record
    when the batch carries a ``RoutingRecorder`` (``routing_recorder``); else megatron's own top-k. Yields
    ``watch(output)``, to be called with the forward's output.

    With full recompute (``--gradient_checkpointing``) the backward runs each layer's forward again. A forward with
    gradients leaves its replayed indices in ``RouterReplay``'s backward list (megatron's own mechanism) and puts a
    hook on its output that sets the action its recompute needs when the backward reaches it: with pipeline
    parallelism other micro-batches' forwards run between a forward and its backward (1F1B), each with its own
    action, and the list holds one entry per micro-batch in flight. A forward without gradients takes its entry
    back."""
    routers = replay_routers(model) if isinstance(model, torch.nn.Module) else []
    if not routers:
        yield _no_watch
        return
    _start(routers)
    routed, recorder = batch.get("routed_experts"), batch.get("routing_recorder")
    if recorder is not None and recorder.model is not model:  # another role's forward of the same micro-batches
        recorder = None
    recompute = torch.is_grad_enabled() and model._rlhf_replay_recompute
    watch = _watcher(routers, replayed=routed is not None) if recompute else _no_watch
    if routed is None and recorder is None:
        yield watch
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    layout = _cp_layout(batch)
    if routed is not None and layout is not None:
        from rlhf.models.context_parallel import split_input

        routed = split_input(routed, layout, dim=1)  # (B, S_local, layers, K): this rank's tokens, 0 at padding
    if routed is not None and model.config.sequence_parallel:
        from rlhf.models.sequence_parallel import local_slice

        routed = local_slice(routed, dim=1)  # (B, S_pad / TP, layers, K): this TP rank's positions
    for layer, rr in routers:
        if routed is not None:
            rr.set_target_indices(_layer_targets(routed, layer))
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        else:
            rr.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield watch
        if recorder is not None and routed is None:
            recorder.take(batch, routers, layout)
    except BaseException:
        _reset(routers)
        raise
    for _, rr in routers:
        if routed is not None and not recompute:  # no backward routes again: the entry is not for a backward
            rr.replay_backward_list.pop()
        rr.clear_router_replay_action()


def _no_watch(out: torch.Tensor) -> None:
    return None


def _watcher(routers: list, replayed: bool) -> Callable[[torch.Tensor], None]:
    def watch(out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(_action_for_backward(routers, replayed))
    return watch


class RoutingRecorder:
    """Collects the routing megatron's routers chose in unreplayed forwards, one micro-batch after another, as
    (B, S, layers, K) ids + 1 in the batch's own padded layout (packed micro-batches are unpacked)."""

    def __init__(self, num_layers: int, model: torch.nn.Module):
        self.num_layers, self.model = num_layers, model  # the model whose forwards it records
        self.parts: list[torch.Tensor] = []

    def take(self, batch: dict, routers: list, layout=None) -> None:
        """``layout``: the micro-batch's CP split; the routers then hold this rank's tokens only, gathered here over
        the CP group (a collective: every CP rank records the same micro-batch)."""
        ids = batch["input_ids"]
        B, S = ids.shape
        K = routers[0][1].recorded_topk_idx.shape[-1]
        n = S if layout is None else layout.local.numel()  # the tokens this rank's routers saw
        sp = self.model.config.sequence_parallel
        if sp:  # this TP rank's S_pad / TP positions (rlhf.models.sequence_parallel)
            n = routers[0][1].recorded_topk_idx.shape[0] // B
        out = torch.zeros(B, n, self.num_layers, K, dtype=torch.int32)
        for layer, rr in routers:
            out[:, :, layer] = rr.recorded_topk_idx.detach().view(n, B, K).transpose(0, 1).to("cpu", torch.int32) + 1
        if sp:
            from rlhf.models.sequence_parallel import gather_slices

            device = rr.recorded_topk_idx.device
            out = gather_slices(out.to(device), S, dim=1).cpu()  # (B, S, layers, K): every TP rank's positions
        if layout is not None:
            from rlhf.models.context_parallel import gather_tokens

            device = rr.recorded_topk_idx.device
            out = gather_tokens(out.to(device), layout).cpu()  # (B, S, layers, K) in the batch's layout
        out = out.short()
        if "packed_seq_params" in batch:  # one packed row -> the rows of the padded micro-batch
            cu = batch["cu_seqlens"].cpu()
            out = unpack_routing(out[0], cu, int((cu[1:] - cu[:-1]).max()))
        self.parts.append(out)

    def result(self, width: int) -> torch.Tensor:
        """Every micro-batch's rows, right-padded to ``width`` positions: (B, width, layers, K)."""
        return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, 0, 0, width - p.shape[1])) for p in self.parts])


def collate_routing(routings: list, S: int, num_layers: int, top_k: int) -> torch.Tensor:
    """Each sample's routing (``(L_i, layers, K)`` numpy or tensor of expert ids, as vLLM's
    ``CompletionOutput.routed_experts``; or None) -> (B, S, layers, K) ids + 1, 0 past each sample's routing."""
    out = torch.zeros(len(routings), S, num_layers, top_k, dtype=torch.int16)
    for b, r in enumerate(routings):
        if r is None:
            continue
        t = torch.as_tensor(r)[:S].to(torch.int16)
        if tuple(t.shape[1:]) != (num_layers, top_k):
            raise ValueError(f"a sample's routing has shape {tuple(t.shape)}; expected (tokens, {num_layers} layers, "
                             f"top-{top_k})")
        out[b, : t.shape[0]] = t + 1
    return out


def merge_stages(routed: torch.Tensor, mesh) -> torch.Tensor:
    """Under pipeline parallelism each stage records its own layers (zeros in the others'): the whole routing on
    every stage of the pipeline. Collective over the PP group."""
    if mesh.pp == 1:
        return routed
    import torch.distributed as dist

    t = routed.to(device=mesh.device, dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.pp_group)
    return t.to(device=routed.device, dtype=routed.dtype)


def pack_routing(routed: torch.Tensor, attention_mask: torch.Tensor, total: int) -> torch.Tensor:
    """(B, S, layers, K) -> one packed row (1, total, layers, K): the real tokens in order, then zeros."""
    real = routed[attention_mask.bool()]  # (N, layers, K)
    pad = real.new_zeros((total - real.shape[0], *real.shape[1:]))
    return torch.cat([real, pad]).unsqueeze(0)


def unpack_routing(packed: torch.Tensor, cu_seqlens: torch.Tensor, S: int) -> torch.Tensor:
    """(T, layers, K) of one packed row -> (B, S, layers, K), each sequence from position 0, zeros after."""
    B = cu_seqlens.numel() - 1
    out = packed.new_zeros((B, S, *packed.shape[1:]))
    for b in range(B):
        lo, hi = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        out[b, : hi - lo] = packed[lo:hi]
    return out


def routing_flips(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How often the trainer's top-k expert set differs from the rollout's. trainer, rollout (B, S, layers, K) ids +
    1; mask (B, S) bool, the tokens to count (response tokens whose routing both sides know). Returns
    ``[token flips, tokens, token-layer flips, token-layer pairs]`` (float64) for a global sum."""
    known = mask & (trainer > 0).all(-1).all(-1) & (rollout > 0).all(-1).all(-1)  # (B, S)
    differs = (trainer.sort(-1).values != rollout.sort(-1).values).any(-1)  # (B, S, layers): sets, not order
    pairs = differs & known.unsqueeze(-1)
    n_layers = trainer.shape[2]
    return torch.tensor([float(pairs.any(-1).sum()), float(known.sum()), float(pairs.sum()),
                         float(known.sum()) * n_layers], dtype=torch.float64)
