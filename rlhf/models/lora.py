"""LoRA adapters on megatron's tensor-parallel linears: ``y = W x + (alpha / r) * B (A x)``, with W frozen.

The adapters follow the base layer's TP split, so a TP=2 model computes exactly what the TP=1 model does:

* ``ColumnParallelLinear`` (``linear_qkv``, ``linear_fc1``): W is split on its output rows. A (r, in) is
  replicated over TP and B (out/tp, r) is split like W. ``h = A x`` is the same on every rank; its gradient is the
  sum of every rank's ``B_local^T dy_local``, so h passes through ``copy_to_tensor_model_parallel_region``
  (identity forward, all-reduce backward). That all-reduce is r numbers per token, and it leaves A's gradient
  identical on every TP rank, as megatron expects of a replicated parameter.
* ``RowParallelLinear`` (``linear_proj``, ``linear_fc2``): W is split on its input columns and megatron all-reduces
  the partial outputs. A (r, in/tp) is split like W and B (out, r) is replicated. The partial ``A_local x_local``
  is all-reduced (``reduce_from_tensor_model_parallel_region``, r numbers per token) before B, so B's gradient is
  again identical on every rank.

A is kaiming-uniform (as PEFT / ``nn.Linear``) from a generator seeded by the layer's global name: the same for
every TP and PP layout (a row-parallel A is drawn whole, then sliced). B starts at zero, so the adapted model
starts equal to the base. Adapters are plain parameters ``<linear>.lora_A`` / ``<linear>.lora_B`` of the base
module (its class is swapped for a subclass), so base parameter names, HF conversion and checkpoints keep working.

Merged weights (``W + scale * B @ A``) are TP-local: ``B_local @ A`` for a column layer and ``B @ A_local`` for a
row layer have exactly the base shard's shape. Weight sync to vLLM and the merged HF export use them; the
``--lora_export adapter`` export writes a PEFT folder (fused ``linear_qkv`` / ``linear_fc1`` are split into
q/k/v and gate/up: B's rows split like the base weight, A is shared).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from rlhf.config.part import Part, config_default, flag

log = logging.getLogger(__name__)

MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
HF_TO_MEGATRON = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
                  "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2",
                  "query_key_value": "linear_qkv", "dense": "linear_proj", "dense_h_to_4h": "linear_fc1",
                  "dense_4h_to_h": "linear_fc2"}
_FUSED_HF = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}
_TARGET_PATH = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention|mlp)\.(linear_qkv|linear_proj|linear_fc1|"
                          r"linear_fc2)$")
_LOGGED_PARTIAL = False


def resolve_targets(target_modules: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``--target_modules`` (megatron names, HF names or ``all-linear``) -> sorted megatron module names."""
    global _LOGGED_PARTIAL
    names = [n.strip() for n in (target_modules.split(",") if isinstance(target_modules, str) else target_modules)]
    names = [n for n in names if n]
    if not names:
        raise ValueError(f"--target_modules must name at least one module, got {target_modules!r}")
    out: set[str] = set()
    for n in names:
        if n in ("all-linear", "all_linear", "all"):
            out.update(MEGATRON_TARGETS)
        elif n in MEGATRON_TARGETS:
            out.add(n)
        elif n in HF_TO_MEGATRON:
            out.add(HF_TO_MEGATRON[n])
        else:
            raise ValueError(f"--target_modules: unknown module {n!r}; use megatron names {list(MEGATRON_TARGETS)}, "
                             f"HF names {sorted(k for k in HF_TO_MEGATRON if k.endswith('proj'))} or 'all-linear'")
    for fused, parts in _FUSED_HF.items():
        named = [p for p in parts if p in names]
        if named and len(named) < len(parts) and fused not in names and not _LOGGED_PARTIAL:
            log.info("--target_modules %s: megatron fuses %s into %s; the adapter covers the whole fused layer",
                     ",".join(named), "/".join(parts), fused)
            _LOGGED_PARTIAL = True
    return tuple(sorted(out))


@dataclass
class LoraConfig:
    """LoRA on the decoder's linear layers (OpenRLHF's ``--lora_rank/--lora_alpha/--target_modules/
    --lora_dropout``)."""

    rank: int = 8
    """r, the adapter's inner dimension (>= 1; rank 0 on the command line means full fine-tuning)."""
    alpha: float = 16.0
    """The update is scaled by ``alpha / rank``."""
    target_modules: tuple[str, ...] | str = "all-linear"
    """Megatron (``linear_qkv,linear_proj,linear_fc1,linear_fc2``) or HF (``q_proj,...,down_proj``) names, or
    ``all-linear``; resolved to megatron names here."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training."""
    seed: int = 42
    """Seeds A's initialisation (with each layer's global name)."""
    flag: str = "--lora_rank"
    """The flag that set ``rank``, for error messages (``--critic_lora_rank`` for PPO's critic)."""
    targets: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"{self.flag} must be a positive integer for LoRA, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"--lora_alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora_dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str):
            self.target_modules = tuple(n.strip() for n in self.target_modules.split(","))
        self.targets = resolve_targets(self.target_modules)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# ----------------------------------------------------------------------------------------------------- flags
