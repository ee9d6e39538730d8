"""Data-parallel gradient all-reduce through shared memory, for gloo groups whose ranks share one host (CPU jobs).

gloo moves an all-reduce through TCP loopback. On one host the ranks can instead read each other's numbers from
one shared-memory segment: each rank writes the parts of its buffer that the others reduce, reduces its own part
(``1/W`` of the buffer) from everyone's copies, publishes it, and reads the others' reduced parts back. Measured
on a 2-core CPU, 2 ranks, fp32, with megatron's scaling pass: 105 MB in 46 ms against gloo's 98 ms, 538 MB in
209 ms against 440 ms (``bench/allreduce.py``). This is the gradient all-reduce of megatron's DDP at ZeRO 0,
which a CPU job uses; ``install_on_ddp`` routes its bucket groups here.

Results: each part is reduced by exactly one rank and copied to the others, so every rank holds the same bits. The
sum of part ``r`` is taken as rank ``r``'s value plus the others' in rank order; with 2 ranks that is gloo's own
result bit for bit (a sum of two is commutative). The buffer is scaled before it is summed, as megatron does
(``grad_data *= gradient_scaling_factor``, then a sum), folded into the copy that writes it.

The segment lives in ``/dev/shm``, is unlinked as soon as every rank has mapped it (nothing is left behind if a
rank dies), and holds ``W`` slots of at most ``CHUNK_BYTES`` each: a larger buffer goes through in chunks, and where
``/dev/shm`` is small (a container's) the slots shrink to fit. ``RLHF_CPU_SHM_ALLREDUCE=0`` keeps gloo's
all-reduce; so does any group that is not gloo, spans hosts, or has one rank, and a host without a writable
``/dev/shm`` or with almost no room in it. The choice is logged once per group.
"""
from __future__ import annotations

import logging
import os
import socket
import types
import uuid
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ENV = "RLHF_CPU_SHM_ALLREDUCE"
CHUNK_BYTES = 32 << 20
"""The most one rank's slot holds; larger buffers go through in chunks of this many bytes."""
SHM_DIR = "/dev/shm"
MIN_SLOT_BYTES = 1 << 20
"""Below this per-rank slot (where ``/dev/shm`` is nearly full), the group keeps gloo's all-reduce."""

_reducers: dict[Any, "ShmAllReduce | None"] = {}


