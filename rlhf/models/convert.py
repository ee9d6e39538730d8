"""HF <-> Megatron checkpoint conversion (the logic behind ``tools/convert_*.py``).

HF -> Megatron runs one process per TP x PP (x EP) rank (spawned here, or the ranks of an enclosing torchrun). Each
rank reads from the HF safetensors only the rows of its own shard, so the job as a whole holds one copy of the
weights. Megatron -> HF loads at TP=1/PP=1 in one process and moves tensors one by one from the model into
safetensors shards, so it too holds about one copy.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from rlhf.distributed.env import free_port
from rlhf.models.checkpoint_io import (MANIFEST, atomic_dir, load_model, read_manifest, save_model,
                                       spec_from_manifest, write_manifest)
from rlhf.models.hf_io import HFCheckpointReader, HFShardedWriter, copy_tokenizer_files, torch_dtype
from rlhf.models.hf_llama import check_hf_names, hf_from_megatron, megatron_shard_from_hf
from rlhf.models.spec import (CAUSAL_LM_ARCHS, SEQ_CLS_ARCHS, ModelSpec, check_parallel_fit, load_hf_config,
                              padded_vocab_size, spec_from_hf_config)

log = logging.getLogger(__name__)


@dataclass
class HFToMegatronPlan:
    hf: str
    out: str
    tp: int
    pp: int
    spec: ModelSpec
    hf_config: dict
    padded_vocab: int
    dtype: str
    ep: int = 1


def plan_hf_to_megatron(hf: str, out: str, tp: int, pp: int, overwrite: bool = False,
                        vocab_divisible_by: int = 128, ep: int = 1) -> HFToMegatronPlan:
    """Every check that can fail, before any process is started or any weight is read."""
    if not os.path.isdir(hf):
        raise ValueError(f"--hf folder not found: {hf}")
    if tp < 1 or pp < 1 or ep < 1:
        raise ValueError(f"--tp, --pp and --ep must be >= 1, got --tp {tp} --pp {pp} --ep {ep}")
    cfg = load_hf_config(hf)
    spec = spec_from_hf_config(cfg, source=os.path.join(hf, "config.json"))
    padded = padded_vocab_size(spec.vocab_size, vocab_divisible_by)
    check_parallel_fit(spec, tp, pp, padded, ep)
    reader = HFCheckpointReader(hf)
    check_hf_names(reader.keys(), spec, hf)
    if os.path.exists(out) and not overwrite:
        raise ValueError(f"--out folder already exists: {out}")
    dtype = str(reader.get("model.embed_tokens.weight", rows=(0, 1)).dtype).replace("torch.", "")
    torch_dtype(dtype)
    return HFToMegatronPlan(hf, out, tp, pp, spec, cfg, padded, dtype, ep)


def fill_from_hf(model: torch.nn.Module, hf_dir: str, spec: ModelSpec, padded_vocab: int, *, tp: int, pp: int,
                 tp_rank: int, pp_rank: int, skip_head: bool = False, ep_rank: int = 0, ep: int = 1) -> None:
    """Fill this rank's stage of ``model`` from an HF folder, reading only this rank's rows of each tensor.

    ``skip_head``: leave the (freshly initialised) score head alone, for a value model made from a causal LM.
    """
    reader = HFCheckpointReader(hf_dir)
    check_hf_names(reader.keys(), spec, hf_dir)
    get = reader.get
    if spec.mxfp4:  # GPT-OSS's MXFP4 experts, dequantized as they are read (rlhf.models.mxfp4)
        from rlhf.models.mxfp4 import dequantizing_getter

        get = dequantizing_getter(reader.get, reader.keys())
    layer_offset = pp_rank * (spec.num_layers // pp)
    from rlhf.models.hf_families import mapped_buffers

    from rlhf.models.gpt import expert_tp_coords

    etp = expert_tp_coords(tp_rank, tp)

    with torch.no_grad():
        for name, param in [*model.named_parameters(), *mapped_buffers(model)]:
            if skip_head and name == "output_layer.weight":
                continue
            shard = megatron_shard_from_hf(name, get, spec, tp_rank=tp_rank, tp=tp,
                                           layer_offset=layer_offset, padded_vocab=padded_vocab, ep_rank=ep_rank,
                                           ep=ep, etp=etp)
            if tuple(shard.shape) != tuple(param.shape):
                raise ValueError(f"{name}: HF shard shape {tuple(shard.shape)} != megatron {tuple(param.shape)}")
            param.copy_(shard)
    if spec.tie_word_embeddings and not spec.is_seq_cls and "lm_head.weight" in reader.keys():
        if not torch.equal(reader.get("lm_head.weight"), reader.get("model.embed_tokens.weight")):
            raise ValueError(f"{hf_dir}: tie_word_embeddings=True but lm_head.weight differs from the embedding")


def hf_to_megatron_rank(plan: HFToMegatronPlan, tmp_dir: str) -> None:
    """The per-rank body: build this rank's stage, fill it from HF, write its shards. Process group must exist."""
    from rlhf.distributed import initialize_mesh
    from rlhf.models.gpt import build_model

    from rlhf.models.spec_families import expert_tensor_parallel

    mesh = initialize_mesh(plan.tp, plan.pp, device="cpu", ep=plan.ep,  # beside a job that may hold the GPUs
                           etp=expert_tensor_parallel([plan.spec], plan.tp))
    model = build_model(plan.spec, tp=plan.tp, pp=plan.pp, pp_rank=mesh.pp_rank,  # CPU: the local spec
                        params_dtype=torch_dtype(plan.dtype), padded_vocab=plan.padded_vocab, use_te=False,
                        ep=plan.ep)
    fill_from_hf(model, plan.hf, plan.spec, plan.padded_vocab, tp=plan.tp, pp=plan.pp, tp_rank=mesh.tp_rank,
                 pp_rank=mesh.pp_rank, ep_rank=mesh.ep_rank, ep=plan.ep)
    save_model(model, os.path.join(tmp_dir, "model"))