@dataclass
class LoraPart(Part):
    """The LoRA flags (SFT, RM, DPO, KTO, PPO's actor; PPO's critic has its own rank, sharing the rest)."""

    GROUP = "LoRA"

    lora_rank: int = flag(type=int, help="LoRA rank r (0: full fine-tuning)", default=0)
    """(--lora_rank) 0: full fine-tuning"""
    lora_alpha: float = flag(type=float, help="LoRA scale alpha (the update is alpha/r * BA)",
                             default=config_default(LoraConfig, "alpha"))
    """(--lora_alpha)"""
    target_modules: str = flag(help="comma-separated: linear_qkv,linear_proj,linear_fc1,linear_fc2, the HF names "
                                    "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj, or all-linear",
                               default=config_default(LoraConfig, "target_modules"))
    """(--target_modules)"""
    lora_dropout: float = flag(type=float, default=config_default(LoraConfig, "dropout"))
    """(--lora_dropout)"""
    lora_export: str = flag(choices=["merged", "adapter"],
                            help="final export with LoRA: a merged HF model, or a PEFT adapter folder", default="merged")
    """(--lora_export) merged | adapter"""

    def config(self, seed: int, rank: int | None = None, flag: str = "--lora_rank") -> LoraConfig | None:
        """The ``LoraConfig`` of ``rank`` (default ``--lora_rank``; PPO's critic passes ``--critic_lora_rank``),
        None when it is 0. Raises ValueError naming ``flag``."""
        rank = self.lora_rank if rank is None else rank
        if rank is None or rank == 0:
            return None
        if rank < 0:
            raise ValueError(f"{flag} must be >= 0 (0: full fine-tuning), got {rank}")
        return LoraConfig(rank=rank, alpha=self.lora_alpha, target_modules=self.target_modules,
                          dropout=self.lora_dropout, seed=seed, flag=flag)

    def check(self) -> None:
        self.config(42)  # --lora_rank/--lora_alpha/--target_modules/--lora_dropout


add_lora_args = LoraPart.add_args


def lora_config_from_args(args: argparse.Namespace, rank_flag: str = "lora_rank") -> LoraConfig | None:
    """The LoRA config of ``--<rank_flag>`` from a parsed command line (``LoraPart.config``; None when it is 0).
    Raises ValueError naming the flag."""
    from dataclasses import fields

    part = LoraPart(**{f.name: getattr(args, f.name, f.default) for f in fields(LoraPart)})
    return part.config(getattr(args, "seed", 42), getattr(args, rank_flag, 0), f"--{rank_flag}")


# ---------------------------------------------------------------------------------------------- the layers
_CLASSES: dict[str, type] = {}


def _lora_classes() -> dict[str, type]:
    """Subclasses of megatron's parallel linears with the adapter path (built on first use: megatron import)."""
    if _CLASSES:
        return _CLASSES
    from megatron.core import tensor_parallel as mtp
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        reduce_from_tensor_model_parallel_region)
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    class LoraColumnParallelLinear(mtp.ColumnParallelLinear):
        def forward(self, input_, weight=None, runtime_gather_output=None):
            out, bias = super().forward(input_, weight, runtime_gather_output)  # (S, B, out/tp)
            h = F.linear(self.lora_dropout(input_), self.lora_A)  # (S, B, r), the same on every TP rank
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)  # backward: sum the partial dh
            return out + self.lora_scale * F.linear(h, self.lora_B), bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0, "bias": 0, "lora_B": 0},
                sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    class LoraRowParallelLinear(mtp.RowParallelLinear):
        def forward(self, input_):
            out, bias = super().forward(input_)  # (S, B, out), already all-reduced by megatron
            h = F.linear(self.lora_dropout(input_), self.lora_A)  # (S, B, r), this rank's partial sum
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
            return out + self.lora_scale * F.linear(h, self.lora_B), bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 1, "lora_A": 1},
                sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    _CLASSES.update(column=LoraColumnParallelLinear, row=LoraRowParallelLinear,
                    base_column=mtp.ColumnParallelLinear, base_row=mtp.RowParallelLinear)
    return _CLASSES


def is_lora_param(name: str) -> bool:
    return name.endswith(".lora_A") or name.endswith(".lora_B")


def is_lora_module(module: torch.nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "lora_scale")


