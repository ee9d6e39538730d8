"""The parallel layout of the job as one object: megatron-core's TP/PP/DP groups plus this rank's place in them.

Everything that needs a process group receives a ``ParallelMesh``; nothing else reads megatron's
``parallel_state`` globals (megatron itself still does, internally).
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlhf.distributed.env import DistEnv

log = logging.getLogger(__name__)


@dataclass
class ParallelMesh:
    """TP x PP x DP layout (megatron order: TP fastest, then DP, then PP) and the groups that go with it."""

    env: DistEnv
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any
    backend: str
    device: torch.device

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_rank0(self) -> bool:
        return self.env.rank == 0

    def barrier(self) -> None:
        dist.barrier()

    def destroy(self) -> None:
        destroy_mesh()


def validate_layout(world_size: int, tp: int, pp: int) -> int:
    """Check the TP/PP flags against the world size before anything is started; returns DP."""
    if tp < 1:
        raise ValueError(f"--tensor_model_parallel_size must be >= 1, got {tp}")
    if pp < 1:
        raise ValueError(f"--pipeline_model_parallel_size must be >= 1, got {pp}")
    if world_size % (tp * pp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by --tensor_model_parallel_size {tp} x "
                         f"--pipeline_model_parallel_size {pp}")
    return world_size // (tp * pp)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(env: DistEnv | None = None, timeout_s: float = 600.0) -> DistEnv:
    """Start torch.distributed from whichever launcher started us (gloo without CUDA, nccl with it)."""
    env = env or DistEnv.from_environ()
    if dist.is_initialized():
        return env
    env.export()
    backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    try:
        dist.init_process_group(backend=backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                rank=env.rank, world_size=env.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # torch raises several types (DistStoreError, RuntimeError) for a failed rendezvous
        raise RuntimeError(f"process-group init failed for rank {env.rank}/{env.world_size} via {env.launcher} at "
                           f"MASTER_ADDR={env.master_addr} MASTER_PORT={env.master_port}: {e}") from e
    return env


def initialize_mesh(tp: int = 1, pp: int = 1, env: DistEnv | None = None, seed: int = 1234,
                    timeout_s: float = 600.0) -> ParallelMesh:
    """Start the process group if needed, build megatron's TP/PP/DP groups and seed its RNG tracker."""
    env = env or DistEnv.from_environ()
    dp = validate_layout(env.world_size, tp, pp)
    from rlhf.distributed import cuda_shim

    cuda_shim.install()
    env = init_process_group(env, timeout_s)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        _destroy_megatron_groups()
    before = _live_groups()
    # On gloo every group already is a gloo group: megatron's extra *_gloo copies would double the threads.
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 create_gloo_process_groups=backend_is_nccl())
    global _MEGATRON_GROUPS
    _MEGATRON_GROUPS = [g for g in _live_groups() if g not in before]
    cuda_shim.install()  # rebind modules that megatron imported lazily
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mesh = ParallelMesh(env=env, tp=tp, pp=pp, dp=dp,
                        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                        dp_rank=ps.get_data_parallel_rank(), tp_group=ps.get_tensor_model_parallel_group(),
                        pp_group=ps.get_pipeline_model_parallel_group(), dp_group=ps.get_data_parallel_group(),
                        backend=backend, device=device)
    if env.rank == 0:
        log.info("mesh: world=%d tp=%d pp=%d dp=%d backend=%s launcher=%s", env.world_size, tp, pp, dp, backend,
                 env.launcher)
    return mesh


_MEGATRON_GROUPS: list = []


def backend_is_nccl() -> bool:
    return dist.get_backend() == "nccl"


def _live_groups() -> list:
    return [g for g in dist.distributed_c10d._world.pg_map if g is not dist.group.WORLD]


def _destroy_megatron_groups() -> None:
    """megatron's ``destroy_model_parallel`` forgets its groups without destroying them; each gloo group keeps
    its threads, so re-initialising a layout (tests, layout changes) would pile up thousands of threads."""
    from megatron.core import parallel_state as ps

    global _MEGATRON_GROUPS
    ps.destroy_model_parallel()
    live = set(_live_groups())
    for g in _MEGATRON_GROUPS:
        if g in live:
            dist.destroy_process_group(g)
    _MEGATRON_GROUPS = []


def destroy_mesh() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        _destroy_megatron_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def set_single_thread() -> None:
    """Tests and CPU jobs run 1 thread per rank; 2 ranks on 2 cores otherwise fight over them."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
