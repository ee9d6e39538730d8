"""The frozen reference of the preference workflows (DPO, KTO), on the shared trainer loop (rlhf/supervised/loop.py).

The reference is a second, frozen ``ModelRole`` with the policy's TP/PP layout, from ``--ref_pretrain``
(default ``--pretrain``). Its sequence log-probs are computed once per step, forward only, before the policy's
train step (``before_step``), and attached to the micro-batches; eval batches get theirs once (the reference
is frozen). With PP both engines' last stages are the same ranks, which is where the loss reads them.
"""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.algo.losses import next_token_logprobs
from rlhf.config.part import Part, flag

log = logging.getLogger("rlhf")


@dataclass
class ReferencePart(Part):
    """The frozen reference of DPO and KTO."""

    GROUP = "reference model"

    ref_pretrain: str | None = flag(default=None, help="frozen reference model (default: --pretrain)")
    """(--ref_pretrain) default: --pretrain"""
    ref_offload: bool = flag(action="store_true", default=False,
                             help="keep the reference's weights in host memory between its forwards")
    """(--ref_offload) its weights in host memory between its forwards"""
    beta: float = flag(type=float, default=0.1, help="strength of the implicit KL to the reference")
    """(--beta) strength of the implicit KL to the reference"""

    def check(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"--beta must be > 0, got {self.beta}")


add_reference_args = ReferencePart.add_args


def sequence_logprobs(engine, batch: dict, logits: torch.Tensor, inplace_backward: bool = False) -> torch.Tensor:
    """Sum of log p(response tokens) per row: logits (R, S, V_local) vocab-parallel -> (R,) fp32. Under context
    parallelism (a loss or reader marked ``reads_local_tokens``) the logits are this rank's tokens (R, S_local,
    V_local)."""
    from rlhf.models.context_parallel import current_layout

    mesh = engine.mesh
    lp = next_token_logprobs(logits, batch["input_ids"], tp_group=mesh.tp_group if mesh.tp > 1 else None,
                             vocab_size=engine.spec.vocab_size, inplace_backward=inplace_backward,
                             cp=current_layout())  # (R, S-1)
    return (lp * batch["loss_mask"][:, 1:].to(lp.dtype)).sum(-1)


class Reference:
    """The frozen reference engine and its log-probs. ``--ref_offload``: its weights live in host memory between
    its forwards (``rlhf.runtime.offload.OffloadManager``; on a CPU device only with ``RLHF_OFFLOAD_ON_CPU=1``)."""

    def __init__(self, job, mesh) -> None:
        """``job``: the ``SupervisedJob``, whose ``task["reference"]`` is the ``ReferencePart``."""
        from rlhf.runtime.role import ModelRole

        ref = job.task["reference"]
        path = ref.ref_pretrain or job.model.pretrain
        self.engine = ModelRole(mesh, path, value_head=False, bf16=job.engine.bf16, name="ref",
                                  transformer_impl=job.engine.transformer_impl)
        self.offload = None
        if ref.ref_offload:
            from rlhf.runtime.offload import OffloadManager, cpu_offload_moves

            # As PPO does: on a CPU device the host is the device, so a copy cannot lower peak memory and nothing
            # moves unless RLHF_OFFLOAD_ON_CPU=1 (which the tests set, so the CUDA code path runs on CPU).
            if mesh.device.type != "cpu" or cpu_offload_moves():
                self.offload = OffloadManager(self.engine, name="ref")
                self.offload.offload(params=True, grads=False, optimizer=False)
            if mesh.is_rank0:
                log.info("--ref_offload: %s", "the reference's weights stay in host memory between its forwards"
                         if self.offload is not None else "the device is the CPU, so the reference's weights stay "
                         "where they are (RLHF_OFFLOAD_ON_CPU=1 copies them anyway)")

    def attach(self, microbatches: list[dict]) -> float:
        """Set ``mb["ref_logps"]`` (R,) on the last pipeline stage (None elsewhere). Returns the seconds taken."""
        from rlhf.models.context_parallel import reads_local_tokens

        t0 = time.time()
        if self.offload is not None:
            self.offload.onload(params=True, grads=False, optimizer=False)
        eng = self.engine
        outs = eng.forward(microbatches, read=reads_local_tokens(lambda b, out: sequence_logprobs(eng, b, out)))
        if self.offload is not None:
            self.offload.offload(params=True, grads=False, optimizer=False)
        if not outs:
            outs = [{"output": None}] * len(microbatches)
        for mb, o in zip(microbatches, outs):
            mb["ref_logps"] = o["output"]
        return time.time() - t0

    def attach_once(self, microbatches: list[dict]) -> None:
        """``attach`` unless already done (eval batches: the reference does not change)."""
        if microbatches and "ref_logps" not in microbatches[0]:
            self.attach(microbatches)


class ReferenceTask:
    """What DPO and KTO share: the reference (``setup``), per-step reference log-probs (``before_step``) and
    flag checks. Subclasses define ``load_data``, ``collate``, ``loss_fn`` and ``metric_keys``."""

    value_head = False
    output = "head"

    def validate(self, job) -> None:
        """Against the other parts and the models (``ReferencePart.check`` checked --beta)."""
        if job.engine.packing_samples:
            raise ValueError(f"--packing_samples is not supported by {self.name} yet; drop the flag")
        path, pretrain = job.task["reference"].ref_pretrain, job.model.pretrain
        if path:
            from rlhf.models.source import describe_source

            try:
                ref, pol = describe_source(path)["spec"], describe_source(pretrain)["spec"]
            except ValueError as e:
                raise ValueError(f"--ref_pretrain {path}: {e}") from None
            if ref.vocab_size != pol.vocab_size:
                raise ValueError(f"--ref_pretrain {path} has vocab size {ref.vocab_size}, --pretrain "
                                 f"{pretrain} has {pol.vocab_size}: they must share a tokenizer")

    def setup(self, job, mesh, engine) -> None:
        self.job = job
        self.ref = Reference(job, mesh)

    def before_step(self, engine, microbatches: list[dict]) -> dict[str, float]:
        return {"time/ref_fwd": self.ref.attach(microbatches)}

    def evaluate(self, engine, batches: list[dict]) -> dict[str, float]:
        self.ref.attach_once(batches)
        outs = engine.forward(batches, loss_fn=self.loss_fn(engine))
        return engine.reduce_metrics(outs, self.metric_keys)

    def export_extra(self, engine, batches: list[dict]) -> dict[str, Any]:
        return {}
