"""The supervised training loop shared by SFT and reward-model training.

A ``Task`` supplies what differs (data formatting, collate, loss, eval, what to export); this loop does the
rest: mesh, engine, resumable sampler, checkpoints, logging, HF export. Readable on two screens.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
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

    def load_data(self, job, tokenizer) -> tuple[list, list, dict[str, int]]: ...

    def collate(self, samples: list, tokenizer) -> dict[str, torch.Tensor]: ...

    def loss_fn(self, engine) -> Any: ...

    def evaluate(self, engine, batches: list[dict]) -> dict[str, float]: ...

    def export_extra(self, engine, batches: list[dict]) -> dict[str, Any]: ...

    # ``job``: the ``SupervisedJob`` (rlhf.config.job): the shared parts, and the task's own in ``job.task``.
    # Optional hooks (DPO/KTO use them; SFT/RM do not define them):
    #   validate(job)                       task flag checks, before the process group and any model
    #   setup(job, mesh, engine)            after the trained engine is built, e.g. a frozen reference engine
    #   before_step(engine, microbatches)   before each train step, e.g. attach reference log-probs to the
    #                                       micro-batches; returns extra metrics (phase timings)
    #   after_export(job, mesh)             after the HF export, e.g. rewrite it in another format


def load_split(job, tokenizer, build) -> tuple[list, list, dict[str, float]]:
    """Train samples from --dataset; eval samples from --eval_dataset, or the last --eval_split of --dataset."""
    from rlhf.config.job import data_configs, hold_out

    cfg, eval_cfg = data_configs(job)
    train, stats = build(cfg, tokenizer)
    if stats.num_truncated:
        import logging

        logging.getLogger("rlhf").info("%d samples truncated to --max_len %d (%d dropped: no response token left)",
                                       stats.num_truncated, job.batch.max_len, stats.num_dropped)
    evals: list = []
    if eval_cfg is not None:
        evals, _ = build(eval_cfg, tokenizer)
    elif job.data.eval_split > 0:
        train, evals = hold_out(train, job.data.eval_split)
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


def prepare(args: argparse.Namespace, task: Task, world_size: int, task_parts: dict | None = None):
    """Every check on the flags and the data before the process group and any model: the job's configuration
    (``SupervisedJob``, built here once: each part checks its own values), the tokenizer, the train and eval
    samples, the data statistics and the number of optimizer steps."""
    from rlhf.config.job import validate_common

    job = build_job(args, task, task_parts)
    validate_common(job, world_size)
    if job.lora.lora_rank and job.lora.lora_export == "adapter" and task.value_head:
        raise ValueError(f"--lora_export adapter: {task.name} has a value head; reward models export merged")
    if hasattr(task, "validate"):
        task.validate(job)
    from rlhf.models.source import load_tokenizer  # after the flag checks: importing transformers takes seconds

    tokenizer = load_tokenizer(job.model.pretrain)
    train, evals, stats = task.load_data(job, tokenizer)
    if not train:
        raise ValueError(f"--dataset {job.data.dataset}: no training samples after filtering")
    batch = job.batch
    steps_per_epoch = len(train) // batch.train_batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"--train_batch_size {batch.train_batch_size} is larger than the dataset "
                         f"({len(train)} samples after filtering)")
    return job, tokenizer, train, evals, stats, steps_per_epoch * batch.max_epochs


def build_job(args: argparse.Namespace, task: Task, task_parts: dict | None = None):
    """The ``SupervisedJob`` of parsed flags: the shared parts and the task's own (``task_parts``, by default the
    ``TASK_PARTS`` of the task's module), each checking its own values as it is built."""
    import sys

    from rlhf.config.job import SupervisedJob

    if task_parts is None:  # the task's module says which parts are its own
        task_parts = getattr(sys.modules[type(task).__module__], "TASK_PARTS", {})
    return SupervisedJob.from_args(args, task={k: t.from_args(args) for k, t in task_parts.items()})


