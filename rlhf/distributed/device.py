"""The one device rule: which device a rank computes on, the process-group backend that goes with it, and moving
data there. Device-specific code lives here and in ``rlhf/compat/cuda.py``; the rest of the library only reads
``mesh.device``.

* CPU (no usable GPU, or ``RLHF_DEVICE=cpu``): gloo, every tensor on the CPU.
* CUDA: one GPU per rank (``cuda:LOCAL_RANK``, or ``cuda:0`` when each rank sees one GPU of its own through
  ``CUDA_VISIBLE_DEVICES``). The default process group is ``cpu:gloo,cuda:nccl`` and megatron's groups inherit it,
  so CUDA tensors go through NCCL and the small host-side bookkeeping tensors (metric sums, object gathers)
  through gloo instead of being rejected by NCCL. Models are built on, or moved to, ``mesh.device`` before
  megatron's DDP / ``Float16Module`` wrap them; every micro-batch is moved there in the pipeline's forward step.

Problems are reported before any model loads, each in one line with its fix: a GPU torch cannot use (driver
too old for the CUDA build, no driver), more ranks on a node than GPUs, two ranks on one GPU.
"""
from __future__ import annotations

import dataclasses
import glob
import logging
import os
import shutil
import socket
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)

DEVICE_ENV = "RLHF_DEVICE"
"""``cpu`` or ``cuda`` forces the device; unset picks CUDA when torch can use a GPU."""


def gpu_present() -> bool:
    """An NVIDIA GPU is visible to the OS (device files or ``nvidia-smi``), whether or not torch can use it."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def _cuda_unusable_reason() -> str:
    try:
        torch.cuda.init()
    except Exception as e:  # torch raises RuntimeError/AssertionError with the driver's own words
        return str(e).strip().splitlines()[0]
    return "torch.cuda.is_available() is False"


def select_device(local_rank: int, requested: str | None = None) -> torch.device:
    """The device of a rank with this ``LOCAL_RANK``. ``requested``: ``cpu``, ``cuda`` or None (``RLHF_DEVICE``,
    else auto). Raises ValueError/RuntimeError with the fix when a GPU is asked for (or present) but unusable."""
    requested = (requested or os.environ.get(DEVICE_ENV) or "auto").strip().lower()
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={requested!r}: expected cpu, cuda or unset (auto)")
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        cuda_build = torch.version.cuda is not None
        if requested == "cuda" or (cuda_build and gpu_present()):
            raise RuntimeError(
                f"a GPU is {'requested' if requested == 'cuda' else 'present'} but torch {torch.__version__} "
                f"(CUDA {torch.version.cuda or 'none: a CPU build'}) cannot use it: {_cuda_unusable_reason()}. "
                "Fix: a CUDA 13 build of torch needs NVIDIA driver >= 580 (update the driver, or install the torch "
                f"build that matches it); {DEVICE_ENV}=cpu runs on the CPU instead")
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if n > 1 and local_rank >= n:
        raise ValueError(f"LOCAL_RANK={local_rank} but this node has {n} visible GPUs: start at most {n} ranks per "
                         f"node (torchrun --nproc_per_node {n}); a GPU holds one rank")
    return torch.device("cuda", local_rank if n > 1 else 0)


def process_group_backend(device: torch.device) -> str:
    """gloo for a CPU job; NCCL for CUDA tensors plus gloo for host tensors in a CUDA job."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def duplicate_gpus(entries: Sequence[tuple[str, str]]) -> dict[tuple[str, str], list[int]]:
    """``entries[rank] = (host, gpu uuid)`` -> the GPUs that more than one rank uses, with those ranks."""
    seen: dict[tuple[str, str], list[int]] = {}
    for rank, key in enumerate(entries):
        seen.setdefault(tuple(key), []).append(rank)
    return {k: v for k, v in seen.items() if len(v) > 1}


def check_one_rank_per_gpu(device: torch.device) -> None:
    """After the process group is up: stop if two ranks landed on one GPU (NCCL would hang or fail later)."""
    import torch.distributed as dist

    if device.type != "cuda":
        return
    key = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    entries: list = [None] * dist.get_world_size()
    dist.all_gather_object(entries, key)
    dup = duplicate_gpus(entries)
    if dup:
        (host, uuid), ranks = next(iter(dup.items()))
        raise ValueError(f"ranks {ranks} share one GPU ({uuid} on {host}): NCCL needs one rank per GPU; start as "
                         "many ranks per node as it has GPUs (torchrun --nproc_per_node), or give each rank its own "
                         "GPU through CUDA_VISIBLE_DEVICES")


def to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``obj`` with every tensor moved to ``device``: tensors, dicts, lists, tuples and dataclasses (megatron's
    ``PackedSeqParams``) recursively; anything else unchanged. Tensors already there are returned as they are."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device, non_blocking)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_device(v, device, non_blocking) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: to_device(getattr(obj, f.name), device, non_blocking) for f in dataclasses.fields(obj)
                   if f.init and isinstance(getattr(obj, f.name), (torch.Tensor, dict, list, tuple))}
        return dataclasses.replace(obj, **changes) if changes else obj
    return obj
