"""HF <-> Megatron parameter mapping for the Llama family (llama, qwen2, qwen3, mistral share one layout; qwen3
adds ``q_norm``/``k_norm``; mixtral and qwen3_moe replace the MLP by a router and experts, each expert laid out
like a dense MLP: ``mlp.router.weight`` <- ``gate.weight``, ``mlp.experts.local_experts.j.linear_fc1`` <-
``[gate; up]`` of the expert's TP shard, ``linear_fc2`` <- ``down``; under TE's grouped GEMM the same tensors are
``mlp.experts.linear_fc1.weightJ`` / ``linear_fc2.weightJ``).

Megatron-side names are those of a model state dict (local layer index, this rank's TP shard), under the local
layer spec or Transformer Engine's (whose fused norms are ``linear_qkv.layer_norm_weight`` and
``linear_fc1.layer_norm_weight``; TE's ``_extra_state`` is never a parameter). The two directions are pure
functions:

* ``megatron_shard_from_hf(name, ...)`` builds one rank's shard of one megatron parameter from HF tensors, read
  lazily through ``get(hf_name, rows=None, cols=None)`` so that a rank never loads more than it needs;
* ``hf_from_megatron(name, tensor, ...)`` turns one full (TP-gathered, TP=1) megatron parameter into HF tensors.

Layouts (megatron-core 0.16.1): ``linear_qkv`` stacks, per KV group, ``[q heads of the group | k | v]``
and TP splits whole groups (when TP exceeds the KV groups, megatron replicates them: ``TP / groups`` ranks
split one group's rows evenly); ``linear_fc1`` is ``[gate ; up]`` per TP shard. Unknown names raise.
"""
from __future__ import annotations

import logging
import re
from typing import Callable, Iterator

import torch

from rlhf.models.spec import ModelSpec

log = logging.getLogger(__name__)

# get(hf_name, rows) -> tensor; rows is a (start, stop) slice of dim 0 or None for the whole tensor.
HFGetter = Callable[..., torch.Tensor]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

_LAYER_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    # the Transformer Engine layer spec fuses each norm into the linear after it (--transformer_impl)
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    # qwen3: RMSNorm over head_dim on each query / key head, replicated over TP
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


def hf_head_name(spec: ModelSpec) -> str:
    """The head's tensor in the HF folder read: ``score.weight`` (ours, HF), ``value_head.weight`` or another
    ``value_head_prefix`` (OpenRLHF's reward/critic models, ``rlhf.models.reward_format``), ``lm_head.weight``."""
    return f"{spec.extra.get('score_head', 'score')}.weight" if spec.is_seq_cls else "lm_head.weight"


def _shard_rows(n: int, tp_rank: int, tp: int) -> tuple[int, int]:
    assert n % tp == 0, (n, tp)
    size = n // tp
    return tp_rank * size, (tp_rank + 1) * size


# An expert's linears: megatron's SequentialMLP (local spec) ``local_experts.J.linear_fc1.weight``, or TE's grouped
# GEMM (TEGroupedMLP, one GroupedLinear per projection) ``linear_fc1.weightJ``; J is the local expert index.
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(?P<j>\d+)\.(?P<fc>linear_fc[12])\.(?:weight|bias)|"
                     r"(?P<fc_g>linear_fc[12])\.weight(?P<j_g>\d+))$")


def _expert(rest: str) -> tuple[int, str] | None:
    """(local expert index, ``linear_fc1`` | ``linear_fc2``) of an expert parameter name, else None."""
    m = _EXPERT.match(rest)
    if not m:
        return None
    return (int(m["j"]), m["fc"]) if m["j"] is not None else (int(m["j_g"]), m["fc_g"])


def is_expert_param(name: str) -> bool:
    """Whether megatron parameter ``name`` (``decoder.layers.L.``-prefixed or not) is an expert's linear."""
    return _EXPERT.match(_LAYER.sub(r"\2", name)) is not None


def is_glu_fc1(name: str) -> bool:
    """``linear_fc1`` of the dense MLP or of an expert (grouped: ``weightJ``): each TP shard is ``[gate; up]``."""
    return re.search(r"linear_fc1\.(weight\d*|bias)$", name) is not None


def _moe_prefix(spec: ModelSpec) -> str:
    return "block_sparse_moe" if spec.model_type == "mixtral" else "mlp"


def hf_expert_names(spec: ModelSpec, layer: int, expert: int) -> tuple[str, str, str]:
    """HF (gate, up, down) weight names of one expert: mixtral's ``w1, w3, w2``, qwen3_moe's ``*_proj``."""
    p = f"model.layers.{layer}.{_moe_prefix(spec)}.experts.{expert}."
    if spec.model_type == "mixtral":
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def hf_router_name(spec: ModelSpec, layer: int) -> str:
    return f"model.layers.{layer}.{_moe_prefix(spec)}.gate.weight"


