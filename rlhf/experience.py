"""Experience making: from generated samples to the tensors PPO trains on.

Shapes: B samples on this DP rank, S = padded prompt+response length, T = ``--generate_max_len`` (response
tensors always have this width, so they concatenate and all-gather without re-padding), H hidden size.
``resp_pos[b, j]`` is the position whose output predicts response token j of sample b (``prompt_len - 1 + j``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from rlhf.rollout.types import Sample


def collate_sequences(samples: Sequence[Sample], pad_id: int, T: int, seq_len: int | None = None) -> dict:
    """Right-padded prompt+response rows and the response-aligned index tensors."""
    lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    S = seq_len or max(lens)
    B = len(samples)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, S, dtype=torch.long)
    response_ids = torch.full((B, T), pad_id, dtype=torch.long)
    action_mask = torch.zeros(B, T, dtype=torch.bool)
    resp_pos = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(samples):
        seq = list(s.prompt_ids) + list(s.response_ids)
        input_ids[b, : len(seq)] = torch.tensor(seq)
        attention_mask[b, : len(seq)] = 1
        r = len(s.response_ids)
        response_ids[b, :r] = torch.tensor(s.response_ids, dtype=torch.long)
        action_mask[b, :r] = True
        resp_pos[b] = (len(s.prompt_ids) - 1 + torch.arange(T)).clamp(max=S - 1)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_ids": response_ids,
            "action_mask": action_mask, "resp_pos": resp_pos}


def pack_microbatch(mb: dict, pad_id: int, pad_to: int | None = None) -> dict:
    """--packing_samples: one padded micro-batch -> one packed row (THD, no pad tokens; ``rlhf.models.packing``).
    The response tensors stay (B, T); ``packed_resp_pos`` / ``packed_last`` index the packed stream."""
    from rlhf.models.packing import make_packed_batch

    packed = make_packed_batch(mb["input_ids"], mb["attention_mask"], pad_to=pad_to, pad_token_id=pad_id)
    cu = packed["cu_seqlens"].long()
    start, length = cu[:-1].unsqueeze(1), (cu[1:] - cu[:-1]).unsqueeze(1)  # (B, 1)
    out = {k: v for k, v in mb.items() if k not in ("input_ids", "attention_mask")}
    out.update({k: packed[k] for k in ("input_ids", "position_ids", "packed_seq_params", "cu_seqlens",
                                       "num_tokens")})
    out["packed_resp_pos"] = start + torch.minimum(mb["resp_pos"], length - 1)  # (B, T)
    out["packed_last"] = (cu[1:] - 1)  # (B,)
    return out


def prepare_microbatches(mbs: list[dict], *, packing: bool, pp: int, pad_id: int) -> list[dict]:
    """Pack when asked; with PP every packed micro-batch of one call gets the same length (megatron's schedule
    sends one activation shape between stages)."""
    if not packing:
        return mbs
    pad_to = max(int(mb["attention_mask"].sum()) for mb in mbs) if pp > 1 else None
    return [pack_microbatch(mb, pad_id, pad_to) for mb in mbs]


def response_hidden(hidden: torch.Tensor, batch: dict) -> torch.Tensor:
    """hidden (B, S, H) [or packed (1, N, H)] -> (B, T, H) at the positions that predict the response tokens."""
    if "packed_resp_pos" in batch:
        return hidden[0][batch["packed_resp_pos"]]
    return hidden.gather(1, batch["resp_pos"].unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def response_values(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Critic output (B, S) [or packed (1, N)] -> (B, T) fp32 at the positions before each response token."""
    if "packed_resp_pos" in batch:
        return values[0][batch["packed_resp_pos"]].float()
    return values.gather(1, batch["resp_pos"]).float()


