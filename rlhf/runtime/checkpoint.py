"""Resumable training checkpoints: every trainable role, optimizer, scheduler, data position and RNG state.

Layout under ``--ckpt_path``::

    iter_0000100/state/          one dist_checkpointing save of {role: {model, optimizer}} (reshardable)
    iter_0000100/trainer.json    steps, schedulers, sampler position, anything the loop adds
    iter_0000100/rng/rank_N.pt   python / numpy / torch / megatron-tracker RNG of each rank
    iter_0000100/manifest.json   every file's size, and the sha256 of each file up to 1 MiB
    latest                       the name of the newest complete iteration folder

Publishing is atomic: a save goes to ``iter_X.tmp``; after every rank has finished, rank 0 writes the manifest,
renames the folder and only then rewrites ``latest`` (through a temporary file and ``os.replace``). A run killed
mid-save, or a save that fails (a full disk), leaves the previous checkpoint as ``latest``. A save that cannot
fit (the newest checkpoint's size, or the engines' bytes before the first) is refused before anything is written.

Loading verifies the folder ``latest`` names against its manifest (missing or truncated files, changed small
files); a damaged checkpoint, or a ``latest`` that names none, falls back to the newest intact one with a
warning.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import re
import shutil
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist

from rlhf.distributed.mesh import ParallelMesh
from rlhf.runtime.export import export_hf as _export_hf
from rlhf.models.checkpoint_io import folder_bytes, require_free_space
from rlhf.runtime.save_size import saved_bytes, uses_distributed_optimizer

log = logging.getLogger(__name__)


def rng_device_type() -> str:
    """Whose generators megatron's RNG tracker holds: CUDA states on a GPU, CPU states under the CPU shim."""
    from rlhf.compat import cuda as cuda_shim

    return "cuda" if torch.cuda.is_available() and not cuda_shim.is_installed() else "cpu"


def rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states(), "device_type": rng_device_type()}
    if state["device_type"] == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> bool:
    """Restore what ``rng_state`` saved. The device generators (megatron's tracker, CUDA's own) are restored only
    on the device type that saved them: a CPU generator state is not a CUDA one (nor the reverse), so a run moved
    between CPU and GPU keeps its freshly seeded device generators, with a warning. Returns True if all restored."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    saved = state.get("device_type", "cpu")  # checkpoints from before the tag were written on CPU
    if saved != rng_device_type():
        log.warning("checkpoint RNG states come from a %s run, this one is on %s: megatron's tracker and the device "
                    "generator keep their fresh seeds (dropout masks differ from the interrupted run)", saved,
                    rng_device_type())
        return False
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    return True


CKPT_MANIFEST = "manifest.json"
HASHED_MAX_BYTES = 1 << 20
"""Files up to this size are checksummed (metadata, trainer state, RNG); larger ones (weight shards) are checked
by size, which catches truncation without reading gigabytes."""
_ITER = re.compile(r"^iter_(\d+)$")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: str) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(f for f in out if f != CKPT_MANIFEST)


def write_ckpt_manifest(folder: str) -> dict[str, dict]:
    """Record every file of a finished checkpoint folder: size, and sha256 for the small ones."""
    files = {}
    for rel in _files(folder):
        path = os.path.join(folder, rel)
        size = os.path.getsize(path)
        files[rel] = {"size": size, **({"sha256": _sha256(path)} if size <= HASHED_MAX_BYTES else {})}
    tmp = os.path.join(folder, CKPT_MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, CKPT_MANIFEST))
    return files


def verify_ckpt(folder: str) -> str | None:
    """None if ``folder`` matches its manifest, else what is wrong (one line). A folder without a manifest (written
    before manifests existed) passes if it has its trainer state."""
    if not os.path.isdir(folder):
        return "no such folder"
    manifest = os.path.join(folder, CKPT_MANIFEST)
    if not os.path.exists(manifest):
        return None if os.path.exists(os.path.join(folder, "trainer.json")) else "no manifest.json or trainer.json"
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable manifest ({e})"
    for rel, meta in files.items():
        path = os.path.join(folder, rel)
        if not os.path.exists(path):
            return f"missing file {rel}"
        size = os.path.getsize(path)
        if size != meta["size"]:
            return f"{rel} has {size} bytes, {meta['size']} were written"
        if "sha256" in meta and _sha256(path) != meta["sha256"]:
            return f"{rel} changed since it was written (checksum)"
    return None


class Checkpointer:
    def __init__(self, mesh: ParallelMesh, ckpt_path: str, max_ckpt_num: int = 3):
        self.mesh, self.path, self.max_ckpt_num = mesh, ckpt_path, max_ckpt_num

    def latest(self) -> str | None:
        """The folder ``latest`` names, if it is one (not verified: see ``resolve``)."""
        p = os.path.join(self.path, "latest")
        if not os.path.exists(p):
            return None
        with open(p, errors="replace") as f:
            name = f.read().strip()
        folder = os.path.join(self.path, name)
        return folder if _ITER.match(name) and os.path.isdir(folder) else None

    def resolve(self) -> str:
        """The checkpoint to resume from: the one ``latest`` names if it is intact, else the newest intact one,
        with a warning for each one passed over. Raises ValueError if there is none."""
        named = self.latest()
        iters = sorted((d for d in (os.listdir(self.path) if os.path.isdir(self.path) else []) if _ITER.match(d)),
                       key=lambda d: int(_ITER.match(d).group(1)), reverse=True)
        candidates = ([named] if named else []) + [os.path.join(self.path, d) for d in iters
                                                   if os.path.join(self.path, d) != named]
        if named is None and iters:
            log.warning("checkpoint: %s/latest is missing or names no checkpoint folder; looking for the newest "
                        "intact one", self.path)
        skipped = []
        for folder in candidates:
            problem = verify_ckpt(folder)
            if problem is None:
                for bad, why in skipped:
                    log.warning("checkpoint %s is damaged (%s): resuming from %s instead", bad, why, folder)
                return folder
            skipped.append((folder, problem))
        detail = "; ".join(f"{os.path.basename(f)}: {why}" for f, why in skipped)
        raise ValueError(f"--load_checkpoint: no intact checkpoint under --ckpt_path {self.path}"
                         + (f" ({detail})" if detail else ""))

    def save(self, step: int, engines: Mapping[str, Any], extra: dict[str, Any]) -> str:
        from rlhf.distributed.watchdog import phase

        with phase("checkpoint_save"):
            return self._save(step, engines, extra)

    def _save(self, step: int, engines: Mapping[str, Any], extra: dict[str, Any]) -> str:
        from megatron.core import dist_checkpointing

        from rlhf.distributed.faults import fault_point

        from rlhf.compat import cuda as cuda_shim
        from rlhf.compat.megatron import local_save_results_queue

        cuda_shim.install(self.mesh.device)
        local_save_results_queue()
        for eng in engines.values():
            eng.check_finite(f"checkpoint of step {step}")
        estimate = self._check_free_space(step, engines)
        name = f"iter_{step:07d}"
        final, tmp = os.path.join(self.path, name), os.path.join(self.path, name + ".tmp")
        if self.mesh.is_rank0:
            log.info("checkpoint: saving step %d to %s", step, final)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"))
            for role in engines:
                os.makedirs(os.path.join(tmp, "state", role))
        dist.barrier()
        try:
            for role, eng in engines.items():  # one role at a time: its optimizer gather is freed before the next
                dist_checkpointing.save({role: engine_sharded_state_dict(eng)}, os.path.join(tmp, "state", role))
                fault_point("checkpoint_save")  # mid-save: a role's shards are written, the save is not
            torch.save(rng_state(), os.path.join(tmp, "rng", f"rank_{self.mesh.rank}.pt"))
            if self.mesh.is_rank0:
                state = {"step": step, "world_size": self.mesh.world_size, "tp": self.mesh.tp, "pp": self.mesh.pp,
                         "roles": {role: eng.trainer_state() for role, eng in engines.items()}, "extra": extra}
                with open(os.path.join(tmp, "trainer.json"), "w") as f:
                    json.dump(state, f, indent=2, default=_json_default)
        except Exception:
            # A failed write (a full disk) publishes nothing: `latest` keeps naming the previous checkpoint.
            log.error("checkpoint save of step %d failed; %s still holds the previous checkpoints", step, self.path)
            if self.mesh.is_rank0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        dist.barrier()
        if self.mesh.is_rank0:
            write_ckpt_manifest(tmp)  # after every rank's files; the folder is published only with it
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            with open(os.path.join(self.path, "latest.tmp"), "w") as f:
                f.write(name)
            os.replace(os.path.join(self.path, "latest.tmp"), os.path.join(self.path, "latest"))
            log.info("checkpoint: step %d published, %d bytes (the models' and optimizer states' bytes: %d)",
                     step, folder_bytes(final), estimate)
            self._prune(keep=name)
        dist.barrier()
        return final

    def _check_free_space(self, step: int, engines: Mapping[str, Any]) -> float:
        """The checkpoint must fit under ``self.path``: it needs the newest checkpoint's size on disk, or before the
        first one ``saved_bytes``. Returns ``saved_bytes``."""
        estimate = saved_bytes(engines, self.mesh)
        newest = self.latest() if self.mesh.is_rank0 else None
        need, basis = ((folder_bytes(newest), f"the size of {os.path.basename(newest)}") if newest else
                       (estimate, "the models' and optimizer states' bytes"))
        stale = os.path.join(self.path, f"iter_{step:07d}.tmp")  # a killed save's leftovers, removed before it
        require_free_space(self.mesh, self.path, need, f"checkpoint of step {step}", "--ckpt_path", basis,
                           advice=f"or lower --max_ckpt_num (now {self.max_ckpt_num})", reclaimable=stale)
        return estimate

    def _prune(self, keep: str) -> None:
        iters = sorted(d for d in os.listdir(self.path) if d.startswith("iter_") and not d.endswith(".tmp"))
        for d in iters[:-self.max_ckpt_num] if self.max_ckpt_num > 0 else []:
            if d != keep:
                shutil.rmtree(os.path.join(self.path, d), ignore_errors=True)

    def exists(self) -> bool:
        """Whether any checkpoint was published or started here (``latest``, or an ``iter_N`` folder, damaged or
        not). A killed first save leaves only ``iter_N.tmp``, which does not count."""
        if not os.path.isdir(self.path):
            return False
        return os.path.exists(os.path.join(self.path, "latest")) or any(_ITER.match(d) for d in os.listdir(self.path))

    def load_if_any(self, engines: Mapping[str, Any]) -> dict[str, Any] | None:
        """``--load_checkpoint``: ``load`` when a checkpoint exists, else None (start fresh, logged), so that one
        command line serves the first launch and every restart (OpenRLHF does the same). Rank 0 decides for all.
        A folder whose checkpoints are all damaged is still an error (``resolve``)."""
        found = [self.exists() if self.mesh.is_rank0 else None]
        dist.broadcast_object_list(found, src=0)
        if not found[0]:
            if self.mesh.is_rank0:
                log.info("--load_checkpoint: no checkpoint under %s yet; starting from step 0", self.path)
            return None
        return self.load(engines)

    def load(self, engines: Mapping[str, Any], folder: str | None = None) -> dict[str, Any]:
        """Restore engines, RNG and return the trainer state (``extra`` holds what the loop saved)."""
        from rlhf.distributed.watchdog import phase

        with phase("checkpoint_load"):
            return self._load(engines, folder)

    def _load(self, engines: Mapping[str, Any], folder: str | None = None) -> dict[str, Any]:
        from megatron.core import dist_checkpointing

        if folder is None:  # rank 0 verifies and decides, so every rank resumes from the same folder
            choice: list = [None]
            if self.mesh.is_rank0:
                try:
                    choice = [self.resolve()]
                except ValueError as e:  # every rank raises it, none waits
                    choice = [e]
            dist.broadcast_object_list(choice, src=0)
            if isinstance(choice[0], ValueError):
                raise ValueError(str(choice[0]))
            folder = choice[0]
        with open(os.path.join(folder, "trainer.json")) as f:
            state = json.load(f)
        if any(uses_distributed_optimizer(eng) for eng in engines.values()):
            from rlhf.compat.megatron import fix_torch_adam_step_load

            fix_torch_adam_step_load()
        per_role = all(os.path.isdir(os.path.join(folder, "state", role)) for role in engines)
        for role, eng in engines.items():
            with torch.no_grad():
                sd = {role: engine_sharded_state_dict(eng, is_loading=True)}
                # checkpoints written before the per-role layout hold every role in state/ itself
                loaded = dist_checkpointing.load(sd, os.path.join(folder, "state", *([role] if per_role else [])))
            eng.load_sharded(loaded[role])
            eng.load_trainer_state(state["roles"][role])
            del sd, loaded
        rng_file = os.path.join(folder, "rng", f"rank_{self.mesh.rank}.pt")
        if state["world_size"] == self.mesh.world_size and os.path.exists(rng_file):
            set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            log.warning("checkpoint was written by %d ranks, now %d: RNG states are not restored",
                        state["world_size"], self.mesh.world_size)
        dist.barrier()
        log.info("resumed from %s (step %d)", folder, state["step"]) if self.mesh.is_rank0 else None
        return state


# megatron's DistributedOptimizer (--zero_stage >= 1) defaults to 'fully_sharded_model_space', whose flattened
# ShardedTensors megatron-core 0.16's own dist_checkpointing rejects ("ShardedTensor.flattened_range is not
# supported"). 'fully_reshardable' gathers each DP group's optimizer state into the canonical per-parameter
# layout, so the checkpoint stays loadable at another TP/PP/DP, like the model shards (measured with 0.16.1).
# Its default gathers full fp32 params and both Adam moments onto *every* DP rank; the memory-efficient variant
# gathers them onto DP rank 0 only (the others hold none), and Checkpointer.save writes one role at a time, so the
# extra host memory of a save is 3 fp32 copies of the largest role on one rank. ('dp_reshardable', with no gather
# at all, resumed inexactly with 0.16.1: tests/train/test_sft_rm.py::test_resume_is_exact[1].)
DIST_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                       "distrib_optim_fully_reshardable_mem_efficient": True}


def engine_sharded_state_dict(engine: Any, is_loading: bool = False) -> dict:
    """``engine.sharded_state_dict()``, with the distributed optimizer's state in a format that can be saved.

    TODO: once ``ModelRole.sharded_state_dict`` takes a ``metadata`` argument and passes it to
    ``optimizer.sharded_state_dict``, call that with ``DIST_OPTIM_METADATA`` instead of rebuilding the optimizer
    part here (rlhf/runtime/role.py belongs to the PPO work).
    """
    if not uses_distributed_optimizer(engine):
        return engine.sharded_state_dict(is_loading=is_loading)
    from rlhf.compat.megatron import init_optimizer_state

    sd = engine.sharded_state_dict(include_optimizer=False, is_loading=is_loading)
    if is_loading:
        init_optimizer_state(engine.optimizer)
    sd["optimizer"] = engine.optimizer.sharded_state_dict(sd["model"], is_loading=is_loading,
                                                          metadata=DIST_OPTIM_METADATA)
    return sd


def _json_default(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o)}")


def export_hf(args: argparse.Namespace, engine, mesh, extra: dict[str, Any]) -> None:
    """The final HF export (``rlhf.runtime.export.export_hf``), where every workflow takes it from."""
    _export_hf(args, engine, mesh, extra)
