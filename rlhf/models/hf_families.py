"""HF <-> megatron tensors of the families beyond the Llama layout (deepseek_v3, glm4_moe, gpt_oss); called by
``rlhf.models.hf_llama`` before its own mapping, with a layer's megatron name ``rest`` (after
``decoder.layers.L.``). None means "not a family tensor": the Llama mapping takes it.

Layouts (megatron-core 0.16.1, local spec):

* MLA: ``linear_q_down_proj`` <- ``q_a_proj``, ``linear_kv_down_proj`` <- ``kv_a_proj_with_mqa`` (both
  replicated over TP: ``rlhf.models.layer_specs``), ``q_layernorm`` <-
  ``q_a_layernorm``, ``kv_layernorm`` <- ``kv_a_layernorm`` (replicated), ``linear_q_up_proj`` <- ``q_b_proj``
  (``linear_q_proj`` <- ``q_proj`` when q_lora_rank is None), ``linear_kv_up_proj`` <- ``kv_b_proj`` (per head
  ``[k_nope | v]`` as HF's; heads split over TP), ``linear_proj`` <- ``o_proj`` (columns: heads x v_head_dim).
* the router: ``mlp.router.weight`` <- ``mlp.gate.weight`` (deepseek/glm) or ``mlp.router.weight`` (gpt_oss), its
  bias <- ``mlp.router.bias``, the expert-bias buffer ``mlp.router.expert_bias`` <- ``mlp.gate.e_score_correction_bias``
  (a buffer: ``BUFFERS``); shared experts ``mlp.shared_experts.linear_fc1`` <- ``[gate; up]`` of
  ``mlp.shared_experts.{gate,up}_proj`` per TP shard, ``linear_fc2`` <- ``down_proj``.
* gpt_oss: ``core_attention.softmax_offset`` <- ``self_attn.sinks`` (heads split over TP), ``linear_proj.bias`` <-
  ``o_proj.bias``; each expert's ``linear_fc1`` <- ``[gate; up]`` of ``experts.gate_up_proj[e]`` (``(H, 2I)``, gate and
  up interleaved in its columns: gate ``[:, 0::2]``, up ``[:, 1::2]``, transposed) with its bias from
  ``gate_up_proj_bias[e]``; ``linear_fc2`` <- ``down_proj[e]`` transposed, bias ``down_proj_bias[e]``. The HF
  tensors hold every expert of a layer; the megatron -> HF direction yields one expert at a time under the name
  ``model.layers.L.mlp.experts.E.<tensor>`` and ``fuse_experts`` stacks a layer's experts into HF's tensor.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator

import torch

from rlhf.models.spec import ModelSpec

BUFFERS = ("mlp.router.expert_bias",)
"""megatron buffers that are HF tensors (DeepSeek's e_score_correction_bias): filled, exported and synced as
parameters are"""
_OSS_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_OSS_HF = {("linear_fc1", "weight"): "gate_up_proj", ("linear_fc1", "bias"): "gate_up_proj_bias",
           ("linear_fc2", "weight"): "down_proj", ("linear_fc2", "bias"): "down_proj_bias"}
_MLA = {"self_attention.linear_q_up_proj.weight": "q_b_proj.weight", "self_attention.linear_q_proj.weight":
        "q_proj.weight", "self_attention.linear_kv_up_proj.weight": "kv_b_proj.weight"}  # heads split over TP
_MLA_NORMS = {"self_attention.q_layernorm.weight": "q_a_layernorm.weight",  # replicated over TP
              "self_attention.kv_layernorm.weight": "kv_a_layernorm.weight",
              "self_attention.linear_q_down_proj.weight": "q_a_proj.weight",
              "self_attention.linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight"}


def _rows(n: int, tp_rank: int, tp: int) -> tuple[int, int]:
    assert n % tp == 0, (n, tp)
    return tp_rank * n // tp, (tp_rank + 1) * n // tp


def _router(spec: ModelSpec) -> str:
    return "mlp.router" if spec.model_type == "gpt_oss" else "mlp.gate"


def shard_from_hf(rest: str, p: str, get: Callable, spec: ModelSpec, *, tp_rank: int, tp: int,
                  expert_offset: int) -> torch.Tensor | None:
    """This rank's shard of layer tensor ``rest`` from HF (``p``: ``model.layers.L.``), or None."""
    if spec.mla is not None and rest in _MLA:
        out = get(p + "self_attn." + _MLA[rest])
        return out[slice(*_rows(out.shape[0], tp_rank, tp))].contiguous()
    if spec.mla is not None and rest in _MLA_NORMS:
        return get(p + "self_attn." + _MLA_NORMS[rest])
    if rest == "self_attention.linear_proj.weight" and spec.mla is not None:
        out = get(p + "self_attn.o_proj.weight")
        return out[:, slice(*_rows(out.shape[1], tp_rank, tp))].contiguous()
    if rest == "self_attention.linear_proj.bias":
        return get(p + "self_attn.o_proj.bias")
    if rest == "self_attention.core_attention.softmax_offset":
        return get(p + "self_attn.sinks")[slice(*_rows(spec.num_attention_heads, tp_rank, tp))].contiguous()
    if rest == "mlp.router.weight":
        return get(p + _router(spec) + ".weight")
    if rest == "mlp.router.bias":
        return get(p + "mlp.router.bias")
    if rest == "mlp.router.expert_bias":
        return get(p + "mlp.gate.e_score_correction_bias").float()
    if rest.startswith("mlp.shared_experts."):
        lo, hi = _rows(spec.shared_expert_size, tp_rank, tp)
        q = p + "mlp.shared_experts."
        if rest.endswith("linear_fc1.weight"):
            return torch.cat([get(q + "gate_proj.weight", rows=(lo, hi)), get(q + "up_proj.weight", rows=(lo, hi))])
        return get(q + "down_proj.weight")[:, lo:hi].contiguous()
    m = _OSS_EXPERT.match(rest) if spec.model_type == "gpt_oss" else None
    if m:
        return _oss_expert_shard(p, get, spec, expert_offset + int(m[1]), m[2], m[3], tp_rank, tp)
    return None


def _oss_expert_shard(p, get, spec, e, fc, kind, tp_rank, tp) -> torch.Tensor:
    lo, hi = _rows(spec.moe_ffn_hidden_size, tp_rank, tp)
    t = get(p + "mlp.experts." + _OSS_HF[(fc, kind)], rows=(e, e + 1))[0]
    if fc == "linear_fc1":  # (H, 2I) / (2I,): gate and up interleaved
        gate, up = t[..., 0::2], t[..., 1::2]
        if kind == "weight":
            gate, up = gate.t(), up.t()  # (I, H)
        return torch.cat([gate[lo:hi], up[lo:hi]]).contiguous()
    return t.t()[:, lo:hi].contiguous() if kind == "weight" else t  # down (I, H) -> (H, I); its bias replicated


def hf_from_megatron(rest: str, p: str, tensor: torch.Tensor, spec: ModelSpec,
                     expert_offset: int) -> list[tuple[str, torch.Tensor]] | None:
    """HF tensors of one full (TP=1) megatron layer tensor, or None. gpt_oss experts: per-expert names (above)."""
    if spec.mla is not None and rest in _MLA:
        return [(p + "self_attn." + _MLA[rest], tensor)]
    if spec.mla is not None and rest in _MLA_NORMS:
        return [(p + "self_attn." + _MLA_NORMS[rest], tensor)]
    simple = {"self_attention.linear_proj.bias": "self_attn.o_proj.bias",
              "self_attention.core_attention.softmax_offset": "self_attn.sinks",
              "mlp.router.weight": _router(spec) + ".weight", "mlp.router.bias": "mlp.router.bias",
              "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias"}
    if rest in simple:
        return [(p + simple[rest], tensor)]
    if rest.startswith("mlp.shared_experts."):
        q = p + "mlp.shared_experts."
        if rest.endswith("linear_fc1.weight"):
            gate, up = torch.chunk(tensor, 2, dim=0)
            return [(q + "gate_proj.weight", gate), (q + "up_proj.weight", up)]
        return [(q + "down_proj.weight", tensor)]
    m = _OSS_EXPERT.match(rest) if spec.model_type == "gpt_oss" else None
    if m:
        e, fc, kind = expert_offset + int(m[1]), m[2], m[3]
        if fc == "linear_fc1":
            gate, up = torch.chunk(tensor, 2, dim=0)  # (I, H) each, or (I,)
            t = torch.stack([gate, up], dim=1).flatten(0, 1)  # interleaved rows: (2I, H) / (2I,)
            t = t.t() if kind == "weight" else t  # (H, 2I)
        else:
            t = tensor.t() if kind == "weight" else tensor  # (I, H) / (H,)
        return [(f"{p}mlp.experts.{e}.{_OSS_HF[(fc, kind)]}", t.contiguous())]
    return None


_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_up_proj|gate_up_proj_bias|down_proj|"
                         r"down_proj_bias)$")