def _global_layer(model: torch.nn.Module, local: int) -> int:
    layer = model.decoder.layers[local]
    return int(getattr(layer, "layer_number", local + 1)) - 1


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, *, tp: int, tp_rank: int,
               trainable: tuple[str, ...] = ()) -> dict[str, Any]:
    """Add adapters to ``cfg.targets`` in this rank's stage of ``model`` (weights already loaded), freeze every
    other parameter except those named in ``trainable`` (e.g. a value head), and return counts:
    ``{"modules", "lora_params", "trainable_params", "total_params"}`` for this rank's shard."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    from rlhf.models.hybrid import check_hybrid_job

    spec = getattr(getattr(model, "module", model), "spec", None)
    if spec is not None:
        check_hybrid_job(spec, lora=True)
    classes = _lora_classes()
    n_modules = 0
    for name, module in list(model.named_modules()):
        m = _TARGET_PATH.match(name)
        if not m or m.group(3) not in cfg.targets:
            continue
        column = isinstance(module, classes["base_column"])
        if not column and not isinstance(module, classes["base_row"]):
            raise ValueError(f"--target_modules {m.group(3)}: {name} is a {type(module).__name__}, not megatron's "
                             "ColumnParallelLinear/RowParallelLinear (LoRA needs the local layer spec)")
        if column and (module.gather_output or module.sequence_parallel):
            raise ValueError(f"LoRA on {name}: gather_output / sequence_parallel are not supported")
        weight = module.weight
        out_local, in_local = weight.shape
        out_full, in_full = (out_local * tp, in_local) if column else (out_local, in_local * tp)
        global_name = f"decoder.layers.{_global_layer(model, int(m.group(1)))}.{m.group(2)}.{m.group(3)}"
        gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + zlib.crc32(global_name.encode())) % (2 ** 62))
        bound = 1.0 / in_full ** 0.5  # kaiming_uniform_(a=sqrt(5)), as PEFT and nn.Linear
        a_full = (torch.rand(cfg.rank, in_full, generator=gen, dtype=torch.float64) * 2 - 1) * bound  # (r, in)
        if column:
            a, b = a_full, torch.zeros(out_local, cfg.rank)  # A (r, in) replicated; B (out/tp, r) split on rows
        else:
            a = a_full[:, tp_rank * in_local:(tp_rank + 1) * in_local]  # A (r, in/tp) split like W
            b = torch.zeros(out_full, cfg.rank)  # B (out, r) replicated
        module.__class__ = classes["column" if column else "row"]
        module.lora_A = torch.nn.Parameter(a.to(weight.dtype).to(weight.device).contiguous())
        module.lora_B = torch.nn.Parameter(b.to(weight.dtype).to(weight.device))
        # Megatron's grad-norm and distributed optimizer read these: which adapter half is a TP shard.
        set_tensor_model_parallel_attributes(module.lora_A, not column, 1 if not column else -1, 1)
        set_tensor_model_parallel_attributes(module.lora_B, column, 0 if column else -1, 1)
        module.lora_scale = cfg.scale
        # Dropout draws from the default generator, which megatron seeds alike on every TP rank: a column
        # layer's replicated input gets the same mask on each rank, so h = A x stays replicated.
        module.lora_dropout = torch.nn.Dropout(cfg.dropout) if cfg.dropout > 0 else torch.nn.Identity()
        n_modules += 1
    if n_modules == 0:
        raise ValueError(f"--target_modules {','.join(cfg.target_modules)}: no matching layer in the model")
    counts = {"lora_params": 0, "trainable_params": 0, "total_params": 0}
    for name, p in model.named_parameters():
        keep = is_lora_param(name) or name in trainable
        p.requires_grad_(keep)
        counts["total_params"] += p.numel()
        counts["trainable_params"] += p.numel() if keep else 0
        counts["lora_params"] += p.numel() if is_lora_param(name) else 0
    if getattr(model, "pre_process", False) and hasattr(model, "embedding"):
        # With frozen embeddings the decoder input needs no grad; megatron's activation recompute would then
        # hand the adapters of the first recomputed layers no gradient (HF's enable_input_require_grads).
        model.embedding.register_forward_hook(lambda mod, inp, out: out.requires_grad_(True)
                                              if torch.is_grad_enabled() and not out.requires_grad else out)
    counts["modules"] = n_modules
    return counts


# --------------------------------------------------------------------------------------------------- merging
def merged_weight(module: torch.nn.Module) -> torch.Tensor:
    """This rank's shard of ``W + scale * B @ A`` (the base shard's shape and dtype), without autograd."""
    with torch.no_grad():
        w = module.weight
        delta = module.lora_B.detach().float() @ module.lora_A.detach().float()  # (out_local, in_local)
        return (w.detach().float() + module.lora_scale * delta).to(w.dtype)


def lora_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if is_lora_module(m)}


def merged_named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.named_parameters()`` as plain tensors, with adapted weights merged and the adapters left out."""
    merged = {n + ".weight": m for n, m in lora_modules(model).items()}
    for name, p in model.named_parameters():
        if is_lora_param(name):
            continue
        yield name, (merged_weight(merged[name]) if name in merged else p.detach())


