"""Streaming reads and writes of Hugging Face checkpoint folders (safetensors, sharded or not; ``.bin`` read)."""
from __future__ import annotations

import json
import os
import shutil
from typing import Iterable

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json", "preprocessor_config.json", "processor_config.json")
"""Copied beside exported weights: the tokenizer's files, and a vision-language model's image processor config"""


class HFCheckpointReader:
    """Lazy access to the tensors of an HF folder: only the requested rows of a tensor are read (safetensors)."""

    def __init__(self, folder: str):
        if not os.path.isdir(folder):
            raise ValueError(f"HF folder not found: {folder}")
        self.folder = folder
        self._where: dict[str, str] = {}
        index = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                self._where = {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
        elif os.path.exists(single):
            from safetensors import safe_open

            with safe_open(single, "pt") as f:
                self._where = {k: single for k in f.keys()}
        else:
            bins = sorted(p for p in os.listdir(folder) if p.startswith("pytorch_model") and p.endswith(".bin"))
            if not bins:
                raise ValueError(f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model*.bin")
            for b in bins:
                sd = torch.load(os.path.join(folder, b), map_location="cpu", mmap=True, weights_only=True)
                self._where.update({k: os.path.join(folder, b) for k in sd})
        self._handles: dict[str, object] = {}
        # Vision-language folders saved by transformers 5 with save_original_format=False name the language model
        # model.language_model.* and the tower model.visual.*; the hub's (and transformers' default) layout is
        # model.* and visual.*, the names we use.
        self._orig: dict[str, str] = {}
        for k in list(self._where):
            for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
                if k.startswith(new):
                    self._where[old + k[len(new):]] = self._where.pop(k)
                    self._orig[old + k[len(new):]] = k

    def keys(self) -> set[str]:
        return set(self._where)

    def _handle(self, path: str):
        if path not in self._handles:
            if path.endswith(".safetensors"):
                from safetensors import safe_open

                self._handles[path] = safe_open(path, "pt")
            else:
                self._handles[path] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return self._handles[path]

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.folder}: checkpoint has no tensor {name!r}")
        h = self._handle(self._where[name])
        name = self._orig.get(name, name)
        if isinstance(h, dict):
            t = h[name]
            return (t if rows is None else t[rows[0]:rows[1]]).clone()
        if rows is None:
            return h.get_tensor(name)
        return h.get_slice(name)[rows[0]:rows[1]]


class HFShardedWriter:
    """Write tensors into ``model-XXXXX-of-YYYYY.safetensors`` shards as they come, freeing each full shard."""

    def __init__(self, folder: str, max_shard_bytes: int = 2 << 30):
        self.folder = folder
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[list[str]] = []
        os.makedirs(folder, exist_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending:
            raise ValueError(f"duplicate tensor {name}")
        self._pending[name] = tensor.detach().contiguous()
        self._pending_bytes += tensor.numel() * tensor.element_size()
        if self._pending_bytes >= self.max_shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        from safetensors.torch import save_file

        idx = len(self._files)
        save_file(self._pending, os.path.join(self.folder, f"shard-{idx}.tmp"), metadata={"format": "pt"})
        self._files.append(sorted(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finalize(self) -> list[str]:
        """Rename the shards to HF's names and write the index (or a single ``model.safetensors``)."""
        self._flush()
        n = len(self._files)
        if n == 1:
            os.replace(os.path.join(self.folder, "shard-0.tmp"), os.path.join(self.folder, "model.safetensors"))
            return ["model.safetensors"]
        weight_map, names = {}, []
        for i, keys in enumerate(self._files):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.folder, f"shard-{i}.tmp"), os.path.join(self.folder, fname))
            weight_map.update({k: fname for k in keys})
            names.append(fname)
        with open(os.path.join(self.folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
        return names


def copy_tokenizer_files(src: str, dst: str, names: Iterable[str] = TOKENIZER_FILES) -> list[str]:
    copied = []
    os.makedirs(dst, exist_ok=True)
    for n in names:
        p = os.path.join(src, n)
        if os.path.exists(p):
            shutil.copy2(p, os.path.join(dst, n))
            copied.append(n)
    return copied


def torch_dtype(name: str) -> torch.dtype:
    name = str(name).replace("torch.", "")
    table = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "half": torch.float16}
    if name not in table:
        raise ValueError(f"unsupported torch_dtype {name!r} (float32, bfloat16, float16)")
    return table[name]
