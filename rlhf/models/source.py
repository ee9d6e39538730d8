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
