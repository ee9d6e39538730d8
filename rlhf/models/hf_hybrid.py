"""HF <-> megatron tensors of qwen3_next (``rlhf.models.hybrid``); called by ``rlhf.models.hf_llama`` before its own
mapping with a layer's megatron name ``rest`` (after ``decoder.layers.L.``). None: not a hybrid tensor (the norms,
q/k norms, ``linear_proj`` and the dense MLP take the Llama mapping).

Layouts (megatron-core 0.16.1):

* DeltaNet ``self_attention.in_proj`` per TP rank ``[q | k | v | z | b | a]`` of its key heads (and of the value
  heads they serve) <- transformers' ``linear_attn.in_proj_qkvz`` (per key head ``[q | k | v | z]``, the key head's
  ``nv / nk`` value heads in v and z) and ``in_proj_ba`` (per key head ``[b | a]``); ``conv1d`` per rank
  ``[q | k | v]`` channels <- ``linear_attn.conv1d`` (``[q | k | v]`` over all heads); ``dt_bias``, ``A_log`` split by
  value heads; ``out_norm`` <- ``linear_attn.norm`` (replicated); ``out_proj`` <- ``linear_attn.out_proj``
  (columns split).
* gated attention ``linear_qkv`` per KV group ``[q heads | gate heads | k | v]`` <- ``q_proj`` (per head ``[q |
  gate]``), ``k_proj``, ``v_proj``; whole groups per TP rank.
"""
from __future__ import annotations

from typing import Callable

import torch

from rlhf.models.spec import ModelSpec


def _dims(spec: ModelSpec) -> tuple[int, int, int, int, int]:
    la = spec.linear_attention
    return la["num_key_heads"], la["num_value_heads"], la["key_head_dim"], la["value_head_dim"], \
        la["num_value_heads"] // la["num_key_heads"]


def tp_sections(rest: str, spec: ModelSpec) -> list[int] | None:
    """The full (TP 1) sizes of the parts each TP shard of ``rest`` stacks on dim 0, or None (plain concat)."""
    if spec.linear_attention is None:
        return None
    nk, nv, dk, dv, _ = _dims(spec)
    if rest == "self_attention.in_proj.weight":
        return [nk * dk, nk * dk, nv * dv, nv * dv, nv, nv]
    if rest == "self_attention.conv1d.weight":
        return [nk * dk, nk * dk, nv * dv]
    return None


def shard_from_hf(rest: str, p: str, get: Callable, spec: ModelSpec, *, tp_rank: int, tp: int
                  ) -> torch.Tensor | None:
    """This rank's shard of layer tensor ``rest`` from HF (``p``: ``model.layers.L.``), or None."""
    nk, nv, dk, dv, r = _dims(spec)
    g_lo, g_hi = tp_rank * nk // tp, (tp_rank + 1) * nk // tp  # this rank's key heads
    a = p + "linear_attn."
    if rest == "self_attention.in_proj.weight" and spec.linear_attention["split_in_proj"]:  # qwen3_5_text
        qkv, qk = get(a + "in_proj_qkv.weight"), nk * dk
        v_lo, v_hi = g_lo * r, g_hi * r  # this rank's value heads
        return torch.cat([qkv[g_lo * dk:g_hi * dk], qkv[qk + g_lo * dk:qk + g_hi * dk],
                          qkv[2 * qk + v_lo * dv:2 * qk + v_hi * dv], get(a + "in_proj_z.weight")[v_lo * dv:v_hi * dv],
                          get(a + "in_proj_b.weight")[v_lo:v_hi], get(a + "in_proj_a.weight")[v_lo:v_hi]]).contiguous()
    if rest == "self_attention.in_proj.weight":
        qkvz = get(a + "in_proj_qkvz.weight")
        qkvz = qkvz.reshape(nk, 2 * dk + 2 * r * dv, -1)[g_lo:g_hi]
        ba = get(a + "in_proj_ba.weight").reshape(nk, 2 * r, -1)[g_lo:g_hi]
        parts = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=1) + torch.split(ba, [r, r], dim=1)
        return torch.cat([x.reshape(-1, x.shape[-1]) for x in parts]).contiguous()
    if rest == "self_attention.conv1d.weight":
        w = get(a + "conv1d.weight")  # (2 qk + v, 1, K)
        qk = nk * dk
        return torch.cat([w[g_lo * dk:g_hi * dk], w[qk + g_lo * dk:qk + g_hi * dk],
                          w[2 * qk + g_lo * r * dv:2 * qk + g_hi * r * dv]]).contiguous()
    if rest in ("self_attention.dt_bias", "self_attention.A_log"):
        return get(a + rest.rsplit(".", 1)[1])[g_lo * r:g_hi * r].contiguous()
    if rest == "self_attention.out_norm.weight":
        return get(a + "norm.weight")
    if rest == "self_attention.out_proj.weight":
        return get(a + "out_proj.weight")[:, g_lo * r * dv:g_hi * r * dv].contiguous()
    if rest.startswith("mlp.shared_experts."):
        q = p + "mlp.shared_expert."
        lo, hi = tp_rank * spec.shared_expert_size // tp, (tp_rank + 1) * spec.shared_expert_size // tp
        if rest.endswith("linear_fc1.weight"):
            return torch.cat([get(q + "gate_proj.weight", rows=(lo, hi)), get(q + "up_proj.weight", rows=(lo, hi))])
        if rest.endswith("linear_fc2.weight"):
            return get(q + "down_proj.weight")[:, lo:hi].contiguous()
        if rest.endswith("gate_weight"):
            return get(p + "mlp.shared_expert_gate.weight")
    if rest == "self_attention.linear_qkv.weight" and spec.attention_gate:
        d, groups = spec.head_dim, spec.num_kv_heads
        per = spec.num_attention_heads // groups
        lo, hi = tp_rank * groups // tp, (tp_rank + 1) * groups // tp
        q = get(p + "self_attn.q_proj.weight").reshape(groups, per, 2, d, -1)[lo:hi]
        k = get(p + "self_attn.k_proj.weight").reshape(groups, d, -1)[lo:hi]
        v = get(p + "self_attn.v_proj.weight").reshape(groups, d, -1)[lo:hi]
        n, h = hi - lo, k.shape[-1]
        return torch.cat([q[:, :, 0].reshape(n, per * d, h), q[:, :, 1].reshape(n, per * d, h), k, v],
                         dim=1).reshape(-1, h).contiguous()
    return None


