"""Give device memory back between PPO phases: a role's params, grads and optimizer states go to host and return.

PPO colocates actor, critic, reference and reward models (and vLLM) on every GPU. The flags OpenRLHF/AIAK users
know decide what stays resident: ``--colocate_all`` (each phase keeps only what it uses), ``--ref_reward_offload``
(the frozen ref and reward params live on host outside experience making) and ``--adam_offload`` (optimizer states
live on host outside their own update).

Mechanics follow verl's ``offload_megatron_model_to_cpu`` / ``load_megatron_model_to_gpu`` /
``offload_megatron_optimizer``, but work on *storages*, not tensors. Megatron DDP makes params views into
``buffer.param_data`` (distributed optimizer) and ``param.main_grad`` views into ``buffer.grad_data``; the
distributed optimizer's fp32 shards are views into the params again. Each storage is copied into a host buffer
(pinned on CUDA, allocated once and reused) and freed in place with ``untyped_storage().resize_(0)``; every view
keeps its shape and stride and is valid again once the storage is resized back and refilled. Shared memory is
moved and counted once. On CPU "device" and host are the same memory, but the same copy/free/restore runs, so the
bookkeeping is exercised by the CPU tests.

Gradients are *dropped*, never copied: outside a role's own update they hold nothing anyone reads (``train_step``
zeroes them before it accumulates), so their storage is freed with no host copy and comes back zero-filled. This
is also why every schedule, with or without flags and on CPU too, keeps a role's gradients only during its own
update: freeing them costs a memset, not a copy. On CPU the memory one role's grads leave is the memory the next
role's come back in: the scheduler keeps one role's worth of dropped gradient memory parked between updates
(critic_update -> actor_update -> weight_sync ... -> critic_update), because fresh memory costs its page faults
every step (0.1-0.5 s for SmolLM2's 0.5 GB), and frees only what exceeds that.

    managers = {role: OffloadManager(engine) for role, engine in engines.items()}
    sched = MemoryScheduler(managers, colocate_all=True, adam_offload=True)
    sched.enter("make_experience")   # offloads what the phase does not use, then onloads what it does
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch

log = logging.getLogger(__name__)

PARTS = ("params", "grads", "optimizer")
DROPPED = ("grads",)
"""Parts whose contents are dead between phases: freed without a host copy, re-allocated as zeros."""
PHASES = ("rollout", "make_experience", "actor_update", "critic_update", "weight_sync")
_MiB = 2 ** 20


def torch_optimizers(optimizer: Any) -> list:
    """The torch optimizers inside a megatron (possibly chained) optimizer."""
    from rlhf.compat.megatron import inner_optimizers

    if optimizer is None:
        return []
    outs = []
    for opt in inner_optimizers(optimizer):
        torch_opt = getattr(opt, "optimizer", opt)
        if isinstance(torch_opt, torch.optim.Optimizer):
            outs.append(torch_opt)
    return outs


def _param_tensors(engine: Any) -> Iterator[torch.Tensor]:
    ddp = getattr(engine, "ddp", None)
    if ddp is not None:  # megatron DDP shadows nn.Module.buffers() with its list of _ParamAndGradBuffer
        for buf in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", [])):
            if buf.param_data is not None:
                yield buf.param_data
    yield from engine.model.parameters()
    yield from engine.model.buffers()


def _grad_tensors(engine: Any) -> Iterator[torch.Tensor]:
    ddp = getattr(engine, "ddp", None)
    if ddp is not None:
        for buf in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", [])):
            yield buf.grad_data
    main_params = [p for opt in torch_optimizers(engine.optimizer) for g in opt.param_groups for p in g["params"]]
    for p in list(engine.model.parameters()) + main_params:
        yield getattr(p, "main_grad", None)
        yield p.grad


def _optimizer_tensors(engine: Any) -> Iterator[torch.Tensor]:
    for opt in torch_optimizers(engine.optimizer):
        for group in opt.param_groups:
            yield from group["params"]  # fp32 main params of mixed-precision optimizers (else the params again)
        for state in opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))  # exp_avg, exp_avg_sq, step


_FINDERS = {"params": _param_tensors, "grads": _grad_tensors, "optimizer": _optimizer_tensors}


def _bytes_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over the first ``nbytes`` of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _park(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A new storage that holds ``storage``'s memory, which is left with none (torch's ``_swap_data_ptr_``: the
    memory and its deleter change owner; every view of ``storage`` sees zero bytes until it gets memory back)."""
    park = torch.UntypedStorage(0, device=storage.device)
    park._swap_data_ptr_(storage)
    return park


