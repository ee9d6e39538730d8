"""What a save writes, counted before it is written: ``saved_bytes`` (summed over ranks) lets a checkpoint save
(``rlhf.runtime.checkpoint``) and the final HF export (``rlhf.runtime.export``) refuse one that cannot fit on the disk."""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist


def saved_bytes(engines: Mapping[str, Any], mesh: Any, optimizer: bool = True) -> float:
    """What a save of ``engines`` writes, summed over ranks (a collective): each parameter shard once per
    data-parallel group (expert weights once per expert-data-parallel group), and with ``optimizer`` the optimizer
    states and fp32 main params once (sharded with ZeRO-1, else replicated like their parameter)."""
    from rlhf.runtime.offload import torch_optimizers

    def replicas(p) -> int:  # megatron marks expert weights under EP > 1 allreduce=False: replicated dp/ep times
        return mesh.dp * mesh.cp if getattr(p, "allreduce", True) else max(1, mesh.dp // mesh.ep)

    local = 0.0
    for eng in engines.values():
        local += sum(p.numel() * p.element_size() / replicas(p) for p in eng.model.parameters())
        if not optimizer:
            continue
        model_params = {id(p) for p in eng.model.parameters()}
        opts = torch_optimizers(getattr(eng, "optimizer", None))
        sharded = uses_distributed_optimizer(eng)  # then each rank's states are its own shard: saved once
        local += sum(t.numel() * t.element_size() / (1 if sharded else replicas(p)) for opt in opts
                     for p, st in opt.state.items() for t in st.values() if isinstance(t, torch.Tensor))
        # fp32 main params (mixed precision, or the distributed optimizer's shards) are saved beside the model
        local += sum(p.numel() * p.element_size() / (1 if sharded else replicas(p)) for opt in opts
                     for g in opt.param_groups for p in g["params"] if id(p) not in model_params)
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total.item())


def uses_distributed_optimizer(engine: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opt = getattr(engine, "optimizer", None)
    return opt is not None and any(isinstance(o, DistributedOptimizer)
                                   for o in getattr(opt, "chained_optimizers", [opt]))