def hf_from_megatron(rest: str, p: str, tensor: torch.Tensor, spec: ModelSpec) -> list[tuple[str, torch.Tensor]] | None:
    """HF tensors of one full (TP 1) megatron layer tensor, or None."""
    nk, nv, dk, dv, r = _dims(spec)
    a = p + "linear_attn."
    if rest == "self_attention.in_proj.weight":
        h = tensor.shape[-1]
        q, k, v, z, b, al = torch.split(tensor, tp_sections(rest, spec), dim=0)
        if spec.linear_attention["split_in_proj"]:  # qwen3_5_text
            return [(a + "in_proj_qkv.weight", torch.cat([q, k, v]).contiguous()), (a + "in_proj_z.weight", z),
                    (a + "in_proj_b.weight", b), (a + "in_proj_a.weight", al)]
        qkvz = torch.cat([q.reshape(nk, dk, h), k.reshape(nk, dk, h), v.reshape(nk, r * dv, h),
                          z.reshape(nk, r * dv, h)], dim=1).reshape(-1, h)
        ba = torch.cat([b.reshape(nk, r, h), al.reshape(nk, r, h)], dim=1).reshape(-1, h)
        return [(a + "in_proj_qkvz.weight", qkvz.contiguous()), (a + "in_proj_ba.weight", ba.contiguous())]
    simple = {"self_attention.conv1d.weight": "conv1d.weight", "self_attention.dt_bias": "dt_bias",
              "self_attention.A_log": "A_log", "self_attention.out_norm.weight": "norm.weight",
              "self_attention.out_proj.weight": "out_proj.weight"}
    if rest in simple:
        return [(a + simple[rest], tensor)]
    if rest.startswith("mlp.shared_experts."):
        q = p + "mlp.shared_expert."
        if rest.endswith("linear_fc1.weight"):
            gate, up = torch.chunk(tensor, 2, dim=0)
            return [(q + "gate_proj.weight", gate), (q + "up_proj.weight", up)]
        if rest.endswith("linear_fc2.weight"):
            return [(q + "down_proj.weight", tensor)]
        if rest.endswith("gate_weight"):
            return [(p + "mlp.shared_expert_gate.weight", tensor)]
    if rest == "self_attention.linear_qkv.weight" and spec.attention_gate:
        d, groups = spec.head_dim, spec.num_kv_heads
        per, h = spec.num_attention_heads // groups, tensor.shape[-1]
        q, gate, k, v = torch.split(tensor.reshape(groups, (2 * per + 2) * d, h), [per * d, per * d, d, d], dim=1)
        q_proj = torch.stack([q.reshape(groups, per, d, h), gate.reshape(groups, per, d, h)], dim=2)
        return [(p + "self_attn.q_proj.weight", q_proj.reshape(-1, h).contiguous()),
                (p + "self_attn.k_proj.weight", k.reshape(-1, h).contiguous()),
                (p + "self_attn.v_proj.weight", v.reshape(-1, h).contiguous())]
    return None


def layer_hf_names(spec: ModelSpec, layer: int) -> set[str]:
    """Every HF tensor of decoder layer ``layer``."""
    p = f"model.layers.{layer}."
    names = {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    if spec.moe_layers is not None and spec.moe_layers[layer]:
        names |= {p + "mlp.gate.weight", p + "mlp.shared_expert_gate.weight"}
        names |= {f"{p}mlp.shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")}
        names |= {f"{p}mlp.experts.{e}.{n}_proj.weight" for e in range(spec.num_experts)
                  for n in ("gate", "up", "down")}
    else:
        names |= {f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    if spec.linear_attention["layers"][layer]:
        proj = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a") if spec.linear_attention["split_in_proj"] \
            else ("in_proj_qkvz", "in_proj_ba")
        return names | {f"{p}linear_attn.{n}" for n in (*(f"{x}.weight" for x in proj), "conv1d.weight", "dt_bias",
                                                        "A_log", "norm.weight", "out_proj.weight")}
    return names | {f"{p}self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
