"""What a ``--pretrain``-style path points at, read from its config alone (no weights): a converted megatron
checkpoint (``rlhf_manifest.json``) or an HF folder (``config.json``)."""
from __future__ import annotations

import os
from typing import Any

from rlhf.models.checkpoint_io import read_manifest, spec_from_manifest


def describe_source(path: str) -> dict[str, Any]:
    """What ``--pretrain``-style paths point at: a converted megatron checkpoint (``rlhf_manifest.json``) or an
    HF folder (``config.json``). Validates the config; raises ValueError naming the path otherwise."""
    from rlhf.models.checkpoint_io import MANIFEST
    from rlhf.models.spec import load_hf_config, padded_vocab_size, spec_from_hf_config

    if not os.path.isdir(path):
        raise ValueError(f"model folder not found: {path}")
    if os.path.exists(os.path.join(path, MANIFEST)):
        m = read_manifest(path)
        return {"kind": "megatron", "spec": spec_from_manifest(m), "padded_vocab": m["padded_vocab_size"],
                "hf_config": m["hf_config"], "dtype": m["dtype"]}
    cfg = load_hf_config(path)
    spec = spec_from_hf_config(cfg, source=os.path.join(path, "config.json"))
    return {"kind": "hf", "spec": spec, "padded_vocab": padded_vocab_size(spec.vocab_size), "hf_config": cfg,
            "dtype": str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")}


VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
               "sentencepiece.bpe.model", "qwen.tiktoken", "tokenizer.tiktoken")
"""Files that carry a tokenizer's vocabulary. Without any, transformers 5 still builds a tokenizer from
``config.json`` alone for some families (Qwen2/Qwen3: one token, every text tokenizes to nothing)."""


def check_tokenizer_folder(path: str, flag: str) -> None:
    """``path`` (``--pretrain``-style: an HF folder or a converted megatron checkpoint) holds a tokenizer
    vocabulary; ValueError naming ``flag`` otherwise. Before anything is loaded."""
    if not os.path.isdir(path):
        return  # describe_source names a missing folder
    names = os.listdir(path)
    if any(n in VOCAB_FILES or n.endswith(".tiktoken") for n in names):
        return
    raise ValueError(f"{flag} {path}: no tokenizer files (none of {', '.join(VOCAB_FILES)}); transformers would "
                     "build an empty tokenizer from config.json alone and every sample would tokenize to nothing. "
                     "Copy the tokenizer files of the model it came from into the folder")


def load_tokenizer(path: str, flag: str = "--pretrain"):
    """``AutoTokenizer`` of a ``--pretrain``-style folder, refused (ValueError naming ``flag``) when the folder has
    no vocabulary or the tokenizer turns a plain sentence into nothing."""
    check_tokenizer_folder(path, flag)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    probe = "The quick brown fox jumps over the lazy dog."
    if not tok.encode(probe, add_special_tokens=False):
        raise ValueError(f"{flag} {path}: its tokenizer ({type(tok).__name__}, {len(tok)} tokens) turns {probe!r} "
                         "into no token; the folder's tokenizer files are incomplete")
    return tok


def expert_tensor_parallel_of(paths, tp: int) -> int:
    """``rlhf.models.spec_families.expert_tensor_parallel`` of the models at ``paths`` (HF or megatron folders; None
    entries skipped)."""
    from rlhf.models.spec_families import expert_tensor_parallel

    return expert_tensor_parallel([describe_source(p)["spec"] for p in paths if p], tp)
