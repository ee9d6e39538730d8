"""The final export of a trained model to ``--save_path``: a megatron copy (``<save_path>/megatron``) written by every
rank, converted to HF by rank 0 in a subprocess (which dies with its rank), published by renames; with LoRA the
merged weights or a PEFT adapter folder. Every workflow's last step (SFT, RM, DPO, KTO, PPO and its EMA)."""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from typing import Any

import torch.distributed as dist

from rlhf.models.checkpoint_io import require_free_space
from rlhf.save_size import saved_bytes

log = logging.getLogger(__name__)


def export_hf(args: argparse.Namespace, engine, mesh, extra: dict[str, Any]) -> None:
    """Final export to ``--save_path``: a megatron model checkpoint (``<save_path>/megatron``) converted to HF
    by rank 0 in a subprocess, with ``extra`` (e.g. reward statistics) in config.json under ``rlhf``. With LoRA
    the weights are merged, or, with ``--lora_export adapter``, a PEFT adapter folder is written instead."""
    from rlhf.distributed.watchdog import phase

    with phase("export"):
        _export_hf(args, engine, mesh, extra)


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
    fault_point("export")  # while rank 0 converts, the others wait for it in long_barrier
    if mesh.is_rank0:
        import shutil

        from rlhf.models.hf_io import copy_tokenizer_files
        from rlhf.models.spec import SEQ_CLS_ARCHS

        from rlhf.models.reward_format import OPENRLHF_CONFIG_KEYS, reward_stats

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
        from rlhf.models.spec import spec_from_hf_config

        spec = spec_from_hf_config(cfg)
        write_manifest(tmp, spec=spec, hf_config=cfg, padded_vocab=engine.padded_vocab, source=args.pretrain,
                       tp=mesh.tp, pp=mesh.pp, dtype="float32")
        copy_tokenizer_files(args.pretrain, tmp)
        shutil.rmtree(mg, ignore_errors=True)
        os.replace(tmp, mg)
        hf_tmp = os.path.join(args.save_path, "hf.tmp")
        tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                            "convert_megatron_to_hf.py")
        from rlhf.distributed.env import env_without_launcher

        from rlhf.distributed.parent_death import DIE_WITH_PARENT_ENV

        env = {**env_without_launcher(), DIE_WITH_PARENT_ENV: "1"}  # the converter ends with this rank
        if mesh.device.type == "cpu":  # a CPU engine on a CUDA host: the converter too (rlhf.compat.cuda.install)
            env["RLHF_DEVICE"] = "cpu"
        proc = subprocess.run([sys.executable, tool, "--ckpt", mg, "--out", hf_tmp, "--overwrite"],
                              capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"HF export failed: {proc.stderr[-2000:]}")
        for name in os.listdir(hf_tmp):  # HF files land in --save_path itself, beside checkpoints/ and megatron/
            os.replace(os.path.join(hf_tmp, name), os.path.join(args.save_path, name))
        os.rmdir(hf_tmp)
        log.info("exported HF model to %s", args.save_path)
    long_barrier()  # the others wait for rank 0's conversion, which may outlast --dist_timeout_s
