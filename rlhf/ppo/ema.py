"""``--enable_ema``: an exponential moving average of the actor's weights (DeepSpeed-Chat's and OpenRLHF's flag),
``ema = beta * ema + (1 - beta) * actor`` after each actor optimizer step, exported as its own HF model under
``<save_path>/ema``.

The average is a frozen ``ModelRole`` of the actor's architecture and layout, so each rank averages its own
shards, checkpoints carry it (role ``ema``) and a resumed run continues it exactly. Between updates its weights
live in host memory when the device is a GPU (``OffloadManager``)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

from rlhf.config.part import Part, flag


@dataclass
class EmaPart(Part):
    """--enable_ema: the moving average of the actor."""

    enable_ema: bool = flag(action="store_true", help="keep an exponential moving average of the actor; exported to "
                                                      "<save_path>/ema", default=False)
    """(--enable_ema) exported to <save_path>/ema"""
    ema_beta: float = flag(type=float, help="--enable_ema: ema = beta * ema + (1 - beta) * actor", default=0.992)
    """(--ema_beta) ema = beta * ema + (1 - beta) * actor"""


    def check(self) -> None:
        if self.enable_ema and not 0.0 <= self.ema_beta <= 1.0:
            raise ValueError(f"--ema_beta must be in [0, 1], got {self.ema_beta}")


class ActorEMA:
    def __init__(self, cfg: EmaPart, pretrain: str, engine, actor, mesh):
        """``engine``: the job's ``EnginePart`` (precision, layer implementation)."""
        from rlhf.runtime.role import ModelRole
        from rlhf.runtime.offload import OffloadManager, cpu_offload_moves

        self.beta = float(cfg.ema_beta)
        self.engine = ModelRole(mesh, pretrain, value_head=False, name="ema", bf16=engine.bf16,
                                  transformer_impl=engine.transformer_impl)
        self.engine.ckpt_prefix = "ema."
        self.offload = OffloadManager(self.engine, name="ema") if (mesh.device.type != "cpu"
                                                                   or cpu_offload_moves()) else None
        self.pairs = list(zip(self.engine.model.parameters(), actor.model.parameters()))
        self._park()

    def _park(self) -> None:
        if self.offload is not None:
            self.offload.offload(params=True, grads=False, optimizer=False)

    @torch.no_grad()
    def update(self) -> None:
        """After an actor optimizer step."""
        if self.offload is not None:
            self.offload.onload(params=True, grads=False, optimizer=False)
        for ema, param in self.pairs:
            ema.mul_(self.beta).add_(param.detach().to(ema.dtype), alpha=1.0 - self.beta)
        self._park()

    def export(self, args: argparse.Namespace, mesh, step: int) -> None:
        from rlhf.runtime.checkpoint import export_hf

        if self.offload is not None:
            self.offload.onload(params=True, grads=False, optimizer=False)
        out = argparse.Namespace(**{**vars(args), "save_path": os.path.join(args.save_path, "ema")})
        export_hf(out, self.engine, mesh, {"ppo_steps": step, "ema_beta": self.beta})


def check_ema_args(ema: EmaPart, lora_rank: int) -> None:
    """--enable_ema against the actor's LoRA (``EmaPart.check`` checked --ema_beta)."""
    if ema.enable_ema and lora_rank:
        raise ValueError("--enable_ema with --lora_rank: the average of LoRA adapters is not implemented; drop one")
