"""The parallel layout of the job as one object: megatron-core's TP/PP/DP groups plus this rank's place in them.

Everything that needs a process group receives a ``ParallelMesh``. The mesh owns the megatron groups it created
and destroys them (``destroy_groups``). megatron's ``parallel_state`` is process-global, so one mesh is live per
process (``ParallelMesh.active``); megatron's layers and the model code built on them (``rlhf.models.gpt``,
``rlhf.models.pipeline``) read it, as megatron does; the trainers and workflows read only the mesh.
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from rlhf.distributed.env import DistEnv

log = logging.getLogger(__name__)


@dataclass
class ParallelMesh:
    """TP x PP x DP layout (megatron order: TP fastest, then DP, then PP) and the groups that go with it; for
    MoE models also EP (``--expert_model_parallel_size``), which divides DP: the experts of one layer are spread
    over ``ep`` consecutive DP ranks, everything else stays replicated over DP. With expert-TP 1 at TP > 1
    (``initialize_mesh(etp=1)``: biased experts) megatron's EP group runs over the TP ranks first instead (its
    expert order tp-ep-dp-pp); ``ep_rank`` and ``ep_group`` are always megatron's."""

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
    ep: int = 1
    """expert parallelism (MoE): each expert lives on one of ``ep`` ranks (megatron's EP group)"""
    ep_rank: int = 0
    ep_group: Any = None
    cp: int = 1
    """context parallelism (``--context_parallel_size``): each sequence split over ``cp`` ranks; carved out of DP as
    megatron does (its order tp-cp-ep-dp-pp), so ``dp`` and ``dp_group`` leave CP out: the ranks of one CP group
    see the same samples, and gradients are reduced over DP x CP"""
    cp_rank: int = 0
    cp_group: Any = None
    megatron_groups: list = field(default_factory=list, repr=False, compare=False)
    """the process groups megatron created for this mesh (megatron forgets them without destroying them)"""
    active: ClassVar["ParallelMesh | None"] = None
    """the mesh megatron's process-global ``parallel_state`` currently holds"""

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

    def destroy_groups(self) -> None:
        """megatron's groups of this mesh. megatron's ``destroy_model_parallel`` forgets its groups without
        destroying them; each gloo group keeps its threads, so re-initialising a layout (tests, layout changes)
        would pile up thousands of threads. The default group stays (vLLM's teardown needs it)."""
        from megatron.core import parallel_state as ps

        from rlhf.compat.megatron import live_process_groups

        if ParallelMesh.active is self:
            ps.destroy_model_parallel()
            ParallelMesh.active = None
        live = set(live_process_groups())
        for g in self.megatron_groups:
            if g in live:
                dist.destroy_process_group(g)
        self.megatron_groups.clear()

    def destroy(self) -> None:
        """Its groups, then the default group."""
        destroy_mesh(self)


def validate_layout(world_size: int, tp: int, pp: int, ep: int = 1, cp: int = 1) -> int:
    """Check the TP/PP/EP/CP flags against the world size before anything is started; returns DP (CP left out)."""
    if tp < 1:
        raise ValueError(f"--tensor_model_parallel_size must be >= 1, got {tp}")
    if pp < 1:
        raise ValueError(f"--pipeline_model_parallel_size must be >= 1, got {pp}")
    if cp < 1:
        raise ValueError(f"--context_parallel_size must be >= 1, got {cp}")
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by --tensor_model_parallel_size {tp} x "
                         f"--pipeline_model_parallel_size {pp}" + (f" x --context_parallel_size {cp}" if cp > 1
                                                                   else ""))
    dp = world_size // (tp * pp * cp)
    if ep < 1 or dp % ep:
        raise ValueError(f"--expert_model_parallel_size {ep} must be >= 1 and divide the data-parallel size {dp} "
                         f"(world {world_size} / tp {tp} / pp {pp}" + (f" / cp {cp})" if cp > 1 else ")"))
    return dp


def default_backend() -> str:
    """The backend a job on this machine gets (``rlhf.distributed.device``): gloo on CPU, gloo + NCCL on CUDA."""
    from rlhf.distributed.device import process_group_backend, select_device

    return process_group_backend(select_device(DistEnv.from_environ().local_rank))


def init_process_group(env: DistEnv | None = None, timeout_s: float | None = None,
                       device: torch.device | None = None) -> DistEnv:
    """Start torch.distributed from whichever launcher started us: gloo for a CPU job, ``cpu:gloo,cuda:nccl`` for
    a CUDA one (``device``: this rank's device; default ``select_device``). Checks one rank per GPU.

    ``timeout_s`` (``--dist_timeout_s``; default ``rlhf.distributed.watchdog.DEFAULT_TIMEOUT_S`` of the device)
    bounds the rendezvous and every collective of the default group; on CUDA, NCCL's watchdog aborts a timed-out
    collective (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, set to 1 unless given)."""
    from rlhf.distributed.watchdog import resolve_timeout_s
    from rlhf.distributed.device import check_one_rank_per_gpu, process_group_backend, select_device

    env = env or DistEnv.from_environ()
    if dist.is_initialized():
        return env
    env.export()
    device = device if device is not None else select_device(env.local_rank)
    backend = process_group_backend(device)
    timeout_s = resolve_timeout_s(timeout_s, device.type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent hosts the store and keeps it across restarts (--max-restarts): the keys of the
            # failed attempt (its ranks' gloo addresses) are still there, and torch 2.13's tcp:// and env://
            # handlers add no prefix for the attempt, so a restarted rank would dial a dead peer ("Connection
            # refused"). Each attempt gets its own key space.
            store = dist.PrefixStore(f"/rlhf/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
                                     dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                                                   timeout=timeout))
            dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size,
                                    timeout=timeout)
        else:
            dist.init_process_group(backend=backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                    rank=env.rank, world_size=env.world_size, timeout=timeout)
    except Exception as e:  # torch raises several types (DistStoreError, RuntimeError) for a failed rendezvous
        raise RuntimeError(f"process-group init failed for rank {env.rank}/{env.world_size} via {env.launcher} at "
                           f"MASTER_ADDR={env.master_addr} MASTER_PORT={env.master_port}: {e}") from e
    check_one_rank_per_gpu(device)
    return env