def merged_sharded_state_dict(model: torch.nn.Module) -> dict:
    """``model.sharded_state_dict()`` of the merged model: what a model without adapters would save."""
    by_id = {id(m.weight): m for m in lora_modules(model).values()}
    out = {}
    for key, sh in model.sharded_state_dict().items():
        if is_lora_param(key):
            continue
        data = getattr(sh, "data", None)
        if data is not None and id(data) in by_id:
            import dataclasses

            sh = dataclasses.replace(sh, data=merged_weight(by_id[id(data)]))
        out[key] = sh
    return out


# ------------------------------------------------------------------------------------------- PEFT export
def gather_adapters_hf(model: torch.nn.Module, spec, mesh) -> dict[str, torch.Tensor]:
    """Collective over the TP group: this stage's adapters as full tensors with PEFT names (on every rank)."""
    import torch.distributed as dist

    from rlhf.models.hf_llama import full_from_tp_shards, hf_from_megatron

    out: dict[str, torch.Tensor] = {}
    for name, m in sorted(lora_modules(model).items()):
        mt = _TARGET_PATH.match(name)
        column = mt.group(3) in ("linear_qkv", "linear_fc1")
        split = m.lora_B if column else m.lora_A
        shards = [split.detach()]
        if mesh.tp > 1:
            shards = [torch.empty_like(split) for _ in range(mesh.tp)]
            dist.all_gather(shards, split.detach().contiguous(), group=mesh.tp_group)
        base = f"decoder.layers.{mt.group(1)}.{mt.group(2)}.{mt.group(3)}.weight"
        full = full_from_tp_shards(base, shards, 0 if column else 1)
        a, b = (m.lora_A.detach(), full) if column else (full, m.lora_B.detach())
        offset = _global_layer(model, int(mt.group(1))) - int(mt.group(1))
        for hf_name, b_part in hf_from_megatron(base, b, spec, layer_offset=offset):
            path = "base_model.model." + hf_name[: -len(".weight")]
            out[path + ".lora_A.weight"] = a.float().clone()
            out[path + ".lora_B.weight"] = b_part.float().contiguous().clone()
    return out


def peft_config(cfg: LoraConfig, modules: list[str], base_model: str | None = None) -> dict:
    """PEFT's ``adapter_config.json`` of ``cfg`` over the HF ``modules``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": cfg.rank,
            "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": modules, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
            "use_rslora": False, "use_dora": False, "layers_to_transform": None, "rank_pattern": {},
            "alpha_pattern": {}, "revision": None}


def write_peft_folder(tensors: dict[str, torch.Tensor], cfg: LoraConfig, out_dir: str,
                      base_model: str | None = None) -> list[str]:
    """``tensors`` (PEFT names) and their ``adapter_config.json`` as a PEFT LoRA folder ``out_dir``; the HF modules
    adapted."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    modules = sorted({k.split(".")[-3] for k in tensors})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(peft_config(cfg, modules, base_model), f, indent=2)
    return modules


def save_peft_adapter(engine, mesh, out_dir: str, base_model: str) -> None:
    """Collective: write ``out_dir/adapter_config.json`` + ``adapter_model.safetensors`` (PEFT LoRA format) from
    every pipeline stage's adapters; ``peft.PeftModel.from_pretrained(base, out_dir)`` loads it."""
    import torch.distributed as dist

    if engine.lora is None:
        raise ValueError("--lora_export adapter needs --lora_rank > 0")
    if engine.value_head:
        raise ValueError("--lora_export adapter: only causal LMs export as an adapter; a reward/critic model "
                         "exports merged")
    tensors = gather_adapters_hf(engine.model, engine.spec, mesh)
    mine = tensors if (mesh.tp_rank == 0 and mesh.dp_rank == 0 and mesh.cp_rank == 0) else {}
    parts: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if dist.get_rank() == 0:
        from rlhf.models.hf_io import copy_tokenizer_files

        full: dict[str, torch.Tensor] = {}
        for part in parts:
            full.update(part or {})
        modules = write_peft_folder(full, engine.lora, out_dir, os.path.abspath(base_model))
        copy_tokenizer_files(base_model, out_dir)
        if not os.path.exists(os.path.join(base_model, "config.json")):
            log.warning("adapter_config.json names base model %s, which is a megatron checkpoint: PEFT needs the HF "
                        "folder (tools/convert_megatron_to_hf.py) as its base", base_model)
        log.info("exported a PEFT LoRA adapter (%d tensors, modules %s) to %s", len(full), ",".join(modules),
                 out_dir)
    dist.barrier()