def fuse_experts(items: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec,
                 num_experts: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt_oss: stack the per-expert tensors of ``hf_from_megatron`` into HF's ``(E, ...)`` tensors, each yielded once
    all ``num_experts`` (default: every expert) of it have passed; every other tensor passes through at once."""
    n = num_experts or spec.num_experts
    held: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in items:
        m = _PER_EXPERT.match(name) if spec.model_type == "gpt_oss" else None
        if not m:
            yield name, t
            continue
        full = f"{m[1]}.{m[3]}"
        held.setdefault(full, {})[int(m[2])] = t
        if len(held[full]) == n:
            parts = held.pop(full)
            yield full, torch.stack([parts[e] for e in sorted(parts)])
    if held:
        raise ValueError(f"experts missing from {sorted(held)[:3]}: got {[len(v) for v in held.values()][:3]} of {n}")


def layer_hf_names(spec: ModelSpec, layer: int) -> set[str]:
    """Every HF tensor of decoder layer ``layer`` of a family model."""
    p = f"model.layers.{layer}."
    names = {p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "self_attn.o_proj.weight"}
    if spec.mla is not None:
        q = ("q_a_proj", "q_a_layernorm", "q_b_proj") if spec.mla["q_lora_rank"] else ("q_proj",)
        names |= {f"{p}self_attn.{n}.weight" for n in q + ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")}
    else:
        names |= {f"{p}self_attn.{n}_proj.{k}" for n in "qkv" for k in (("weight", "bias") if spec.qkv_bias
                                                                         else ("weight",))}
        names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"} if spec.qk_norm else set()
        names |= {p + "self_attn.o_proj.bias", p + "self_attn.sinks"} if spec.model_type == "gpt_oss" else set()
    if layer < spec.dense_layers:
        return names | {f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    if spec.model_type == "gpt_oss":
        experts = ("gate_up_proj", "down_proj") if not spec.mxfp4 else \
            tuple(f"{n}_{k}" for n in ("gate_up_proj", "down_proj") for k in ("blocks", "scales"))
        return names | {p + "mlp.router.weight", p + "mlp.router.bias"} | \
            {f"{p}mlp.experts.{n}" for n in experts + ("gate_up_proj_bias", "down_proj_bias")}
    names |= {p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"}
    names |= {f"{p}mlp.experts.{e}.{n}_proj.weight" for e in range(spec.num_experts) for n in ("gate", "up", "down")}
    if spec.shared_expert_size:
        names |= {f"{p}mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")}
    return names


def is_mtp_name(name: str, spec: ModelSpec) -> bool:
    """A tensor of DeepSeek's / GLM's MTP layers (``model.layers.N..N+m-1``, N = num_hidden_layers) or of
    Qwen3-Next's / Qwen3.5's (``mtp.*``): transformers ignores them; the converter keeps them beside the checkpoint
    and every export writes them back (``rlhf.models.mtp``)."""
    if spec.linear_attention is not None:
        return name.startswith("mtp.")
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return bool(spec.mtp_layers and m and spec.num_layers <= int(m[1]) < spec.num_layers + spec.mtp_layers)


def mapped_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of every megatron buffer that is an HF tensor (``BUFFERS``)."""
    return [(n, b) for n, b in model.named_buffers() if n.endswith(BUFFERS)]


def iter_hf_buffers(model: torch.nn.Module, mesh, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every mapped buffer of the whole model (DeepSeek's / GLM's expert-bias correction, fp32),
    on every rank: each pipeline stage's, gathered over the PP group (a collective there). Replicated over TP and EP."""
    if spec.router is None or not spec.router["expert_bias"]:
        return
    offset = mesh.pp_rank * (spec.num_layers // mesh.pp)
    mine = {}
    for name, b in mapped_buffers(model):
        m = re.match(r"^decoder\.layers\.(\d+)\.mlp\.router\.expert_bias$", name)
        assert m, name
        mine[f"model.layers.{int(m[1]) + offset}.mlp.gate.e_score_correction_bias"] = b.detach().float().cpu()
    stages = [mine]
    if mesh.pp > 1:
        import torch.distributed as dist

        stages = [None] * mesh.pp
        dist.all_gather_object(stages, mine, group=mesh.pp_group)
    for stage in stages:
        yield from sorted(stage.items())