def initialize_mesh(tp: int = 1, pp: int = 1, env: DistEnv | None = None, seed: int = 1234,
                    timeout_s: float | None = None, device: str | torch.device | None = None,
                    ep: int = 1, cp: int = 1, etp: int | None = None) -> ParallelMesh:
    """Start the process group if needed, build megatron's TP/PP/(CP/)DP groups and seed its RNG tracker.

    ``timeout_s`` (``--dist_timeout_s``, default by device) bounds every collective of the job's groups; a job of
    more than one rank also starts the heartbeat watchdog (``rlhf.distributed.watchdog``) with it.

    ``device``: ``"cpu"`` keeps the job on the CPU (the converters do, beside a training job that holds the
    GPUs); default: ``rlhf.distributed.device.select_device`` (CUDA when torch can use a GPU).

    ``etp``: megatron's expert-TP, default ``tp`` (the experts split over the TP ranks like a dense MLP); 1 for the
    models whose experts carry biases (``rlhf.models.spec_families.expert_tensor_parallel``): each rank then holds its
    experts whole, and megatron's expert-parallel group runs over the TP ranks first (its order tp-ep-dp-pp)."""
    from rlhf.distributed.device import select_device

    env = env or DistEnv.from_environ()
    dp = validate_layout(env.world_size, tp, pp, ep, cp)
    if dist.is_initialized():  # the group's backend decides: a CUDA job has NCCL in it
        on_cuda = "nccl" in str(dist.get_backend())
        dev = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    else:
        dev = select_device(env.local_rank, str(device) if device is not None else None)
    from rlhf.compat import cuda as cuda_shim
    from rlhf.compat.megatron import live_process_groups

    cuda_shim.install(dev)
    from rlhf.distributed.watchdog import resolve_timeout_s, start_watchdog

    timeout_s = resolve_timeout_s(timeout_s, dev.type)
    env = init_process_group(env, timeout_s, dev)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ParallelMesh.active is not None:
        ParallelMesh.active.destroy_groups()
    elif ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    before = live_process_groups()
    # megatron's groups inherit the default group's backend, which already has gloo in it (CPU: gloo alone; CUDA:
    # cpu:gloo,cuda:nccl): its extra *_gloo copies would only double the threads.
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=tp if etp is None else etp,
                                 context_parallel_size=cp, create_gloo_process_groups=False,
                                 distributed_timeout_minutes=timeout_s / 60)
    if ep > 1 and etp in (None, tp):  # the experts' TP shards: the same ranks as TP (weight sync relies)
        assert dist.get_process_group_ranks(ps.get_expert_tensor_parallel_group()) == \
            dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    groups = [g for g in live_process_groups() if g not in before]
    cuda_shim.install(dev)  # rebind modules that megatron imported lazily
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    backend = str(dist.get_backend())
    mesh = ParallelMesh(env=env, tp=tp, pp=pp, dp=dp,
                        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                        dp_rank=ps.get_data_parallel_rank(), tp_group=ps.get_tensor_model_parallel_group(),
                        pp_group=ps.get_pipeline_model_parallel_group(), dp_group=ps.get_data_parallel_group(),
                        backend=backend, device=dev, megatron_groups=groups, ep=ep,
                        ep_rank=ps.get_expert_model_parallel_rank(),
                        ep_group=ps.get_expert_model_parallel_group() if ep > 1 else None, cp=cp,
                        cp_rank=ps.get_context_parallel_rank(),
                        cp_group=ps.get_context_parallel_group() if cp > 1 else None)
    ParallelMesh.active = mesh
    if env.launcher != "single":  # a launched job (the converters' in-process single rank has no launcher)
        start_watchdog(env.rank, env.world_size, env.master_addr, env.master_port, timeout_s)
    if env.rank == 0:
        log.info("mesh: world=%d tp=%d pp=%d dp=%d%s%s backend=%s device=%s launcher=%s", env.world_size, tp, pp,
                 dp, f" ep={ep}" if ep > 1 else "", f" cp={cp}" if cp > 1 else "", backend, dev, env.launcher)
    return mesh


def destroy_mesh(mesh: ParallelMesh | None = None) -> None:
    """The mesh's megatron groups (default: the live mesh), then the default process group."""
    from rlhf.distributed.watchdog import finish_watchdog

    finish_watchdog()
    mesh = mesh or ParallelMesh.active
    if mesh is not None:
        mesh.destroy_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def set_single_thread() -> None:
    """Tests and CPU jobs run 1 thread per rank; 2 ranks on 2 cores otherwise fight over them."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
