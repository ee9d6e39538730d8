"""The supervised training loop shared by SFT and reward-model training.

A ``Task`` supplies what differs (data formatting, collate, loss, eval, what to export); this loop does the
rest: mesh, engine, resumable sampler, checkpoints, logging, HF export. Readable on two screens.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

log = logging.getLogger("rlhf")


class Task(Protocol):
    name: str
    value_head: bool
    metric_keys: Sequence[str]
    output: str

    def load_data(self, args: argparse.Namespace, tokenizer) -> tuple[list, list, dict[str, int]]: ...

    def collate(self, samples: list, tokenizer) -> dict[str, torch.Tensor]: ...

    def loss_fn(self, engine) -> Any: ...

    def evaluate(self, engine, batches: list[dict]) -> dict[str, float]: ...

    def export_extra(self, engine, batches: list[dict]) -> dict[str, Any]: ...

    # Optional hooks (DPO/KTO use them; SFT/RM do not define them):
    #   validate(args)                      task flag checks, before the process group and any model
    #   setup(args, mesh, engine)           after the trained engine is built, e.g. a frozen reference engine
    #   before_step(engine, microbatches)   before each train step, e.g. attach reference log-probs to the
    #                                       micro-batches; returns extra metrics (phase timings)


def load_split(args: argparse.Namespace, tokenizer, build) -> tuple[list, list, dict[str, float]]:
    """Train samples from --dataset; eval samples from --eval_dataset, or the last --eval_split of --dataset."""
    from rlhf.data import DataConfig

    train, stats = build(DataConfig.from_args(args), tokenizer)
    if stats.num_truncated:
        import logging

        logging.getLogger("rlhf").info("%d samples truncated to --max_len %d (%d dropped: no response token left)",
                                       stats.num_truncated, args.max_len, stats.num_dropped)
    evals: list = []
    if args.eval_dataset:
        evals, _ = build(DataConfig.from_args(args, dataset=args.eval_dataset, dataset_probs=None,
                                              max_samples=None), tokenizer)
    elif args.eval_split > 0:
        n = int(len(train) * args.eval_split)
        train, evals = train[: len(train) - n], train[len(train) - n:]
    return train, evals, {k.split("/", 1)[1]: v for k, v in stats.as_metrics().items() if "/mixed/" not in k}


def tokens_in(microbatches: Sequence[dict]) -> int:
    """Real (non-padding) tokens of padded or packed micro-batches."""
    return int(sum(mb["num_tokens"] if "num_tokens" in mb else int(mb["attention_mask"].sum())
                   for mb in microbatches))


def make_microbatches(task: Task, groups: Sequence[list], tokenizer, *, packing: bool,
                      same_shape: bool) -> list[dict]:
    """One micro-batch per group of samples: ``task.collate``, then, with ``packing`` (``--packing_samples``),
    one padding-free row per micro-batch (``rlhf.models.packing``; the task's loss reads that layout).

    ``same_shape`` (PP > 1): megatron's pipeline sends activations of one shape for every micro-batch of a
    schedule call, so packed rows are filled up to the longest one with dummy trailing sequences (no loss, they
    attend only to themselves), and padded micro-batches are right-padded to the widest one. Sequence
    parallelism is off, so no length needs to divide by TP.
    """
    from rlhf.data import pad_token_id

    mbs = [task.collate(list(g), tokenizer) for g in groups]
    if not mbs:
        return mbs
    pad_id = pad_token_id(tokenizer)
    if packing:
        from rlhf.models.packing import pack_padded_batch

        pad_to = max(int(mb["attention_mask"].sum()) for mb in mbs) if same_shape else None
        return [pack_padded_batch(mb, pad_to=pad_to, pad_token_id=pad_id) for mb in mbs]
    if same_shape:
        width = max(mb["input_ids"].shape[1] for mb in mbs)
        mbs = [_pad_width(mb, width, pad_id) for mb in mbs]
    return mbs


def _pad_width(mb: dict, width: int, pad_id: int) -> dict:
    """Right-pad every (B, S) tensor of a right-padded micro-batch to (B, width): pad id, zero masks."""
    b, s = mb["input_ids"].shape
    if s == width:
        return mb
    out = dict(mb)
    for k, v in mb.items():
        if isinstance(v, torch.Tensor) and v.shape == (b, s):
            out[k] = torch.cat([v, v.new_full((b, width - s), pad_id if k == "input_ids" else 0)], dim=1)
    return out


def run(args: argparse.Namespace, task: Task) -> dict[str, Any]:
    from rlhf.checkpoint import Checkpointer
    from rlhf.config import log_compat_mappings, validate_common
    from rlhf.data import BatchConfig, DistributedBatchSampler
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.engine import ModelEngine, OptimConfig
    from rlhf.metrics import MetricsLogger, setup_logging
    from rlhf.models.lora import lora_config_from_args

    env = DistEnv.from_environ()
    setup_logging(env.rank)
    dp = validate_common(args, env.world_size)  # before the process group and any model
    if getattr(args, "lora_rank", 0) and args.lora_export == "adapter" and task.value_head:
        raise ValueError(f"--lora_export adapter: {task.name} has a value head; reward models export merged")
    if hasattr(task, "validate"):
        task.validate(args)
    from transformers import AutoTokenizer  # after the flag checks: importing it takes seconds

    tokenizer = AutoTokenizer.from_pretrained(args.pretrain)
    train, evals, stats = task.load_data(args, tokenizer)
    if not train:
        raise ValueError(f"--dataset {args.dataset}: no training samples after filtering")
    steps_per_epoch = len(train) // args.train_batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"--train_batch_size {args.train_batch_size} is larger than the dataset "
                         f"({len(train)} samples after filtering)")
    total_steps = steps_per_epoch * args.max_epochs

    torch.manual_seed(args.seed)
    mesh = initialize_mesh(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, env, seed=args.seed)
    from rlhf.distributed.health import check_config_consistency; check_config_consistency(args)  # noqa: E702
    log_compat_mappings(args)
    if mesh.is_rank0:
        log.info("%s: %d train / %d eval samples (%s); %d steps of %d samples on dp=%d tp=%d pp=%d", task.name,
                 len(train), len(evals), ", ".join(f"{k}={v:g}" for k, v in stats.items()), total_steps,
                 args.train_batch_size, dp, mesh.tp, mesh.pp)
    optim = OptimConfig(lr=args.learning_rate, weight_decay=args.l2, adam_betas=tuple(args.adam_betas),
                        clip_grad=args.max_norm, warmup_ratio=args.lr_warmup_ratio, scheduler=args.lr_scheduler,
                        max_skipped_steps=args.max_skipped_steps,
                        total_steps=total_steps, use_distributed_optimizer=args.zero_stage >= 1)
    engine = ModelEngine(mesh, args.pretrain, optim=optim, value_head=task.value_head, bf16=args.bf16,
                         transformer_impl=args.transformer_impl,
                         recompute=args.gradient_checkpointing, name=task.name, lora=lora_config_from_args(args))
    if hasattr(task, "setup"):
        task.setup(args, mesh, engine)
    sampler = DistributedBatchSampler(len(train), BatchConfig(args.train_batch_size, args.micro_train_batch_size,
                                                              dp, mesh.dp_rank), seed=args.seed)
    ckpt = Checkpointer(mesh, args.ckpt_path or os.path.join(args.save_path, "checkpoints"), args.max_ckpt_num)
    step = 0
    if args.load_checkpoint:
        state = ckpt.load({task.name: engine})
        step = state["step"]
        sampler.load_state_dict(state["extra"]["sampler"])
    metrics_log = MetricsLogger(mesh.is_rank0, total_steps, args.tensorboard, prefix=task.name,
                                jsonl_path=os.path.join(args.save_path, "metrics.jsonl"))
    if args.packing_samples and mesh.is_rank0:
        log.info("--packing_samples: each micro-batch runs as one padding-free row (THD, varlen attention)%s",
                 "; with PP > 1 a step's rows are filled to its longest with a dummy sequence" if mesh.pp > 1
                 else "")

    def batches(groups: Sequence[list]) -> list[dict]:
        return make_microbatches(task, groups, tokenizer, packing=args.packing_samples, same_shape=mesh.pp > 1)

    mbs = args.micro_train_batch_size
    eval_batches = batches([evals[i:i + mbs] for i in range(0, len(evals), mbs)])
    eval_batches = eval_batches[mesh.dp_rank::dp] if len(eval_batches) >= dp else eval_batches[:0]
    result: dict[str, Any] = {}
    loss_fn = task.loss_fn(engine)
    start_step = step
    while step < total_steps:
        if 0 <= args.stop_after_steps <= step - start_step:
            log.info("stopping after %d steps (--stop_after_steps)", args.stop_after_steps)
            metrics_log.close()
            from rlhf.distributed.mesh import destroy_mesh

            destroy_mesh()
            return result
        micro_idx = sampler.next_step()
        microbatches = batches([[train[i] for i in idx] for idx in micro_idx])
        t0 = time.time()
        pre = task.before_step(engine, microbatches) if hasattr(task, "before_step") else {}
        m = engine.train_step(microbatches, loss_fn, task.metric_keys, output=task.output)
        m.update(pre)
        step += 1
        ntok = torch.tensor([tokens_in(microbatches)], dtype=torch.float64)
        dist.all_reduce(ntok)
        m["tokens_per_s"] = ntok.item() / mesh.tp / mesh.pp / max(time.time() - t0, 1e-9)
        m["epoch"] = sampler.epoch_float
        if step % args.logging_steps == 0 or step == total_steps:
            metrics_log.log(step, m)
        result["train"] = m
        if args.eval_steps > 0 and step % args.eval_steps == 0 and step < total_steps:
            metrics_log.log(step, task.evaluate(engine, eval_batches), prefix="eval", progress=False)
        if (args.save_steps > 0 and step % args.save_steps == 0) or step == total_steps:
            ckpt.save(step, {task.name: engine}, {"sampler": sampler.state_dict()})
    if eval_batches:
        result["eval"] = task.evaluate(engine, eval_batches)
        metrics_log.log(step, result["eval"], prefix="eval", progress=False)
    train_batches = batches([train[i:i + mbs] for i in range(0, len(train), mbs)])
    extra = task.export_extra(engine, train_batches[mesh.dp_rank::dp])
    result.update(extra)
    export_hf(args, engine, mesh, extra)
    metrics_log.close()
    if mesh.is_rank0:
        with open(os.path.join(args.save_path, "train_result.json"), "w") as f:
            json.dump(result, f, indent=2)
    from rlhf.distributed.mesh import destroy_mesh

    destroy_mesh()
    return result


def main(task_mod, argv=None) -> int:
    """The body of ``launch/sft.py`` and ``launch/rm.py``: flags of ``task_mod``, run its task, ``error:`` line
    and exit 2 on bad input."""
    from rlhf.config import cli_main

    return cli_main(task_mod.add_args, lambda args: run(args, task_mod.TASK()), argv)


def export_hf(args: argparse.Namespace, engine, mesh, extra: dict[str, Any]) -> None:
    """Final export to ``--save_path``: a megatron model checkpoint (``<save_path>/megatron``) converted to HF
    by rank 0 in a subprocess, with ``extra`` (e.g. reward statistics) in config.json under ``rlhf``. With LoRA
    the weights are merged, or, with ``--lora_export adapter``, a PEFT adapter folder is written instead."""
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
    if mesh.is_rank0:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "model"))
    dist.barrier()
    save_model(engine.model, os.path.join(tmp, "model"), engine.export_sharded_state_dict())
    dist.barrier()
    if mesh.is_rank0:
        import shutil

        from rlhf.models.hf_io import copy_tokenizer_files
        from rlhf.models.spec import SEQ_CLS_ARCHS

        cfg = dict(engine.source["hf_config"])
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

        proc = subprocess.run([sys.executable, tool, "--ckpt", mg, "--out", hf_tmp, "--overwrite"],
                              capture_output=True, text=True, env=env_without_launcher(), timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"HF export failed: {proc.stderr[-2000:]}")
        for name in os.listdir(hf_tmp):  # HF files land in --save_path itself, beside checkpoints/ and megatron/
            os.replace(os.path.join(hf_tmp, name), os.path.join(args.save_path, name))
        os.rmdir(hf_tmp)
        log.info("exported HF model to %s", args.save_path)
    dist.barrier()