def _spawned(local_rank: int, plan: HFToMegatronPlan, tmp_dir: str, port: int) -> None:
    from rlhf.distributed import DistEnv
    from rlhf.distributed.mesh import destroy_mesh

    torch.set_num_threads(1)
    DistEnv(local_rank, plan.tp * plan.pp * plan.ep, local_rank, "127.0.0.1", port, "spawn").export()
    try:
        hf_to_megatron_rank(plan, tmp_dir)
    finally:
        destroy_mesh()


# What a rank's body imports (measured: 2.4 s on a 2-core EPYC), imported once in the parent before it forks.
_RANK_MODULES = ("rlhf.distributed.mesh", "rlhf.distributed.watchdog", "rlhf.compat.cuda", "rlhf.compat.megatron",
                 "rlhf.models.gpt", "megatron.core.dist_checkpointing", "megatron.core.parallel_state",
                 "megatron.core.tensor_parallel")


def rank_start_method() -> str:
    """How ``convert_hf_to_megatron`` starts its ranks: ``fork`` from a process that holds nothing a child could
    inherit in a broken state (one thread, no process group, no CUDA context), after importing what the ranks need
    once (each spawned rank imported torch, megatron-core and rlhf again: about 4 s apiece, 16 s of CPU at TP2 x
    PP2); else ``spawn``, as before. The command-line converter is such a process."""
    import importlib

    import torch.distributed as dist

    from rlhf.distributed.forkrun import fork_unsafe_reason

    if dist.is_initialized() or torch.cuda.is_initialized():
        return "spawn"
    for name in _RANK_MODULES:
        importlib.import_module(name)
    return "fork" if fork_unsafe_reason() is None else "spawn"


