"""LoRA adapter sync: vLLM holds the frozen base once and gets each update's adapter alone (``--lora_sync adapter``).

The first sync after the engine starts (or after it discarded its weights) sends the *unmerged* base weights, as
the merged sync would send the merged ones; every sync then gathers the actor's adapters as full tensors with PEFT
names (``rlhf.models.lora.gather_adapters_hf``: a TP collective, then the pipeline stages' adapters over PP) and
writes them as a PEFT folder, ``<root>/v<version>``, private to the rank. The engine serves the next generations
with ``LoRARequest("actor-v<version>", <version>, folder)``: vLLM's own LoRA path (punica kernels, CPU and CUDA),
which reads PEFT folders. Each version has its own request id, so the version the engine serves is exact; the
folders of the last ``keep`` versions are kept (``--max_staleness`` + 1 with partial rollouts), older ones deleted,
the root removed when the process ends.

verl sends adapters to vLLM without files, by replacing vLLM's ``LRUCacheWorkerLoRAManager._load_adapter`` with
one that reads a ``TensorLoRARequest`` of in-memory tensors (``verl/utils/vllm/utils.py``, read at 64c9bf86). A
folder costs one small write per sync and no patch of vLLM's internals.

What vLLM's LoRA path carries here: dense text models (Llama, Qwen2, Qwen3, Mistral). MoE, MLA, hybrid and
vision-language actors are refused by name (``check_lora_sync``).
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile

import torch

log = logging.getLogger(__name__)

LORA_SYNC_MODES = ("merged", "adapter")
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM's ``LoRAConfig.max_lora_rank`` must be one of these (``vllm/config/lora.py``, ``MaxLoRARanks``)."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds an adapter of ``rank``."""
    for r in VLLM_MAX_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"--lora_rank {rank} with --lora_sync adapter: vLLM's LoRA path holds ranks up to "
                     f"{VLLM_MAX_LORA_RANKS[-1]}; use --lora_sync merged")


def check_lora_sync(mode: str, *, lora_rank: int, spec, backend: str, use_vllm: bool) -> None:
    """``--lora_sync adapter`` before any model loads: it needs a LoRA actor, vLLM, and a model vLLM's LoRA path
    carries here (a dense text model)."""
    if mode not in LORA_SYNC_MODES:
        raise ValueError(f"--lora_sync must be one of {list(LORA_SYNC_MODES)}, got {mode!r}")
    if mode == "merged":
        return
    if not lora_rank:
        raise ValueError("--lora_sync adapter needs a LoRA actor (--lora_rank > 0)")
    if not use_vllm:
        raise ValueError(f"--lora_sync adapter with --rollout_backend {backend}: only vLLM serves adapters (the "
                         "megatron generator reads the actor's own parameters and needs no sync)")
    vllm_max_lora_rank(lora_rank)
    kind = ("MoE" if spec.num_experts else "MLA" if spec.mla is not None else
            "hybrid" if spec.linear_attention is not None else "vision-language" if spec.vision is not None else None)
    if kind:
        raise ValueError(f"--lora_sync adapter: a {kind} actor ({spec.model_type}) is not carried through vLLM's LoRA "
                         "path here; use --lora_sync merged")


class AdapterFolders:
    """This rank's PEFT folders, one per synced version; the last ``keep`` are kept."""

    def __init__(self, lora_cfg, keep: int = 1):
        self.lora_cfg, self.keep = lora_cfg, max(int(keep), 1)
        self.root = tempfile.mkdtemp(prefix=f"rlhf-lora-{os.getpid()}-")
        self.versions: list[int] = []
        atexit.register(shutil.rmtree, self.root, True)

    def write(self, tensors: dict[str, torch.Tensor], version: int) -> str:
        """``tensors`` (PEFT names) as ``<root>/v<version>``; the folders past ``keep`` are deleted."""
        from rlhf.models.lora import write_peft_folder

        path = os.path.join(self.root, f"v{version}")
        write_peft_folder(tensors, self.lora_cfg, path + ".tmp")
        os.replace(path + ".tmp", path)
        self.versions.append(version)
        while len(self.versions) > self.keep:
            shutil.rmtree(os.path.join(self.root, f"v{self.versions.pop(0)}"), ignore_errors=True)
        return path

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def gather_all_adapters(model, spec, mesh) -> dict[str, torch.Tensor]:
    """Collective (TP, then PP): every stage's adapters as full tensors with PEFT names, on every rank."""
    import torch.distributed as dist

    from rlhf.models.lora import gather_adapters_hf

    tensors = {k: v.cpu() for k, v in gather_adapters_hf(model, spec, mesh).items()}
    if mesh.pp > 1:
        parts: list = [None] * mesh.pp
        dist.all_gather_object(parts, tensors, group=mesh.pp_group)
        tensors = {k: v for p in parts for k, v in p.items()}
    return tensors