def why_not(group: Any) -> str | None:
    """Why ``group``'s all-reduce cannot go through shared memory (None: it can). Collective over ``group``."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    size = dist.get_world_size(group)
    if size == 1:
        return "one rank"
    if dist.get_backend(group) != "gloo":
        return f"backend {dist.get_backend(group)}"
    ok = os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
    hosts: list[Any] = [None] * size
    dist.all_gather_object(hosts, (socket.gethostname(), _boot_id(), ok), group=group)
    if len({h[:2] for h in hosts}) > 1:
        return "ranks on more than one host"
    if not all(h[2] for h in hosts):
        return f"no writable {SHM_DIR}"
    return None


def _shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def for_group(group: Any) -> "ShmAllReduce | None":
    """The shared-memory all-reduce of ``group`` (one per group, made on first use), or None where gloo's is kept
    (``why_not``; logged once per group). Collective over ``group`` the first time."""
    if group not in _reducers:
        reason = why_not(group)
        size = dist.get_world_size(group)
        if reason is None:
            _reducers[group] = ShmAllReduce(group)
            log.info("gradient all-reduce over %d ranks: shared memory (%s, chunks of %d MiB; %s=0 keeps gloo's)",
                     size, SHM_DIR, CHUNK_BYTES >> 20, ENV)
        else:
            _reducers[group] = None
            if size > 1:
                log.info("gradient all-reduce over %d ranks: %s's (not shared memory: %s)", size,
                         dist.get_backend(group), reason)
    return _reducers[group]


class ShmAllReduce:
    """In-place sum over one single-host gloo group, through a shared-memory segment (see the module docstring)."""

    def __init__(self, group: Any):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.slot_bytes = 0
        self.asked = 0  # the largest slot asked for: slots shrunk to a small /dev/shm are not re-mapped per call
        self.scratch: torch.Tensor | None = None  # uint8 [size, slot_bytes], shared by the group's ranks
        self.disabled = ""  # why gloo's all-reduce took over (no room in /dev/shm)

    def _map(self, slot_bytes: int) -> None:
        """(Re)map a segment of ``size x slot_bytes`` bytes on every rank of the group. Where ``/dev/shm`` has less
        than twice that free (a container's default is 64 MB, and a write past it kills the process with SIGBUS),
        the slots shrink to what fits, down to ``MIN_SLOT_BYTES``; below that the current segment is kept, or, with
        none, this group keeps gloo's all-reduce from then on. Collective; rank 0 decides."""
        msg: list[Any] = [None]
        if self.rank == 0:
            free = _shm_free_bytes()
            slot = min(slot_bytes, (free // 2 // self.size) // 64 * 64)
            if slot == slot_bytes or slot >= MIN_SLOT_BYTES:
                msg = [("map", os.path.join(SHM_DIR, f"rlhf-allreduce-{uuid.uuid4().hex}"), slot)]
                torch.from_file(msg[0][1], shared=True, size=self.size * slot, dtype=torch.uint8)  # creates it
            elif self.scratch is not None:
                msg = [("keep",)]
            else:
                msg = [("off", f"{SHM_DIR} has {free >> 20} MiB free")]
        dist.broadcast_object_list(msg, src=dist.get_global_rank(self.group, 0), group=self.group)
        what = msg[0]
        if what[0] == "off":
            self.disabled = what[1]
            log.warning("gradient all-reduce over %d ranks: gloo's from now on (%s)", self.size, what[1])
        elif what[0] == "map":
            _, name, slot = what
            self.scratch = None  # the old mapping goes before the new one fills
            scratch = torch.from_file(name, shared=True, size=self.size * slot, dtype=torch.uint8)
            dist.barrier(group=self.group)
            if self.rank == 0:
                os.unlink(name)  # the mappings keep the memory; nothing is left in /dev/shm
            self.scratch, self.slot_bytes = scratch.view(self.size, slot), slot

    def all_reduce(self, x: torch.Tensor, scale: float = 1.0) -> None:
        """``x`` becomes the sum over the group of every rank's ``x * scale`` (``scale`` applied first, as megatron
        scales the gradient buffer before its all-reduce). ``x``: contiguous, on CPU, the same numel and dtype on
        every rank."""
        if not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"shared-memory all-reduce needs a contiguous CPU tensor, got {x.device} "
                             f"contiguous={x.is_contiguous()}")
        flat, esize = x.view(-1), x.element_size()
        if flat.numel() == 0:
            return
        need = min(CHUNK_BYTES, flat.numel() * esize)
        need = -(-need // 64) * 64  # whole cache lines, and a whole number of elements of any dtype
        if need > self.asked and not self.disabled:
            self.asked = need
            self._map(need)
        if self.disabled:
            if scale != 1.0:
                x.mul_(scale)
            dist.all_reduce(x, group=self.group)
            return
        per, slots = self.slot_bytes // esize, self.scratch.view(x.dtype)  # slots: [size, per]
        for start in range(0, flat.numel(), per):
            self._chunk(flat[start:start + per], slots, scale)

    def _chunk(self, c: torch.Tensor, slots: torch.Tensor, scale: float) -> None:
        n, r, w = c.numel(), self.rank, self.size
        bounds = [n * q // w for q in range(w + 1)]
        part = [slice(bounds[q], bounds[q + 1]) for q in range(w)]
        for q in range(w):  # 1. write what the others reduce (scaled), scale what this rank reduces
            if q == r:
                if scale != 1.0:
                    c[part[q]].mul_(scale)
            elif scale != 1.0:
                torch.mul(c[part[q]], scale, out=slots[r, part[q]])
            else:
                slots[r, part[q]].copy_(c[part[q]])
        dist.barrier(group=self.group)
        own = c[part[r]]
        for q in range(w):  # 2. reduce this rank's part: its own value, then the others' in rank order
            if q != r:
                own.add_(slots[q, part[r]])
        slots[r, part[r]].copy_(own)
        dist.barrier(group=self.group)
        for q in range(w):  # 3. read the others' reduced parts
            if q != r:
                c[part[q]].copy_(slots[q, part[q]])
        dist.barrier(group=self.group)  # before the next chunk (or call) writes the slots again


# ------------------------------------------------------------------------------------------------ megatron DDP
def _start_grad_sync(self, force_all_reduce: bool = False) -> None:
    """megatron's ``_ParamAndGradBucketGroup.start_grad_sync`` for ZeRO 0 without overlap (the only case
    ``install_on_ddp`` routes here): the same checks and scaling, the sum through shared memory."""
    if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
        self.check_grads(check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
                         check_for_large=self.ddp_config.check_for_large_grads)
    for bucket in self.buckets:
        self._shm_reducer.all_reduce(bucket.grad_data, scale=float(bucket.gradient_scaling_factor))
    self.grad_reduce_handle = None


def install_on_ddp(ddp: Any) -> int:
    """Route the gradient all-reduce of megatron DDP ``ddp``'s bucket groups through shared memory where it can go
    (``for_group``): ZeRO 0, no overlap, sum (not average) in the collective, one optimizer instance, CPU buffers.
    Returns the number of bucket groups routed. Collective over the data-parallel groups."""
    cfg = ddp.ddp_config
    if (cfg.use_distributed_optimizer or cfg.overlap_grad_reduce or cfg.average_in_collective
            or cfg.num_distributed_optimizer_instances != 1):
        return 0
    routed = 0
    for bg in list(ddp.bucket_groups) + list(getattr(ddp, "expert_parallel_bucket_groups", [])):
        if any(b.grad_data.device.type != "cpu" for b in bg.buckets):
            continue
        reducer = for_group(bg.data_parallel_group)
        if reducer is not None:
            bg._shm_reducer = reducer
            bg.start_grad_sync = types.MethodType(_start_grad_sync, bg)
            routed += 1
    return routed