def convert_hf_to_megatron(plan: HFToMegatronPlan, overwrite: bool = False) -> float:
    """Start TP x PP x EP local ranks (gloo) that write the dist checkpoint (EP: DP = EP, each rank its experts);
    publish it atomically. Returns seconds. The ranks are forked where ``rank_start_method`` finds it safe, else
    spawned; both run the same ``_spawned`` body."""
    import torch.multiprocessing as mp

    t0 = time.time()
    with atomic_dir(plan.out, overwrite=overwrite) as tmp:
        method, nprocs = rank_start_method(), plan.tp * plan.pp * plan.ep
        log.info("converting at tp=%d pp=%d ep=%d: %d local rank(s), started by %s", plan.tp, plan.pp, plan.ep,
                 nprocs, method)
        mp.start_processes(_spawned, args=(plan, tmp, free_port()), nprocs=nprocs, join=True, start_method=method)
        copy_tokenizer_files(plan.hf, tmp)
        from rlhf.models.mtp import keep_mtp

        keep_mtp(plan.hf, tmp, plan.spec)  # DeepSeek's / GLM's MTP layers, verbatim (rlhf.models.mtp)
        write_manifest(tmp, spec=plan.spec, hf_config=plan.hf_config, padded_vocab=plan.padded_vocab,
                       source=os.path.abspath(plan.hf), tp=plan.tp, pp=plan.pp, dtype=plan.dtype,
                       extra={"saved_at_ep": plan.ep})
    return time.time() - t0


def megatron_to_hf(ckpt: str, out: str, overwrite: bool = False, max_shard_bytes: int = 2 << 30) -> float:
    """Load a checkpoint at TP=1/PP=1 in this process and write an HF folder. Returns seconds."""
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.models.gpt import build_model

    t0 = time.time()
    manifest = read_manifest(ckpt)
    spec = spec_from_manifest(manifest)
    if os.path.exists(out) and not overwrite:
        raise ValueError(f"--out folder already exists: {out}")
    dtype = torch_dtype(manifest["dtype"])
    initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"), device="cpu")
    try:
        model = build_model(spec, tp=1, pp=1, pp_rank=0, params_dtype=dtype,  # CPU: the local spec
                            padded_vocab=manifest["padded_vocab_size"], use_te=False)
        load_model(model, os.path.join(ckpt, "model"))
        with atomic_dir(out, overwrite=overwrite) as tmp:
            writer = HFShardedWriter(tmp, max_shard_bytes)
            _write_hf_tensors(model, spec, dtype, writer, ckpt)
            del model
            writer.finalize()
            cfg = dict(manifest["hf_config"])
            if spec.mxfp4:  # the experts are written dequantized, in the checkpoint's dtype
                cfg.pop("quantization_config", None)
            arch = SEQ_CLS_ARCHS if spec.is_seq_cls else CAUSAL_LM_ARCHS
            cfg["architectures"] = [arch[spec.model_type]]
            for key in ("rlhf",):
                if key in manifest:
                    cfg[key] = manifest[key]
            import json

            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(cfg, f, indent=2)
            copy_tokenizer_files(ckpt, tmp)
    finally:
        destroy_mesh()
    return time.time() - t0


def _write_hf_tensors(model, spec: ModelSpec, dtype: torch.dtype, writer, ckpt: str) -> None:
    """Every parameter and mapped buffer of a TP=1 model as HF tensors (gpt_oss's experts fused per layer, the
    expert-bias correction kept in fp32 as transformers keeps it), then the checkpoint's MTP tensors as they are."""
    from rlhf.models.hf_families import fuse_experts, mapped_buffers
    from rlhf.models.mtp import mtp_tensors
    from rlhf.models.vlm import saved_hf_name

    def tensors():
        for name, tensor in [*model.named_parameters(), *mapped_buffers(model)]:
            yield from hf_from_megatron(name, tensor.detach(), spec)

    for hf_name, t in fuse_experts(tensors(), spec):
        writer.add(saved_hf_name(spec, hf_name),
                   (t if hf_name.endswith("e_score_correction_bias") else t.to(dtype)).clone())
    for hf_name, t in mtp_tensors(ckpt, spec).items():
        writer.add(hf_name, t)


__all__ = ["plan_hf_to_megatron", "convert_hf_to_megatron", "megatron_to_hf", "MANIFEST"]