def _serves(parked: torch.UntypedStorage, nbytes: int) -> bool:
    """Whether ``parked`` memory may hold a storage of ``nbytes``: at least that much, at most 9/8 of it."""
    return nbytes <= parked.nbytes() <= nbytes + nbytes // 8


def _unpark(storage: torch.UntypedStorage, nbytes: int, spare: list[torch.UntypedStorage]) -> bool:
    """Give the empty ``storage`` the smallest parked memory of ``nbytes`` to ``nbytes * 9/8`` bytes from ``spare``
    (removed from it). False when none fits."""
    fits = [i for i, p in enumerate(spare) if _serves(p, nbytes)]
    if not fits:
        return False
    storage._swap_data_ptr_(spare.pop(min(fits, key=lambda i: spare[i].nbytes())))
    return True


class OffloadManager:
    """Moves one ``ModelRole``'s params / grads / optimizer states between its device and host buffers.

    Calls are idempotent: offloading a part that is already on host (or onloading one on device) does nothing.
    Grads and optimizer are empty parts for a frozen engine.
    """

    def __init__(self, engine: Any, name: str | None = None):
        self.engine = engine
        self.name = name or getattr(engine, "name", "model")
        first = next(iter(engine.model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self._host: dict[int, torch.Tensor] = {}  # storage id -> host bytes, reused across cycles
        self._off: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}  # part -> (storage, nbytes) on host
        self._announced = False

    @property
    def state(self) -> dict[str, bool]:
        """Which parts are on the device."""
        return {part: part not in self._off for part in PARTS}

    def storages(self) -> dict[str, list[torch.UntypedStorage]]:
        """Each part's storages on this engine's device, each counted once: a storage shared by two parts belongs
        to the first of params, grads, optimizer (the distributed optimizer's fp32 shards are views into the
        params; an fp32 optimizer's main params *are* the params)."""
        seen: set[int] = set()
        out: dict[str, list[torch.UntypedStorage]] = {}
        for part in PARTS:
            out[part] = []
            for t in _FINDERS[part](self.engine):
                if t is None or t.device != self.device:  # e.g. Adam's CPU step counters on a GPU
                    continue
                s = t.untyped_storage()
                if s._cdata not in seen:
                    seen.add(s._cdata)
                    out[part].append(s)
        return out

    def dropped_grad_bytes(self) -> list[int]:
        """The sizes of this engine's gradient storages while they are dropped (empty while they are resident)."""
        return [n for _, n in self._off.get("grads", [])]

    def bytes_on_device(self) -> int:
        """Live bytes of this engine's params, grads and optimizer states on its device."""
        return sum(s.nbytes() for group in self.storages().values() for s in group)

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True,
                spare: list[torch.UntypedStorage] | None = None) -> int:
        """Copy the chosen parts to host (grads: no copy, see ``DROPPED``) and free their device storage. Returns
        the bytes freed on the device. With ``spare``, dropped grads' memory is parked there instead of freed, for
        an ``onload`` given the same list."""
        parts = [p for p, on in zip(PARTS, (params, grads, optimizer)) if on and p not in self._off]
        if not parts:
            return 0
        t0 = time.perf_counter()
        groups = self.storages()
        live = {s._cdata for group in groups.values() for s in group}
        self._host = {k: v for k, v in self._host.items() if k in live}  # drop buffers of storages that died
        moving = {p: [(s, s.nbytes()) for s in groups[p] if s.nbytes() > 0] for p in parts}
        for part, slots in moving.items():
            for s, n in slots:
                if not s.resizable():
                    raise RuntimeError(f"{self.name}: a {part} storage of {n} bytes cannot be resized (memory-"
                                       "mapped or shared from numpy?); copy the tensor before offloading")
        for part, slots in moving.items():
            if part in DROPPED:
                continue
            for s, n in slots:
                host = self._host.get(s._cdata)
                if host is None or host.numel() != n:
                    host = self._host[s._cdata] = torch.empty(n, dtype=torch.uint8, pin_memory=self.cuda)
                host.copy_(_bytes_view(s, n), non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize(self.device)  # the copies must land before the memory can be reused
        for part, slots in moving.items():
            for s, _ in slots:
                if part in DROPPED and spare is not None:
                    spare.append(_park(s))
                else:
                    s.resize_(0)
        self._off.update(moving)
        if self.cuda:
            torch.cuda.empty_cache()  # hand the blocks back to the driver, where vLLM can allocate them
        return self._report("offload", moving, t0)

    def onload(self, params: bool = True, grads: bool = True, optimizer: bool = True,
               spare: list[torch.UntypedStorage] | None = None) -> int:
        """Re-allocate the chosen parts on the device and copy them back (grads: zero-filled, in parked memory from
        ``spare`` where some fits). Returns the bytes re-allocated."""
        parts = [p for p, on in zip(PARTS, (params, grads, optimizer)) if on and p in self._off]
        if not parts:
            return 0
        t0 = time.perf_counter()
        moving = {p: self._off.pop(p) for p in parts}
        for part, slots in moving.items():
            for s, n in slots:
                if part in DROPPED:
                    if spare is None or not _unpark(s, n, spare):
                        s.resize_(n)
                    _bytes_view(s, n).zero_()
                else:
                    s.resize_(n)
                    _bytes_view(s, n).copy_(self._host[s._cdata], non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return self._report("onload", moving, t0)

    def _report(self, what: str, moving: dict[str, list[tuple[Any, int]]], t0: float) -> int:
        nbytes = sum(n for slots in moving.values() for _, n in slots)
        dt = time.perf_counter() - t0
        if not self._announced:
            self._announced = True
            copied = "+".join(p for p in moving if p not in DROPPED) or "nothing"
            dropped = "+".join(p for p in moving if p in DROPPED) or "nothing"
            log.info("%s: offloading %s to %s host buffers, dropping %s (%s); first %s: %.1f MiB in %.3f s",
                     self.name, copied, "pinned" if self.cuda else "plain", dropped, self.device, what,
                     nbytes / _MiB, dt)
        log.debug("%s: %s %s %.1f MiB in %.3f s (%.2f GB/s)", self.name, what, "+".join(moving), nbytes / _MiB,
                  dt, nbytes / max(dt, 1e-9) / 1e9)
        return nbytes


@dataclass(frozen=True)
class Residency:
    """What of one role a phase needs on the device."""

    params: bool = True
    grads: bool = True
    optimizer: bool = True


def plan_residency(phase: str, roles: Iterable[str], *, colocate_all: bool = False,
                   ref_reward_offload: bool = False, adam_offload: bool = False,
                   teacher_offload: bool = False) -> dict[str, Residency]:
    """Per role, the parts ``phase`` keeps on the device. Pure; the flags combine.

    A role's grads are resident during its own update only, whatever the flags (``DROPPED``: freeing them copies
    nothing). Without flags everything else stays resident. ``colocate_all``: rollout keeps nothing (vLLM owns the
    weights it generates with), make_experience keeps every role's params (forward only), ``<role>_update`` keeps
    that role's params, grads and optimizer, weight_sync keeps the actor's params. ``ref_reward_offload``: ref,
    reward and LLM judge params only during make_experience. ``adam_offload``: a role's optimizer states only during
    its own update. ``teacher_offload``: the distillation teacher's params only during make_experience.
    """
    if phase not in PHASES:
        raise ValueError(f"unknown PPO phase {phase!r}; expected one of {PHASES}")
    plan = {}
    for role in roles:
        updating = phase == f"{role}_update"
        params = optimizer = True
        grads = updating
        if colocate_all:
            params = updating or phase == "make_experience" or (phase == "weight_sync" and role == "actor")
            optimizer = updating
        if ref_reward_offload and (role in ("ref", "judge") or role.startswith("reward")):  # reward, reward1, ...
            params = params and phase == "make_experience"
        if teacher_offload and role == "teacher":
            params = params and phase == "make_experience"
        if adam_offload:
            optimizer = optimizer and updating
        plan[role] = Residency(params, grads, optimizer)
    return plan


def cpu_offload_moves() -> bool:
    """Whether offloading on a CPU device really copies (``RLHF_OFFLOAD_ON_CPU=1``; the tests set it, so the
    CUDA code path is exercised on CPU). Off by default: host and device are the same memory there."""
    return os.environ.get("RLHF_OFFLOAD_ON_CPU", "0") == "1"


class MemoryScheduler:
    """Applies ``plan_residency`` to one ``OffloadManager`` per role as the PPO loop moves between phases."""

    def __init__(self, managers: Mapping[str, OffloadManager], *, colocate_all: bool = False,
                 ref_reward_offload: bool = False, adam_offload: bool = False, move: bool = True,
                 keep_parked: bool = True, teacher_offload: bool = False):
        self.managers = dict(managers)
        self.flags = dict(colocate_all=colocate_all, ref_reward_offload=ref_reward_offload,
                          adam_offload=adam_offload, teacher_offload=teacher_offload)
        self.move = move
        """False: copy nothing, only drop and restore grads (``cpu_offload_moves``: on a CPU device the host *is* the
        device, so a copy cannot lower peak memory; it only costs time)."""
        self.spare: list[torch.UntypedStorage] = []
        """CPU: dropped gradient memory parked between phases (``_keep_one_role``), for the next update's grads."""
        self.keep_parked = keep_parked
        """CPU: keep parked gradient memory from one phase change to the next (False: only within one, where the
        critic's dropped grads become the actor's; every role's grads then have their exact size, as on CUDA)."""
        self.current: str | None = None
        self.stats: dict[str, float] = {}
        """Per phase entered since ``pop_stats``: ``offload/<phase>_out_mb`` / ``_in_mb`` freed on (copied off or
        dropped) / re-allocated on the device, ``offload/<phase>_s`` the seconds it took,
        and on CUDA ``offload/<phase>_device_freed_gb`` (``torch.cuda.memory_allocated`` before minus after the
        offloads)."""

    def pop_stats(self) -> dict[str, float]:
        stats, self.stats = self.stats, {}
        return stats

    def enter(self, phase: str) -> dict[str, Residency]:
        """Offload everything ``phase`` does not use first, then onload what it does, so that peak memory never
        holds the leaving and the arriving parts at once."""
        plan = plan_residency(phase, self.managers, **self.flags)
        t0 = time.perf_counter()
        device = next((m.device for m in self.managers.values() if m.cuda), None)
        allocated = torch.cuda.memory_allocated(device) if device is not None else 0
        copy = self.move  # else grads only: dropping them copies nothing
        # On CPU, one role's dropped grads become the next one's, across phases (weight_sync ... critic_update):
        # freeing and re-allocating them costs the page faults of fresh memory. On CUDA freed blocks go back to the
        # driver for vLLM, and re-allocating from the caching allocator costs nothing.
        spare = self.spare if device is None else None
        out = sum(m.offload(params=copy and not plan[r].params, grads=not plan[r].grads,
                            optimizer=copy and not plan[r].optimizer, spare=spare) for r, m in self.managers.items())
        if device is not None:
            self.stats[f"offload/{phase}_device_freed_gb"] = (allocated - torch.cuda.memory_allocated(device)) / 2**30
        back = sum(m.onload(params=copy and plan[r].params, grads=plan[r].grads, optimizer=copy and plan[r].optimizer,
                            spare=spare) for r, m in self.managers.items())
        if spare:
            self._keep_one_role() if self.keep_parked else spare.clear()
        self.stats[f"offload/{phase}_out_mb"] = out / _MiB
        self.stats[f"offload/{phase}_in_mb"] = back / _MiB
        self.stats[f"offload/{phase}_s"] = dt = time.perf_counter() - t0
        self.current = phase
        log.debug("phase %s: offloaded %.1f MiB, onloaded %.1f MiB in %.3f s", phase, out / _MiB, back / _MiB, dt)
        return plan

    def _keep_one_role(self) -> None:
        """Free the parked gradient memory beyond one role's worth that every role whose grads are dropped now could
        come back in. A parked storage serves a role when it fits one of the role's gradient storages (``n`` to
        ``n * 9/8`` bytes, as ``_unpark`` takes it); for each gradient storage of the largest such role, the
        smallest parked storage that serves every such role is kept. An actor and a critic of one size thus share
        one role's worth of memory, and roles of different sizes keep none between phases."""
        wanted = [sizes for m in self.managers.values() if (sizes := m.dropped_grad_bytes())]
        pool = sorted((st for st in self.spare if all(any(_serves(st, n) for n in sizes) for sizes in wanted)),
                      key=lambda st: st.nbytes())
        keep = []
        for n in sorted(max(wanted, key=sum), reverse=True) if wanted else []:
            i = next((i for i, st in enumerate(pool) if _serves(st, n)), None)
            if i is not None:
                keep.append(pool.pop(i))
        self.spare[:] = keep  # the rest is freed with its last reference

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[dict[str, Residency]]:
        """``with sched.phase("actor_update"): ...``. Leaving changes nothing: the next phase decides what moves."""
        yield self.enter(name)