def megatron_shard_from_hf(name: str, get: HFGetter, spec: ModelSpec, *, tp_rank: int, tp: int, layer_offset: int,
                           padded_vocab: int, ep_rank: int = 0, ep: int = 1,
                           etp: tuple[int, int] | None = None) -> torch.Tensor:
    """This rank's shard of megatron parameter ``name`` (local naming), from HF tensors. MoE: local expert ``j``
    of EP rank ``r`` is global expert ``r * num_experts / ep + j``; experts are TP-sharded like a dense MLP, over
    the expert-TP group: ``etp`` (its rank, its size), default ``(tp_rank, tp)`` (1 for biased experts: whole)."""
    if etp is not None and is_expert_param(name):
        tp_rank, tp = etp
    h, d = spec.hidden_size, spec.head_dim
    if name.startswith("visual."):  # a vision-language model's tower (rlhf.models.vlm): HF's own module, replicated
        return get(name)
    if name == "embedding.word_embeddings.weight" or (name == "output_layer.weight" and not spec.is_seq_cls):
        hf_name = "model.embed_tokens.weight" if (name.startswith("embedding") or spec.tie_word_embeddings) \
            else "lm_head.weight"
        lo, hi = _shard_rows(padded_vocab, tp_rank, tp)
        real_hi = min(hi, spec.vocab_size)
        out = torch.zeros(hi - lo, h, dtype=_dtype_of(get, hf_name))
        if real_hi > lo:
            out[: real_hi - lo] = get(hf_name, rows=(lo, real_hi))
        return out
    if name == "output_layer.weight":  # scalar head, replicated over TP
        return get(hf_head_name(spec))
    if name == "decoder.final_layernorm.weight":
        return get("model.norm.weight")
    m = _LAYER.match(name)
    if not m:
        raise ValueError(f"unknown megatron parameter {name!r}")
    layer, rest = int(m.group(1)) + layer_offset, m.group(2)
    p = f"model.layers.{layer}."
    if spec.mla is not None or spec.router is not None:  # deepseek_v3, glm4_moe, gpt_oss (rlhf.models.hf_families)
        from rlhf.models import hf_families

        out = hf_families.shard_from_hf(rest, p, get, spec, tp_rank=tp_rank, tp=tp,
                                        expert_offset=ep_rank * (spec.num_experts // ep))
        if out is not None:
            return out
    if spec.linear_attention is not None:  # qwen3_next (rlhf.models.hf_hybrid)
        from rlhf.models import hf_hybrid

        out = hf_hybrid.shard_from_hf(rest, p, get, spec, tp_rank=tp_rank, tp=tp)
        if out is not None:
            return out
    if rest in _LAYER_SIMPLE:
        return get(p + _LAYER_SIMPLE[rest])
    groups, per_group = spec.num_kv_heads, spec.num_attention_heads // spec.num_kv_heads
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        suffix = rest.rsplit(".", 1)[1]
        if groups < tp:  # KV heads replicated: tp / groups ranks share a group, each holds a slice of its rows
            ranks_per_group = tp // groups
            fused = _qkv_groups(get, p, suffix, tp_rank // ranks_per_group, 1, per_group, d)
            lo, hi = _shard_rows(fused.shape[0], tp_rank % ranks_per_group, ranks_per_group)
            return fused[lo:hi].contiguous()
        g_lo, g_hi = _shard_rows(groups, tp_rank, tp)
        return _qkv_groups(get, p, suffix, g_lo, g_hi - g_lo, per_group, d)
    if rest == "self_attention.linear_proj.weight":
        lo, hi = _shard_rows(spec.num_attention_heads * d, tp_rank, tp)
        return get(p + "self_attn.o_proj.weight")[:, lo:hi].contiguous()
    if rest == "mlp.linear_fc1.weight":
        lo, hi = _shard_rows(spec.intermediate_size, tp_rank, tp)
        return torch.cat([get(p + "mlp.gate_proj.weight", rows=(lo, hi)), get(p + "mlp.up_proj.weight", rows=(lo, hi))])
    if rest == "mlp.linear_fc2.weight":
        lo, hi = _shard_rows(spec.intermediate_size, tp_rank, tp)
        return get(p + "mlp.down_proj.weight")[:, lo:hi].contiguous()
    if spec.num_experts and rest == "mlp.router.weight":
        return get(hf_router_name(spec, layer))
    e = _expert(rest) if spec.num_experts else None
    if e:
        gate, up, down = hf_expert_names(spec, layer, ep_rank * (spec.num_experts // ep) + e[0])
        lo, hi = _shard_rows(spec.moe_ffn_hidden_size, tp_rank, tp)
        if e[1] == "linear_fc1":
            return torch.cat([get(gate, rows=(lo, hi)), get(up, rows=(lo, hi))])
        return get(down)[:, lo:hi].contiguous()
    raise ValueError(f"unknown megatron parameter {name!r}")


def _qkv_groups(get: HFGetter, p: str, suffix: str, first: int, n: int, per_group: int, d: int) -> torch.Tensor:
    """Megatron's fused rows ``[q heads | k | v]`` of KV groups ``first .. first + n - 1``."""
    q = get(p + f"self_attn.q_proj.{suffix}", rows=(first * per_group * d, (first + n) * per_group * d))
    k = get(p + f"self_attn.k_proj.{suffix}", rows=(first * d, (first + n) * d))
    v = get(p + f"self_attn.v_proj.{suffix}", rows=(first * d, (first + n) * d))
    q = q.reshape(n, per_group * d, *q.shape[1:])
    k = k.reshape(n, d, *k.shape[1:])
    v = v.reshape(n, d, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(n * (per_group + 2) * d, *q.shape[2:])


def _dtype_of(get: HFGetter, hf_name: str) -> torch.dtype:
    return get(hf_name, rows=(0, 1)).dtype


def hf_from_megatron(name: str, tensor: torch.Tensor, spec: ModelSpec, *, layer_offset: int = 0,
                     expert_offset: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors from one full (TP=1) megatron parameter. Padded vocab rows are dropped. MoE: local expert ``j``
    is global expert ``expert_offset + j`` (``ep_rank * num_experts / ep``)."""
    d = spec.head_dim
    if name.startswith("visual."):  # a vision-language model's tower: HF's names (rlhf.models.vlm)
        yield name, tensor
        return
    if name == "embedding.word_embeddings.weight":
        yield "model.embed_tokens.weight", tensor[: spec.vocab_size]
        return
    if name == "output_layer.weight":
        if spec.is_seq_cls:
            yield "score.weight", tensor
        elif not spec.tie_word_embeddings:
            yield "lm_head.weight", tensor[: spec.vocab_size]
        return
    if name == "decoder.final_layernorm.weight":
        yield "model.norm.weight", tensor
        return
    m = _LAYER.match(name)
    if not m:
        raise ValueError(f"unknown megatron parameter {name!r}")
    layer, rest = int(m.group(1)) + layer_offset, m.group(2)
    p = f"model.layers.{layer}."
    if spec.mla is not None or spec.router is not None:  # deepseek_v3, glm4_moe, gpt_oss (rlhf.models.hf_families)
        from rlhf.models import hf_families

        out = hf_families.hf_from_megatron(rest, p, tensor, spec, expert_offset)
        if out is not None:
            yield from out
            return
    if spec.linear_attention is not None:  # qwen3_next (rlhf.models.hf_hybrid)
        from rlhf.models import hf_hybrid

        out = hf_hybrid.hf_from_megatron(rest, p, tensor, spec)
        if out is not None:
            yield from out
            return
    if rest in _LAYER_SIMPLE:
        yield p + _LAYER_SIMPLE[rest], tensor
        return
    groups, per_group = spec.num_kv_heads, spec.num_attention_heads // spec.num_kv_heads
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        suffix = rest.rsplit(".", 1)[1]
        t = tensor.reshape(groups, (per_group + 2) * d, *tensor.shape[1:])
        q, k, v = torch.split(t, [per_group * d, d, d], dim=1)
        yield p + f"self_attn.q_proj.{suffix}", q.reshape(groups * per_group * d, *tensor.shape[1:])
        yield p + f"self_attn.k_proj.{suffix}", k.reshape(groups * d, *tensor.shape[1:])
        yield p + f"self_attn.v_proj.{suffix}", v.reshape(groups * d, *tensor.shape[1:])
        return
    if rest == "self_attention.linear_proj.weight":
        yield p + "self_attn.o_proj.weight", tensor
        return
    if rest == "mlp.linear_fc1.weight":
        gate, up = torch.chunk(tensor, 2, dim=0)
        yield p + "mlp.gate_proj.weight", gate
        yield p + "mlp.up_proj.weight", up
        return
    if rest == "mlp.linear_fc2.weight":
        yield p + "mlp.down_proj.weight", tensor
        return
    if spec.num_experts and rest == "mlp.router.weight":
        yield hf_router_name(spec, layer), tensor
        return
    e = _expert(rest) if spec.num_experts else None
    if e:
        gate, up, down = hf_expert_names(spec, layer, expert_offset + e[0])
        if e[1] == "linear_fc1":
            g, u = torch.chunk(tensor, 2, dim=0)
            yield gate, g
            yield up, u
        else:
            yield down, tensor
        return
    raise ValueError(f"unknown megatron parameter {name!r}")


def expected_hf_names(spec: ModelSpec) -> set[str]:
    """Every HF tensor name a checkpoint of this spec must contain (and may contain, nothing else)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if spec.is_seq_cls:
        names.add(hf_head_name(spec))
    elif not spec.tie_word_embeddings:
        names.add("lm_head.weight")
    if spec.mla is not None or spec.router is not None:
        from rlhf.models.hf_families import layer_hf_names

        return names.union(*(layer_hf_names(spec, i) for i in range(spec.num_layers)))
    if spec.vision is not None:
        from rlhf.models.vlm import vision_hf_names

        names |= vision_hf_names(spec)
    if spec.linear_attention is not None:
        from rlhf.models.hf_hybrid import layer_hf_names as hybrid_names

        return names.union(*(hybrid_names(spec, i) for i in range(spec.num_layers)))
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight",
                  p + "self_attn.o_proj.weight"}
        if spec.num_experts:
            names.add(hf_router_name(spec, i))
            for e in range(spec.num_experts):
                names |= set(hf_expert_names(spec, i, e))
        else:
            names |= {p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"}
        if spec.qkv_bias:
            names |= {p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"}
        if spec.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


_MTP_LOGGED: set[str] = set()


def check_hf_names(found: set[str], spec: ModelSpec, source: str) -> None:
    """Raise on any HF tensor we would not consume, or any we need and do not find."""
    expected = expected_hf_names(spec)
    # A tied model may still carry an lm_head copy (some exporters write it); it must then equal the embedding.
    optional = {"lm_head.weight"} if (spec.tie_word_embeddings and not spec.is_seq_cls) else set()
    optional |= {f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(spec.num_layers)}
    if spec.mtp_layers:  # DeepSeek's / GLM's MTP layers: kept beside the checkpoint (rlhf.models.mtp)
        from rlhf.models.hf_families import is_mtp_name

        optional |= {n for n in found if is_mtp_name(n, spec)}
    mtp = {n for n in found if n.startswith("mtp.")} if spec.linear_attention is not None else set()
    if mtp:  # Qwen3-Next's / Qwen3.5's MTP layer: not trained, as transformers ignores it (^mtp.*); kept verbatim
        optional |= mtp
        if source not in _MTP_LOGGED:
            _MTP_LOGGED.add(source)
            log.info("%s: its %d mtp.* tensors (the multi-token-prediction layer) are not trained; every export "
                     "writes them back as read", source, len(mtp))
    unknown = sorted(found - expected - optional)
    if unknown:
        raise ValueError(f"{source}: unknown checkpoint key(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    missing = sorted(expected - found)
    if missing:
        raise ValueError(f"{source}: missing checkpoint key(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def full_from_tp_shards(name: str, shards: list[torch.Tensor], partition_dim: int | None,
                        spec: ModelSpec | None = None) -> torch.Tensor:
    """Rebuild the TP=1 tensor of megatron parameter ``name`` from its TP shards (rank order).

    Column-parallel shards concatenate along dim 0, except ``linear_fc1`` (dense or expert) whose shards are each
    ``[gate; up]``, and (with ``spec``) qwen3_next's DeltaNet ``in_proj`` / ``conv1d``, whose shards stack several
    parts (``rlhf.models.hf_hybrid.tp_sections``); row-parallel along dim 1; replicated parameters
    (``partition_dim`` None) are taken from rank 0.
    """
    if partition_dim is None or len(shards) == 1:
        return shards[0]
    if spec is not None and spec.linear_attention is not None:
        from rlhf.models.hf_hybrid import tp_sections

        sections = tp_sections(_LAYER.sub(r"\2", name), spec)
        if sections is not None:
            parts = [torch.split(s, [n // len(shards) for n in sections], dim=0) for s in shards]
            return torch.cat([part[i] for i in range(len(sections)) for part in parts], dim=0)
    if is_glu_fc1(name):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=partition_dim)


def tp_partition_dim(param: torch.Tensor) -> int | None:
    """Megatron marks TP-sharded parameters with ``tensor_model_parallel`` and ``partition_dim``."""
    return int(param.partition_dim) if getattr(param, "tensor_model_parallel", False) else None
