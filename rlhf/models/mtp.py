"""DeepSeek-V3's and GLM-4.5's multi-token-prediction (MTP) layers: ``num_nextn_predict_layers`` extra layers stored
as ``model.layers.N ..`` (N = num_hidden_layers) in the released checkpoints; Qwen3-Next's and Qwen3.5's, stored as
``mtp.*`` (transformers: ``_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]``), the same way. transformers ignores them (DeepSeek-V3:
``_keys_to_ignore_on_load_unexpected``), and so does training here: the trained model is the decoder, as for verl
(which refuses num_nextn_predict_layers > 0: ``hf_to_mcore_config_dpskv3``, verl/models/mcore/config_converter.py at
b178a3cd). So that a trained export still serves speculative decoding, the converter keeps the MTP tensors verbatim
beside the megatron checkpoint (``MTP_FILE``) and every export writes them back unchanged, as they were read.
"""
from __future__ import annotations

import os

import torch

from rlhf.models.spec import ModelSpec

MTP_FILE = "mtp_layers.safetensors"


def mtp_tensors(folder: str, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The MTP tensors of an HF folder (its ``model.layers.N..`` tensors) or of a megatron checkpoint folder
    (``MTP_FILE``); empty when there are none (transformers' own tiny models have none)."""
    if not spec.mtp_layers and spec.linear_attention is None:
        return {}
    path = os.path.join(folder, MTP_FILE)
    if os.path.exists(path):
        from safetensors.torch import load_file

        return load_file(path)
    from rlhf.models.hf_families import is_mtp_name
    from rlhf.models.hf_io import HFCheckpointReader

    try:
        reader = HFCheckpointReader(folder)
    except ValueError:  # neither an HF folder nor a checkpoint that kept MTP tensors
        return {}
    return {n: reader.get(n) for n in sorted(reader.keys()) if is_mtp_name(n, spec)}


def keep_mtp(src: str, dst: str, spec: ModelSpec) -> int:
    """Copy ``src``'s MTP tensors into ``dst/MTP_FILE``; returns how many."""
    tensors = mtp_tensors(src, spec)
    if tensors:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, MTP_FILE))
    return len(tensors)
