"""Actor weights -> generation engine, after every update: a documented pipeline, bucketed and versioned.

    plan   (once)  every rank learns every pipeline stage's parameter list: name, local shape, TP partition dim
    bucket         parameters of one stage, in order, grouped until the full (TP-gathered) size reaches
                   ``bucket_bytes``; MoE experts in buckets of their own
    gather         the stage's ranks all-gather the bucket over TP in ONE collective (flattened); an expert
                   bucket then over EP too (each EP rank holds other experts under the same local names); at
                   TP = PP = EP = 1 the parameters go out as they are (the engine copies them), no flat copy
    broadcast      with PP > 1 the stage broadcasts the gathered bucket over the PP group, so every rank
                   (hence every vLLM worker, whatever vLLM's own TP) holds full tensors
    convert        megatron names/layouts -> HF names/layouts (``rlhf.models.hf_llama.hf_from_megatron``); a LoRA
                   actor sends merged weights (``W + alpha/r B A``, per TP shard) and never its adapters, or with
                   ``--lora_sync adapter`` the base once and then its adapters alone (``rlhf.rollout.lora_sync``)
    load           the engine consumes the HF tensors as an iterator (vLLM ``reload_weights``), bucket after
                   bucket; a bucket is freed before the next is gathered, so the extra memory is one bucket
    version        a counter bumped after each completed sync; the engine remembers which version it serves

Every rank runs the same sequence of collectives, in the same order, whatever its stage.

TP-local (no gather at all): when vLLM shards the actor exactly as megatron does (vLLM TP = megatron TP on the same
ranks, PP 1, KV heads divisible by TP, no experts, and vLLM's vocab padding (to 64) giving megatron's padded
vocab), vLLM rank r reads from each full-shape tensor only the rows / columns that megatron rank r holds. Each
rank then sends full-shape HF tensors of which only its own slice is written (``torch.empty`` elsewhere: those
pages are never touched), and the all-gather disappears.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from rlhf.models.hf_llama import full_from_tp_shards, hf_from_megatron, is_expert_param, is_glu_fc1, tp_partition_dim
from rlhf.models.lora import is_lora_param, lora_modules, merged_weight
from rlhf.models.spec import padded_vocab_size

log = logging.getLogger(__name__)


@dataclass
class _Param:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    partition_dim: int | None

    @property
    def expert(self) -> bool:
        return is_expert_param(self.name)


class WeightSync:
    """Streams the actor's weights (megatron TP/PP shards on every rank) as full HF tensors."""

    def __init__(self, actor, mesh, bucket_bytes: int = 512 << 20, spec=None):
        """``spec``: the ``ModelSpec`` whose HF names the tensors get (default the engine's own; the HF export
        passes the exported config's, e.g. a sequence-classification head)."""
        self.actor, self.mesh, self.bucket_bytes = actor, mesh, int(bucket_bytes)
        self.spec = spec if spec is not None else actor.spec
        self.version = 0
        self.last_stats: dict[str, float] = {}
        local = [(n, tuple(p.shape), str(p.dtype).replace("torch.", ""), tp_partition_dim(p))
                 for n, p in actor.model.named_parameters() if not is_lora_param(n)]
        self.adapted = {n + ".weight": m for n, m in lora_modules(actor.model).items()}
        if mesh.pp > 1:
            stages: list = [None] * mesh.pp
            dist.all_gather_object(stages, local, group=mesh.pp_group)
        else:
            stages = [local]
        self.stages = [[_Param(n, s, getattr(torch, d), pd) for n, s, d, pd in st] for st in stages]
        n_layers = actor.spec.num_layers
        self.layer_offsets = [s * (n_layers // mesh.pp) for s in range(mesh.pp)]
        from megatron.core import parallel_state as ps

        self.etp_group = ps.get_expert_tensor_parallel_group() if actor.spec.num_experts else mesh.tp_group
        self.etp = self.etp_group.size() if actor.spec.num_experts else mesh.tp
        """the experts' TP: the mesh's TP, or 1 for biased experts (``initialize_mesh(etp=...)``), held whole"""
        self.buckets = [(s, b) for s, params in enumerate(self.stages)
                        for kind in (False, True) for b in self._bucketize([p for p in params if p.expert == kind])]
        self.experts_per_rank = actor.spec.num_experts // mesh.ep if mesh.ep > 1 else 0
        self._logged_local = False
        self.merge = True
        """LoRA-adapted weights go out merged; False while an adapter-syncing engine gets its base"""
        self.adapter_folders = None

    def _full_bytes(self, p: _Param) -> int:
        n = 1
        for d in p.shape:
            n *= d
        return n * ((self.etp if p.expert else self.mesh.tp) if p.partition_dim is not None else 1) * p.dtype.itemsize

    def _weight(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """This rank's tensor of parameter ``name`` as the engine gets it: LoRA-merged where adapted."""
        return merged_weight(self.adapted[name]) if self.merge and name in self.adapted else param.detach()

    def _bucketize(self, params: list[_Param]) -> list[list[_Param]]:
        buckets, cur, size = [], [], 0
        for p in params:
            if cur and size + self._full_bytes(p) > self.bucket_bytes:
                buckets.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += self._full_bytes(p)
        if cur:
            buckets.append(cur)
        return buckets

    def _gather_bucket(self, stage: int, params: list[_Param]) -> list[tuple[str, torch.Tensor, int]]:
        """(name, full TP=1 megatron tensor, expert offset) of one bucket, on every rank; an expert bucket
        yields each parameter once per EP rank, with that rank's first global expert as offset."""
        mesh = self.mesh
        ep = mesh.ep if params[0].expert and mesh.ep > 1 else 1
        tp, tp_group = (self.etp, self.etp_group) if params[0].expert else (mesh.tp, mesh.tp_group)
        dtype = params[0].dtype
        assert all(p.dtype == dtype for p in params), "one dtype per model"
        named = dict(self.actor.model.named_parameters())

        def weight(p: _Param) -> torch.Tensor:
            return self._weight(p.name, named[p.name])

        if tp == 1 and mesh.pp == 1 and ep == 1:  # every tensor is here whole: no flat copy, no collective
            return [(p.name, weight(p), 0) for p in params]
        numels = [int(torch.Size(p.shape).numel()) for p in params]
        total = sum(numels)
        mine = mesh.pp_rank == stage
        if mine:
            flat = torch.cat([weight(p).reshape(-1) for p in params])  # (total,)
            if tp > 1:
                parts = torch.empty(tp * total, dtype=dtype, device=flat.device)
                dist.all_gather_into_tensor(parts, flat, group=tp_group)
            else:
                parts = flat
            if ep > 1:
                every = torch.empty(ep * parts.numel(), dtype=dtype, device=parts.device)
                dist.all_gather_into_tensor(every, parts, group=mesh.ep_group)
                parts = every
        else:
            parts = torch.empty(ep * tp * total, dtype=dtype, device=mesh.device)
        if mesh.pp > 1:
            dist.broadcast(parts, src=dist.get_global_rank(mesh.pp_group, stage), group=mesh.pp_group)
        out = []
        for e, of_rank in enumerate(parts.view(ep, tp, total)):  # (tp, total) per EP rank
            off = 0
            for p, n in zip(params, numels):
                shards = [of_rank[r, off:off + n].view(p.shape) for r in range(tp)]
                full = full_from_tp_shards(p.name, shards, p.partition_dim, self.spec)  # (DeltaNet: its sections)
                out.append((p.name, full, e * self.experts_per_rank))
                off += n
        return out

    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full tensor) for the whole actor, bucket by bucket (a collective per bucket)."""
        t0, nbytes = time.perf_counter(), 0
        from rlhf.models.hf_families import fuse_experts, iter_hf_buffers

        for hf_name, hf_tensor in fuse_experts(self._iter_buckets(), self.spec):  # gpt_oss: a layer's experts fused
            nbytes += hf_tensor.numel() * hf_tensor.element_size()
            yield hf_name, hf_tensor
        yield from iter_hf_buffers(self.actor.model, self.mesh, self.spec)  # DeepSeek's expert-bias correction
        self.last_stats = {"weight_sync/gather_s": time.perf_counter() - t0, "weight_sync/bytes": float(nbytes),
                           "weight_sync/buckets": float(len(self.buckets))}

    def _iter_buckets(self) -> Iterator[tuple[str, torch.Tensor]]:
        for stage, params in self.buckets:
            full = self._gather_bucket(stage, params)
            for name, tensor, expert_offset in full:
                yield from hf_from_megatron(name, tensor, self.spec, expert_offset=expert_offset,
                                            layer_offset=self.layer_offsets[stage])
            del full

    def tp_local(self, engine) -> bool:
        """Whether ``engine`` reads exactly this rank's TP shard of every tensor (see the module doc)."""
        spec, mesh = self.actor.spec, self.mesh
        vllm_padded = padded_vocab_size(spec.vocab_size, 64)  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
        return (getattr(engine, "name", None) == "vllm" and getattr(engine, "tp", 0) == mesh.tp > 1 and mesh.pp == 1
                and not spec.num_experts and spec.num_kv_heads % mesh.tp == 0
                and vllm_padded == self.actor.padded_vocab and mesh.rank % mesh.tp == mesh.tp_rank)

    def iter_local_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full-shape tensor holding this rank's TP slice) for the whole actor; no collective."""
        t0, nbytes = time.perf_counter(), 0
        mesh = self.mesh
        for name, param in self.actor.model.named_parameters():
            if is_lora_param(name):
                continue
            local = self._weight(name, param)
            dim = tp_partition_dim(param)
            full = local if dim is None else _place_shard(name, local, dim, mesh.tp_rank, mesh.tp)
            nbytes += local.numel() * local.element_size()  # the bytes this rank provides
            yield from hf_from_megatron(name, full, self.actor.spec)
        self.last_stats = {"weight_sync/gather_s": time.perf_counter() - t0, "weight_sync/bytes": float(nbytes),
                           "weight_sync/buckets": 0.0}

    def sync(self, engine) -> dict[str, float]:
        """Push the current actor weights into ``engine`` (``engine.load_weights(iterator, version)``); to an engine
        that serves adapters (``engine.lora_adapter``) the unmerged base when it has none, then the adapters."""
        from rlhf.distributed.faults import fault_point

        t0 = time.perf_counter()
        self.version += 1
        fault_point("weight_sync")
        adapter = getattr(engine, "lora_adapter", False)
        if adapter and not self.adapted:
            raise RuntimeError("the engine serves LoRA adapters (--lora_sync adapter) but the actor has none")
        self.last_stats = {"weight_sync/gather_s": 0.0, "weight_sync/bytes": 0.0, "weight_sync/buckets": 0.0}
        if not adapter or engine.needs_base:
            local = self.tp_local(engine)
            if local and not self._logged_local and self.mesh.is_rank0:
                log.info("weight sync: TP-local (vLLM TP %d shards like megatron's): no gather", self.mesh.tp)
            self._logged_local = self._logged_local or local
            self.merge = not adapter
            try:
                engine.load_weights(self.iter_local_hf_tensors() if local else self.iter_hf_tensors(), self.version)
            finally:
                self.merge = True
        stats = dict(self.last_stats)
        if adapter:
            stats.update(self._sync_adapter(engine))
        stats["weight_sync/seconds"] = time.perf_counter() - t0
        stats["weight_sync/version"] = float(self.version)
        log.debug("weight sync v%d: %.0f MB in %d buckets, %.3f s", self.version,
                  stats.get("weight_sync/bytes", 0) / 2**20, len(self.buckets), stats["weight_sync/seconds"])
        return stats

    def _sync_adapter(self, engine) -> dict[str, float]:
        """The actor's adapters as this version's PEFT folder, served by ``engine`` from now on."""
        from rlhf.rollout.lora_sync import AdapterFolders, gather_all_adapters

        t0 = time.perf_counter()
        if self.adapter_folders is None:
            self.adapter_folders = AdapterFolders(self.actor.lora, keep=getattr(engine, "lora_keep", 1))
        tensors = gather_all_adapters(self.actor.model, self.actor.spec, self.mesh)
        engine.load_adapter(self.adapter_folders.write(tensors, self.version), self.version)
        nbytes = float(sum(t.numel() * t.element_size() for t in tensors.values()))
        return {"weight_sync/adapter_bytes": nbytes, "weight_sync/adapter_s": time.perf_counter() - t0,
                "weight_sync/bytes": self.last_stats.get("weight_sync/bytes", 0.0) + nbytes}


def _place_shard(name: str, shard: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """A full-shape (TP = 1 layout) tensor with ``shard`` at rank ``rank``'s place and nothing written elsewhere;
    ``linear_fc1`` shards are ``[gate; up]``, so their halves go to the gate and the up blocks."""
    shape = list(shard.shape)
    shape[dim] *= tp
    full = torch.empty(shape, dtype=shard.dtype, device=shard.device)
    pieces = torch.chunk(shard, 2, dim=0) if is_glu_fc1(name) else (shard,)
    blocks = torch.chunk(full, len(pieces), dim=0)  # fc1: [gate; up] of the full tensor
    for piece, block in zip(pieces, blocks):
        n = piece.shape[dim]
        block.narrow(dim, rank * n, n).copy_(piece)
    return full


def engine_layout(hf: dict[str, torch.Tensor], spec, tp: int, rank: int, vocab_pad: int = 64
                  ) -> dict[str, torch.Tensor]:
    """The tensors vLLM rank ``rank`` of TP ``tp`` should hold for the full HF tensors ``hf``, under the names
    ``rlhf.compat.vllm.read_engine_weights`` reads (a dense Llama-style model): q/k/v stacked per rank (KV heads
    replicated when TP exceeds them), gate/up stacked, vocab rows padded to ``vocab_pad`` and split. Vocab shards
    hold only their real rows (vLLM's padding rows are not compared). A tied head is the embedding."""
    def cols(t: torch.Tensor) -> torch.Tensor:  # column-parallel: output rows split
        return t.chunk(tp, 0)[rank]

    def heads(t: torch.Tensor, n: int) -> torch.Tensor:  # n heads' rows; replicated when tp > n
        return cols(t) if n >= tp else t.chunk(n, 0)[rank * n // tp]

    per = -(-spec.vocab_size // vocab_pad) * vocab_pad // tp
    lo, hi = rank * per, min((rank + 1) * per, spec.vocab_size)
    out = {}
    head = hf["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"]
    for name, t in (("model.embed_tokens", hf["model.embed_tokens.weight"]), ("lm_head", head)):
        out[f"{name}.weight"] = out[f"{name}.weight.param"] = t[lo:hi]
    out["model.norm.weight"] = hf["model.norm.weight"]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([
            heads(hf[p + "self_attn.q_proj.weight"], spec.num_attention_heads),
            heads(hf[p + "self_attn.k_proj.weight"], spec.num_kv_heads),
            heads(hf[p + "self_attn.v_proj.weight"], spec.num_kv_heads)])
        out[p + "self_attn.o_proj.weight"] = hf[p + "self_attn.o_proj.weight"].chunk(tp, 1)[rank]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([cols(hf[p + "mlp.gate_proj.weight"]),
                                                        cols(hf[p + "mlp.up_proj.weight"])])
        out[p + "mlp.down_proj.weight"] = hf[p + "mlp.down_proj.weight"].chunk(tp, 1)[rank]
        for lin in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            out[p + lin + ".weight.param"] = out[p + lin + ".weight"]  # a reload keeps the parameter too
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + norm + ".weight"] = hf[p + norm + ".weight"]
    return out


def compare_engine_weights(engine: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict:
    """Bit-for-bit comparison of what an engine rank holds (``read_engine_weights``) with ``expected``
    (``engine_layout``), each expected tensor cast to the engine tensor's dtype as vLLM's loader casts (``copy_``).
    Returns {"compared": n, "mismatched": {name: (differing elements, max |diff|)}, "missing": [...],
    "unexpected": [...]} (names the engine holds that nothing expects, e.g. another architecture's)."""
    mismatched, missing = {}, []
    for name, want in expected.items():
        got = engine.get(name)
        if got is None:
            if not name.endswith(".param"):  # a parameter beside a packed copy may be empty: nothing to compare
                missing.append(name)
            continue
        got = got[: want.shape[0]] if name.endswith(("embed_tokens.weight", "lm_head.weight")) or \
            name.endswith(".weight.param") else got  # vocab shards: their real rows
        want = want.to(got.dtype)
        if got.shape != want.shape:
            mismatched[name] = (-1, float("inf"))
        elif not torch.equal(got, want):
            d = (got.float() - want.float()).abs()
            mismatched[name] = (int((d > 0).sum()), float(d.max()))
    return {"compared": sum(n in engine for n in expected), "mismatched": mismatched, "missing": missing,
            "unexpected": sorted(set(engine) - set(expected))}
