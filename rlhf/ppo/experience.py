"""Experience: from generated samples to the tensors PPO trains on (the ``make_experience`` stage's records).

Shapes: B samples on this DP rank, S = padded prompt+response length, T = ``--generate_max_len`` (response
tensors always have this width, so they concatenate and all-gather without re-padding), H hidden size.
``resp_pos[b, j]`` is the position whose output predicts response token j of sample b (``prompt_len - 1 + j``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rlhf.distributed.collectives import to_all_stages
from rlhf.models.outputs import response_logprobs, response_values, sequence_scores
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
        action_mask[b, :r] = True if s.action_mask is None else torch.tensor(s.action_mask, dtype=torch.bool)
        resp_pos[b] = (len(s.prompt_ids) - 1 + torch.arange(T)).clamp(max=S - 1)
    out = {"input_ids": input_ids, "attention_mask": attention_mask, "response_ids": response_ids,
           "action_mask": action_mask, "resp_pos": resp_pos}
    from rlhf.data.collate import vision_entries

    out.update(vision_entries([s.mm for s in samples], input_ids))  # a vision-language actor's images
    return out


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
    if "routed_experts" in mb:  # MoE routing replay: the same tokens, packed the same way
        from rlhf.models.routing_replay import pack_routing

        out["routed_experts"] = pack_routing(mb["routed_experts"], mb["attention_mask"], out["input_ids"].shape[1])
    return out


def prepare_microbatches(mbs: list[dict], *, packing: bool, pp: int, pad_id: int) -> list[dict]:
    """Pack when asked; with PP every packed micro-batch of one call gets the same length (megatron's schedule
    sends one activation shape between stages)."""
    if not packing:
        return mbs
    pad_to = max(int(mb["attention_mask"].sum()) for mb in mbs) if pp > 1 else None
    return [pack_microbatch(mb, pad_id, pad_to) for mb in mbs]


def forward_role(engine, role: str, microbatches: list[dict], temperature: float) -> torch.Tensor:
    """One frozen forward of ``role`` over this rank's micro-batches (the pipeline's no-loss path, each output read
    where the role needs it); the result on every pipeline stage.
    actor/ref/teacher -> log-probs (B, T); critic -> values (B, T); reward -> scores (B,)."""
    from rlhf.models.context_parallel import reads_local_tokens

    # the readers of rlhf.models.outputs take a CP rank's own tokens (reads_local_tokens)
    if role in ("actor", "ref", "teacher"):
        @reads_local_tokens
        def read(batch: dict, hidden: torch.Tensor) -> torch.Tensor:
            return response_logprobs(engine, batch, hidden, temperature)
        output = "hidden"
    else:
        reader = response_values if role == "critic" else sequence_scores

        @reads_local_tokens
        def read(batch: dict, out: torch.Tensor) -> torch.Tensor:
            return reader(out, batch)
        output = "head"
    outs = engine.forward(microbatches, output=output, read=read)
    local = torch.cat([o["output"] for o in outs]) if outs else None  # last stage only
    B = sum(mb["response_ids"].shape[0] for mb in microbatches)
    T = microbatches[0]["response_ids"].shape[1]
    return to_all_stages(local, (B,) if role == "reward" else (B, T), engine.mesh)


@dataclass
class Experience:
    """This DP rank's share of one rollout, ready for the PPO updates. B samples, T = --generate_max_len."""

    samples: list[Sample]
    batch: dict
    """``collate_sequences`` of the B samples: input_ids, attention_mask (B, S); response_ids, action_mask,
    resp_pos (B, T)"""
    old_logprobs: torch.Tensor
    """(B, T) log-probs the updates' ratio starts from: the actor's forward in make_experience, or, with
    --use_rollout_logprobs, the generator's (``vllm_logprobs``)"""
    vllm_logprobs: torch.Tensor
    """(B, T) the generator's log-probs of the sampled tokens (vLLM or the megatron fallback)"""
    rewards: torch.Tensor
    """(B,) the combined reward being optimized (normalized where asked; rlhf/rewards/sources.py)"""
    ref_logprobs: torch.Tensor | None = None
    """(B, T) the reference model's, when --init_kl_coef > 0"""
    teacher_logprobs: torch.Tensor | None = None
    """(B, T) the distillation teacher's (--teacher_pretrain), at the sampling temperature"""
    values: torch.Tensor | None = None
    """(B, T) the critic's, when the estimator needs a critic"""
    kl: torch.Tensor | None = None
    """(B, T) per-token KL estimate of old_logprobs against ref_logprobs (zeros without a reference)"""
    advantages: torch.Tensor | None = None
    """(B, T) from compute_advantages"""
    returns: torch.Tensor | None = None
    """(B, T) from compute_advantages"""

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
        if "routed_experts" in mb:  # (B, S, layers, K), MoE routing replay
            mb["routed_experts"] = mb["routed_experts"][:, :S]
        if "mrope_position_ids" in mb:  # (B, 3, S) and (B, S), a vision-language batch
            mb["mrope_position_ids"] = mb["mrope_position_ids"][..., :S]
            mb["image_mask"] = mb["image_mask"][:, :S]
    for name, t in (extra or {}).items():
        if t is not None:
            mb[name] = t[ix]
    return mb


def generator_logprobs(local: list[Sample], T: int) -> torch.Tensor:
    """The generator's log-probs of the sampled tokens, right-padded to (B, T) with zeros."""
    lp = torch.zeros(len(local), T)
    for b, s in enumerate(local):
        lp[b, : len(s.logprobs)] = torch.tensor(s.logprobs)
    return lp


def sampled_logprob_drift(engine, actor, mesh, prompts: list[list[int]], *, n: int, max_tokens: int,
                          temperature: float, seed: int) -> float:
    """Generate from ``engine``, then the largest |generator - trainer (``actor``)| log-prob over the sampled
    tokens of the whole batch: a check that the engine serves the trainer's weights. Collective."""
    samples = engine.generate(prompts, n=n, temperature=temperature, top_p=1.0, max_tokens=max_tokens, seed=seed)
    per = len(samples) // mesh.dp
    local = samples[mesh.dp_rank * per:(mesh.dp_rank + 1) * per]
    seq_len = None if mesh.pp == 1 else max(len(p) for p in prompts) + max_tokens  # PP: one shape per stage
    batch = collate_sequences(local, 0, max_tokens, seq_len=seq_len)
    lp = forward_role(actor, "actor", [select_rows(batch, range(len(local)), trim=mesh.pp == 1)], temperature)
    gen = generator_logprobs(local, lp.shape[1]).to(lp.device)  # host lists -> the trainer's device
    d = ((lp - gen).abs() * batch["action_mask"].to(lp.device)).max()
    torch.distributed.all_reduce(d, op=torch.distributed.ReduceOp.MAX)
    return d.item()