def run(args: argparse.Namespace, task: Task, task_parts: dict | None = None) -> dict[str, Any]:
    """The job from the flags (``prepare``), then the mesh, the engine, the sampler and the checkpoints from its
    parts; the task's hooks take the job. ``args`` (the parsed flags) remain for the ranks' consistency check, the
    logged configuration and the HF export, which take every flag by name."""
    from rlhf.runtime.checkpoint import Checkpointer
    from rlhf.config.job import log_compat_mappings
    from rlhf.data import BatchConfig, DistributedBatchSampler
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.runtime.role import ModelRole
    from rlhf.observability.metrics import setup_logging

    env = DistEnv.from_environ()
    setup_logging(env.rank)
    job, tokenizer, train, evals, stats, total_steps = prepare(args, task, env.world_size, task_parts)
    par, eng, batch = job.parallel, job.engine, job.batch
    torch.manual_seed(eng.seed)
    from rlhf.models.source import expert_tensor_parallel_of

    mesh = initialize_mesh(par.tp, par.pp, env, seed=eng.seed, ep=par.expert_model_parallel_size,
                           timeout_s=par.dist_timeout_s, cp=par.cp,
                           etp=expert_tensor_parallel_of([job.model.pretrain], par.tp))
    from rlhf.distributed.health import check_config_consistency; check_config_consistency(args)  # noqa: E702
    log_compat_mappings(eng, mesh.dp, mesh.device.type == "cuda")  # resolves job.engine.zero_stage
    if mesh.is_rank0:
        log.info("%s: %d train / %d eval samples (%s); %d steps of %d samples on dp=%d tp=%d pp=%d", task.name,
                 len(train), len(evals), ", ".join(f"{k}={v:g}" for k, v in stats.items()), total_steps,
                 batch.train_batch_size, mesh.dp, mesh.tp, mesh.pp)
    engine = ModelRole(mesh, job.model.pretrain,
                         optim=job.optim.config(job.optim.learning_rate, total_steps, eng.zero_stage >= 1),
                         value_head=task.value_head, bf16=eng.bf16, transformer_impl=eng.transformer_impl,
                         recompute=eng.gradient_checkpointing, name=task.name, lora=job.lora.config(eng.seed),
                         freeze_vision=job.vision.freeze_vision_tower)
    if hasattr(task, "setup"):
        task.setup(job, mesh, engine)
    sampler = DistributedBatchSampler(len(train), BatchConfig(batch.train_batch_size, batch.micro_train_batch_size,
                                                              mesh.dp, mesh.dp_rank), seed=eng.seed)
    ckpt = Checkpointer(mesh, job.checkpoint.dir, job.checkpoint.max_ckpt_num)
    step = 0
    state = ckpt.load_if_any({task.name: engine}) if job.checkpoint.load_checkpoint else None
    if state is not None:
        step = state["step"]
        sampler.load_state_dict(state["extra"]["sampler"])
    if eng.packing_samples and mesh.is_rank0:
        log.info("--packing_samples: each micro-batch runs as one padding-free row (THD, varlen attention)%s",
                 "; with PP > 1 a step's rows are filled to its longest with a dummy sequence" if mesh.pp > 1
                 else "")
    result = SupervisedLoop(job, args, task, tokenizer, engine, sampler, ckpt, total_steps).fit(train, evals, step)
    from rlhf.distributed.mesh import destroy_mesh

    destroy_mesh()
    return result


