"""Collectives over the mesh's groups that more than one workflow needs (PPO's experience, reward scoring,
conditional SFT). Each takes the ``ParallelMesh`` and uses only its groups."""
from __future__ import annotations

import torch
import torch.distributed as dist


def to_all_stages(t: torch.Tensor | None, shape: tuple, mesh) -> torch.Tensor:
    """A last-stage result on every pipeline stage (a no-op without PP). ``shape`` is the result's shape, which
    the other stages do not know; they receive it as fp32."""
    if mesh.pp == 1:
        return t
    buf = t.contiguous().float() if mesh.is_last_stage else torch.empty(shape, dtype=torch.float32,
                                                                          device=mesh.device)
    dist.broadcast(buf, src=dist.get_global_rank(mesh.pp_group, mesh.pp - 1), group=mesh.pp_group)
    return buf


def dp_all_gather(t: torch.Tensor, mesh) -> torch.Tensor:
    """Concatenate a per-DP-rank tensor over the DP group, in DP-rank order (dim 0)."""
    from rlhf.distributed.faults import fault_point

    if mesh.dp == 1:
        return t
    fault_point("collective")
    parts = [torch.empty_like(t) for _ in range(mesh.dp)]
    dist.all_gather(parts, t.contiguous(), group=mesh.dp_group)
    return torch.cat(parts)
