"""GPT-OSS's released checkpoints store the experts' weights in MXFP4 (OCP microscaling, 4-bit E2M1 values in blocks
of 32 sharing one E8M0 power-of-two scale): ``experts.gate_up_proj_blocks`` ``(E, 2I, H / 32, 16)`` uint8 (two
values a byte, the low nibble first), ``experts.gate_up_proj_scales`` ``(E, 2I, H / 32)`` uint8 (exponent + 127),
and the same for ``down_proj``. They are dequantized here when the folder is read (``dequantizing_getter``), to the
``(E, H, 2I)`` / ``(E, I, H)`` layout of the bf16 checkpoints, and trained and exported in the model's dtype. The
exact values: tests/models/test_families_mxfp4.py compares them with transformers' own
``transformers.integrations.mxfp4.convert_moe_packed_tensors``.
"""
from __future__ import annotations

from typing import Callable

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""the 16 values of a 4-bit E2M1 code (sign bit, 2 exponent bits, 1 mantissa bit)"""
PACKED = ("gate_up_proj", "down_proj")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks (..., R, G, 16) uint8, scales (..., R, G) uint8 -> (..., G * 32, R): each row's 32-value groups
    decoded and scaled by 2 ** (scale - 127), then transposed to transformers' (in, out) expert layout."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    lut = torch.tensor(E2M1, dtype=dtype)
    b = blocks.to(torch.int64)
    values = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # (..., R, G, 32), low nibble first
    values = torch.ldexp(values, scales.to(torch.int32).sub(127).unsqueeze(-1).to(dtype))
    return values.flatten(-2).transpose(-1, -2).contiguous()  # (..., G * 32, R)


def dequantizing_getter(get: Callable, keys: set[str], dtype: torch.dtype = torch.bfloat16) -> Callable:
    """``get(name, rows=None)`` that reads ``...experts.gate_up_proj`` / ``down_proj`` from their ``_blocks`` and
    ``_scales`` where the folder has those (``rows``: the expert range), every other tensor as it is."""
    def wrapped(name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if name.rsplit(".", 1)[-1] in PACKED and name not in keys and name + "_blocks" in keys:
            return dequantize(get(name + "_blocks", rows=rows), get(name + "_scales", rows=rows), dtype)
        return get(name, rows=rows)
    return wrapped