def sequence_scores(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Reward-model output at each sequence's last token -> (B,) fp32."""
    from rlhf.algo.losses import sequence_rewards

    if "packed_last" in batch:
        return values[0][batch["packed_last"]].float()
    return sequence_rewards(values, batch["attention_mask"])


def actor_logprobs(engine, batch: dict, hidden: torch.Tensor, temperature: float, entropy: bool = False):
    """log p(response token) at ``temperature`` from the final hidden states, through the fused vocab-parallel
    kernel (the [tokens, vocab] logits are never whole in memory). Returns (B, T) fp32 (and entropy)."""
    import kernels

    mesh = engine.mesh
    weight = engine.model.output_weight()
    h = response_hidden(hidden, batch).to(weight.dtype)  # (B, T, H); bf16 models hand fp32 hidden states back
    b, t, hdim = h.shape
    out = kernels.fused_linear_logprobs(h.reshape(-1, hdim), weight,
                                        batch["response_ids"].reshape(-1), temperature=temperature,
                                        tp_group=mesh.tp_group if mesh.tp > 1 else None,
                                        return_entropy=entropy, vocab_size=engine.spec.vocab_size)
    if entropy:
        return out[0].view(b, t), out[1].view(b, t)
    return out.view(b, t)


def _collect(outs: list[dict], key: str) -> torch.Tensor | None:
    return torch.cat([o[key] for o in outs]) if outs else None


def forward_role(engine, role: str, microbatches: list[dict], temperature: float) -> torch.Tensor:
    """One frozen forward of ``role`` over this rank's micro-batches; the result on every pipeline stage.
    actor/ref -> log-probs (B, T); critic -> values (B, T); reward -> scores (B,)."""
    def fn(batch: dict, out: torch.Tensor):
        if role in ("actor", "ref"):
            res = actor_logprobs(engine, batch, out, temperature)
        elif role == "critic":
            res = response_values(out, batch)
        else:
            res = sequence_scores(out, batch)
        return torch.zeros(()), {"out": res}

    output = "hidden" if role in ("actor", "ref") else "logits"
    outs = engine.forward(microbatches, output=output, loss_fn=fn)
    local = _collect(outs, "out")
    B = sum(mb["response_ids"].shape[0] for mb in microbatches)
    T = microbatches[0]["response_ids"].shape[1]
    shape = (B,) if role == "reward" else (B, T)
    return to_all_stages(local, shape, engine.mesh)


def to_all_stages(t: torch.Tensor | None, shape: tuple, mesh) -> torch.Tensor:
    """Broadcast a last-stage result over the pipeline group (a no-op without PP)."""
    if mesh.pp == 1:
        return t
    buf = t.contiguous().float() if mesh.is_last_stage else torch.empty(shape, dtype=torch.float32,
                                                                          device=mesh.device)
    dist.broadcast(buf, src=dist.get_global_rank(mesh.pp_group, mesh.pp - 1), group=mesh.pp_group)
    return buf


def dp_all_gather(t: torch.Tensor, mesh) -> torch.Tensor:
    """Concatenate a per-DP-rank tensor over the DP group, in DP-rank order (dim 0)."""
    if mesh.dp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(mesh.dp)]
    dist.all_gather(parts, t.contiguous(), group=mesh.dp_group)
    return torch.cat(parts)


@dataclass
class Experience:
    """This DP rank's share of one rollout, ready for the PPO updates. Response tensors are (B, T)."""

    samples: list[Sample]
    batch: dict  # collate_sequences of all B samples
    old_logprobs: torch.Tensor
    vllm_logprobs: torch.Tensor
    rewards: torch.Tensor  # (B,)
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    info: dict = field(default_factory=dict)

    def select(self, idx: Sequence[int], trim: bool = True) -> dict:
        """A training micro-batch: the collated rows ``idx`` plus their experience tensors. ``trim`` cuts the
        padding to the longest row (not with PP, whose micro-batches must all have one shape)."""
        return select_rows(self.batch, idx, trim, {n: getattr(self, n) for n in
                                                  ("old_logprobs", "vllm_logprobs", "advantages", "returns",
                                                   "ref_logprobs", "values")})


def select_rows(batch: dict, idx: Sequence[int], trim: bool, extra: dict | None = None) -> dict:
    ix = torch.as_tensor(list(idx), dtype=torch.long)
    mb = {k: v[ix] for k, v in batch.items()}
    if trim:
        S = int(mb["attention_mask"].sum(1).max())
        mb["input_ids"], mb["attention_mask"] = mb["input_ids"][:, :S], mb["attention_mask"][:, :S]
        mb["resp_pos"] = mb["resp_pos"].clamp(max=S - 1)
    for name, t in (extra or {}).items():
        if t is not None:
            mb[name] = t[ix]
    return mb
