"""``--enable_ema``: an exponential moving average of the actor's weights (DeepSpeed-Chat's and OpenRLHF's flag),
``ema = beta * ema + (1 - beta) * actor`` after each actor optimizer step, exported as its own HF model under
``<save_path>/ema``.

The average is a frozen ``ModelEngine`` of the actor's architecture and layout, so each rank averages its own
shards, checkpoints carry it (role ``ema``) and a resumed run continues it exactly. Between updates its weights
live in host memory when the device is a GPU (``OffloadManager``)."""
from __future__ import annotations

import argparse
import os

import torch


class ActorEMA:
    def __init__(self, args: argparse.Namespace, actor, mesh):
        from rlhf.engine import ModelEngine
        from rlhf.offload import OffloadManager, cpu_offload_moves

        self.beta = float(args.ema_beta)
        self.engine = ModelEngine(mesh, args.pretrain, value_head=False, name="ema", bf16=args.bf16,
                                  transformer_impl=args.transformer_impl)
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
        from rlhf.checkpoint import export_hf

        if self.offload is not None:
            self.offload.onload(params=True, grads=False, optimizer=False)
        out = argparse.Namespace(**{**vars(args), "save_path": os.path.join(args.save_path, "ema")})
        export_hf(out, self.engine, mesh, {"ppo_steps": step, "ema_beta": self.beta})


def check_ema_args(args: argparse.Namespace) -> None:
    if not getattr(args, "enable_ema", False):
        return
    if not 0.0 <= args.ema_beta <= 1.0:
        raise ValueError(f"--ema_beta must be in [0, 1], got {args.ema_beta}")
    if getattr(args, "lora_rank", 0):
        raise ValueError("--enable_ema with --lora_rank: the average of LoRA adapters is not implemented; drop one")
