"""The folder vLLM starts from: an HF config and tokenizer. vLLM loads dummy weights from it and gets the
policy's real weights by weight sync, so a megatron checkpoint needs only its HF config written out."""
from __future__ import annotations

import json
import os

import torch.distributed as dist


def vllm_model_dir(pretrain: str, source: dict, mesh, out_dir: str) -> str:
    """``pretrain`` itself when it is an HF folder; for a megatron checkpoint (``source`` from
    ``rlhf.models.source.describe_source``), rank 0 writes its HF config and tokenizer files to ``out_dir``."""
    if source["kind"] == "hf":
        return pretrain
    from rlhf.models.hf_io import copy_tokenizer_files

    if mesh.is_rank0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(source["hf_config"], f, indent=2)
        copy_tokenizer_files(pretrain, out_dir)
    dist.barrier()
    return out_dir