class SupervisedLoop:
    """The steps of one supervised run (SFT, RM, DPO, KTO) after everything is built: train, evaluate,
    checkpoint, export."""

    def __init__(self, job, args: argparse.Namespace, task: Task, tokenizer, engine, sampler, ckpt,
                 total_steps: int):
        """``job``: the ``SupervisedJob`` (batching, checkpoints, logging; the task's hooks take it); ``args``: the
        parsed flags, for the HF export and the run's logged config."""
        from rlhf.observability.metrics import MetricsLogger

        self.job, self.args, self.task, self.tokenizer, self.engine = job, args, task, tokenizer, engine
        self.sampler, self.ckpt, self.total_steps, self.mesh = sampler, ckpt, total_steps, engine.mesh
        self.metrics_log = MetricsLogger(self.mesh.is_rank0, total_steps, job.logging.tensorboard, prefix=task.name,
                                         jsonl_path=os.path.join(job.checkpoint.save_path, "metrics.jsonl"),
                                         args=args)

    def batches(self, groups: Sequence[list]) -> list[dict]:
        return make_microbatches(self.task, groups, self.tokenizer, packing=self.job.engine.packing_samples,
                                 same_shape=self.mesh.pp > 1)

    def fit(self, train: list, evals: list, step: int) -> dict[str, Any]:
        from rlhf.distributed.watchdog import phase, set_phase, set_step

        task, engine, mesh, dp = self.task, self.engine, self.mesh, self.mesh.dp
        ckpt, eval_steps = self.job.checkpoint, self.job.data.eval_steps
        mbs = self.job.batch.micro_train_batch_size
        eval_batches = self.batches([evals[i:i + mbs] for i in range(0, len(evals), mbs)])
        eval_batches = eval_batches[mesh.dp_rank::dp] if len(eval_batches) >= dp else eval_batches[:0]
        result: dict[str, Any] = {}
        loss_fn = task.loss_fn(engine)
        start_step = step
        from rlhf.observability.profiling import StepProfiler

        profiler = StepProfiler(self.job.checkpoint.save_path, mesh.is_rank0)
        set_phase("train")  # between the named phases below
        while step < self.total_steps:
            if 0 <= ckpt.stop_after_steps <= step - start_step:
                log.info("stopping after %d steps (--stop_after_steps)", ckpt.stop_after_steps)
                self.metrics_log.close()
                return result
            set_step(step + 1)
            with phase("update"), profiler.step(step + 1):
                result["train"] = self.train_step(train, loss_fn, step + 1)
            step += 1
            if eval_steps > 0 and step % eval_steps == 0 and step < self.total_steps:
                with phase("eval"):
                    self.metrics_log.log(step, task.evaluate(engine, eval_batches), prefix="eval", progress=False)
            if (ckpt.save_steps > 0 and step % ckpt.save_steps == 0) or step == self.total_steps:
                self.ckpt.save(step, {task.name: engine}, {"sampler": self.sampler.state_dict()})
        if eval_batches:
            with phase("eval"):
                result["eval"] = task.evaluate(engine, eval_batches)
            self.metrics_log.log(step, result["eval"], prefix="eval", progress=False)
        return self.export(train, result)

    def train_step(self, train: list, loss_fn, step: int) -> dict[str, float]:
        """Optimizer step number ``step``: its micro-batches, the update, throughput, logging."""
        from rlhf.distributed.faults import fault_point

        task, engine, mesh = self.task, self.engine, self.mesh
        microbatches = self.batches([[train[i] for i in idx] for idx in self.sampler.next_step()])
        cuda = mesh.device.type == "cuda"
        if cuda:  # the step's peak device memory, as PPO's phases log theirs (rlhf.observability.metrics.PhaseTimer)
            torch.cuda.reset_peak_memory_stats(mesh.device)
        t0 = time.time()
        pre = task.before_step(engine, microbatches) if hasattr(task, "before_step") else {}
        m = engine.train_step(microbatches, loss_fn, task.metric_keys, output=task.output)
        m.update(pre)
        if cuda:
            m["mem/peak_gb"] = torch.cuda.max_memory_allocated(mesh.device) / 2**30
        ntok = torch.tensor([tokens_in(microbatches)], dtype=torch.float64)
        fault_point("collective")
        dist.all_reduce(ntok)
        m["tokens_per_s"] = ntok.item() / mesh.tp / mesh.pp / mesh.cp / max(time.time() - t0, 1e-9)
        m["epoch"] = self.sampler.epoch_float
        if step % self.job.logging.logging_steps == 0 or step == self.total_steps:
            self.metrics_log.log(step, m)
        return m

    def export(self, train: list, result: dict[str, Any]) -> dict[str, Any]:
        """The task's statistics over the training data (e.g. reward mean/std), then the HF export."""
        from rlhf.runtime.checkpoint import export_hf

        args, mesh, mbs = self.args, self.mesh, self.job.batch.micro_train_batch_size
        train_batches = self.batches([train[i:i + mbs] for i in range(0, len(train), mbs)])
        extra = self.task.export_extra(self.engine, train_batches[mesh.dp_rank::mesh.dp])
        result.update(extra)
        export_hf(args, self.engine, mesh, extra)
        if hasattr(self.task, "after_export"):
            self.task.after_export(self.job, mesh)
        self.metrics_log.close()
        if mesh.is_rank0:
            with open(os.path.join(self.job.checkpoint.save_path, "train_result.json"), "w") as f:
                json.dump(result, f, indent=2)
        return result


def main(task_mod, argv=None) -> int:
    """The body of ``launch/sft.py`` and ``launch/rm.py``: flags of ``task_mod``, run its task, ``error:`` line
    and exit 2 on bad input."""
    from rlhf.config.job import cli_main

    return cli_main(task_mod.add_args, lambda args: run(args, task_mod.TASK(), task_mod.TASK_PARTS), argv)
