"""The final export of a trained model to ``--save_path``: a megatron copy (``<save_path>/megatron``) written by every
rank, and the HF folder written by rank 0 from full tensors gathered in this process (the weight sync's pipeline,
``rlhf.rollout.weight_sync``, and the converter's names and config), published by renames; with LoRA the merged
weights or a PEFT adapter folder. Every workflow's last step (SFT, RM, DPO, KTO, PPO and its EMA).

Until 2026-11-28 rank 0 converted the megatron copy in a subprocess (``tools/convert_megatron_to_hf.py``): 2.4 s a job
on a 2-core Intel Xeon, 5-6 s on a 2-core AMD EPYC, most of it the subprocess's imports; the files are the same
tensors (tests/train/test_sft_rm.py compares the two)."""
from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch.distributed as dist

from rlhf.models.checkpoint_io import require_free_space
from rlhf.runtime.save_size import saved_bytes

log = logging.getLogger(__name__)


def export_hf(args: argparse.Namespace, engine, mesh, extra: dict[str, Any]) -> None:
    """Final export to ``--save_path``: a megatron model checkpoint (``<save_path>/megatron``, what
    ``tools/convert_megatron_to_hf.py`` reads) and the HF folder, written in this process by rank 0 from the
    full tensors every rank gathers as the weight sync does (``_write_hf_in_process``), with ``extra`` (e.g. reward
    statistics) in config.json under ``rlhf``. With LoRA the weights are merged, or, with ``--lora_export
    adapter``, a PEFT adapter folder is written instead."""
    from rlhf.distributed.watchdog import phase

    with phase("export"):
        _export_hf(args, engine, mesh, extra)


def _export_config(engine, extra: dict[str, Any]):
    """The exported config.json (the source's, a value head's sequence-classification fields, reward statistics
    and ``extra`` under ``rlhf``) and its ``ModelSpec``: the same on every rank."""
    from rlhf.models.reward_format import OPENRLHF_CONFIG_KEYS, reward_stats
    from rlhf.models.spec import SEQ_CLS_ARCHS, spec_from_hf_config

    cfg = dict(engine.source["hf_config"])
    stats = reward_stats(cfg)  # a reward model started from OpenRLHF's format keeps its statistics in ours
    cfg = {k: v for k, v in cfg.items() if k not in OPENRLHF_CONFIG_KEYS}
    if stats is not None and engine.value_head:
        cfg["rlhf"] = {"reward_mean": stats[0], "reward_std": stats[1], **cfg.get("rlhf", {})}
    if engine.value_head:
        cfg["architectures"] = [SEQ_CLS_ARCHS[engine.spec.model_type]]
        cfg["num_labels"] = 1
        cfg.pop("id2label", None), cfg.pop("label2id", None)
        cfg.setdefault("pad_token_id", cfg.get("eos_token_id"))
    if extra:
        cfg["rlhf"] = {**cfg.get("rlhf", {}), **extra}
    return cfg, spec_from_hf_config(cfg)


def _write_hf_in_process(engine, mesh, spec, cfg: dict, tokenizer_src: str, out: str) -> None:
    """Every rank gathers the model's full tensors bucket by bucket (``WeightSync.iter_hf_tensors``: collectives
    over TP, EP and PP), named by ``spec`` (the exported config's); rank 0 writes them in fp32 as HF safetensors
    shards, config.json (``cfg``, with the converter's architectures) and the tokenizer files into ``out``."""
    import json

    import torch

    from rlhf.models.hf_io import HFShardedWriter, copy_tokenizer_files
    from rlhf.models.spec import CAUSAL_LM_ARCHS, SEQ_CLS_ARCHS
    from rlhf.rollout.weight_sync import WeightSync

    from rlhf.models.mtp import mtp_tensors
    from rlhf.models.vlm import saved_hf_name

    writer = HFShardedWriter(out) if mesh.is_rank0 else None
    for name, tensor in WeightSync(engine, mesh, spec=spec).iter_hf_tensors():
        if writer is not None:
            writer.add(saved_hf_name(spec, name), tensor.to(torch.float32).clone())
    if writer is None:
        return
    for name, tensor in mtp_tensors(tokenizer_src, spec).items():  # DeepSeek's MTP layers (the source folder's)
        writer.add(name, tensor)
    writer.finalize()
    cfg = dict(cfg)
    if spec.mxfp4:  # GPT-OSS's experts are written dequantized
        cfg.pop("quantization_config", None)
    cfg["architectures"] = [(SEQ_CLS_ARCHS if spec.is_seq_cls else CAUSAL_LM_ARCHS)[spec.model_type]]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    copy_tokenizer_files(tokenizer_src, out)


def _export_hf(args: argparse.Namespace, engine, mesh, extra: dict[str, Any]) -> None:
    from rlhf.distributed.faults import fault_point
    from rlhf.distributed.watchdog import long_barrier
    from rlhf.models.checkpoint_io import save_model, write_manifest

    engine.check_finite("HF export")
    if mesh.is_rank0:
        log.info("exporting HF model to %s", args.save_path)
    if getattr(engine, "lora", None) is not None and getattr(args, "lora_export", "merged") == "adapter":
        from rlhf.models.lora import save_peft_adapter

        save_peft_adapter(engine, mesh, args.save_path, base_model=args.pretrain)
        return

    mg = os.path.join(args.save_path, "megatron")
    tmp = mg + ".tmp"
    require_free_space(mesh, args.save_path, 2 * saved_bytes({"model": engine}, mesh, optimizer=False), "HF export",
                       "--save_path", "the megatron copy and the HF files, each the model's parameter bytes",
                       reclaimable=mg)
    if mesh.is_rank0:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "model"))
    dist.barrier()
    save_model(engine.model, os.path.join(tmp, "model"), engine.export_sharded_state_dict())
    dist.barrier()
    fault_point("export")  # while rank 0 writes the HF files, the others wait for it in long_barrier
    cfg, spec = _export_config(engine, extra)
    hf_tmp = os.path.join(args.save_path, "hf.tmp")
    if mesh.is_rank0:
        import shutil

        from rlhf.models.hf_io import copy_tokenizer_files

        write_manifest(tmp, spec=spec, hf_config=cfg, padded_vocab=engine.padded_vocab, source=args.pretrain,
                       tp=mesh.tp, pp=mesh.pp, dtype="float32")
        copy_tokenizer_files(args.pretrain, tmp)
        shutil.rmtree(mg, ignore_errors=True)
        os.replace(tmp, mg)
        shutil.rmtree(hf_tmp, ignore_errors=True)
    _write_hf_in_process(engine, mesh, spec, cfg, args.pretrain, hf_tmp)
    if mesh.is_rank0:
        for name in os.listdir(hf_tmp):  # HF files land in --save_path itself, beside checkpoints/ and megatron/
            os.replace(os.path.join(hf_tmp, name), os.path.join(args.save_path, name))
        os.rmdir(hf_tmp)
        log.info("exported HF model to %s", args.save_path)
    long_barrier()  # the others wait for rank 0's conversion, which may outlast --dist_timeout_s
