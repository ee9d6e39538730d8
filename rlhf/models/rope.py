"""RoPE scaling of HF configs: which rope types we implement, and their frequencies.

HF writes the rotary settings as ``rope_scaling`` (older configs) or ``rope_parameters`` (transformers 5), with a
``rope_type`` (or ``type``). We implement:

    default   plain RoPE (megatron's own frequencies, untouched)
    linear    position interpolation: inv_freq / factor
    llama3    Llama 3.1-3.3: low frequencies divided by ``factor``, high ones kept, a smooth ramp between
    yarn      YaRN (Qwen2.5 long context, ...): per-dimension blend of interpolation and extrapolation, plus an
              attention temperature (``attention_factor``, from ``mscale``/``mscale_all_dim`` or ``factor``)

Megatron's model takes the frequencies as they are (``rotary_pos_emb.inv_freq``, set by ``rlhf.models.gpt``);
YaRN's attention factor multiplies cos and sin in HF, i.e. both q and k, so it enters megatron as
``softmax_scale = attention_factor**2 / sqrt(head_dim)``. vLLM reads the same config and applies its own.

Not implemented, rejected by name: ``dynamic`` (its frequencies depend on each batch's length in transformers and
are fixed at the maximum length in vLLM, so trainer and generator would disagree), ``longrope``, and any other
type; ``partial_rotary_factor`` below 1. Frequencies are computed here in float64, independently of
transformers; tests compare them with transformers' own.
"""
from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ALLOWED = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
}
_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


def parse_rope(cfg: dict[str, Any], source: str = "config.json", partial_ok: bool = False) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from an HF config dict; ``scaling`` is None for plain RoPE, else a dict with
    ``rope_type`` and every parameter of that type filled in. Raises ValueError naming the field.
    ``partial_ok``: the family reads ``partial_rotary_factor`` itself (glm4_moe: ``rlhf.models.spec_families``)."""
    theta = float(cfg.get("rope_theta", 10000.0))
    scaling: dict | None = None
    for name in ("rope_scaling", "rope_parameters"):
        block = cfg.get(name)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ValueError(f"{source}: config field {name} must be a dict, got {block!r}")
        rope_type = block.get("rope_type", block.get("type")) or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{source}: unsupported config field {name}.rope_type={rope_type!r}; supported: "
                             f"{', '.join(ROPE_TYPES)}")
        extra = sorted(set(block) - _COMMON - _ALLOWED[rope_type])
        if extra:
            raise ValueError(f"{source}: unsupported config field(s) {name}.{extra} for rope_type={rope_type!r}")
        if float(block.get("partial_rotary_factor", 1.0)) != 1.0 and not partial_ok:
            raise ValueError(f"{source}: unsupported config field {name}.partial_rotary_factor="
                             f"{block['partial_rotary_factor']} (only 1.0)")
        for key in _REQUIRED.get(rope_type, ()):
            if block.get(key) is None:
                raise ValueError(f"{source}: config field {name}.{key} is required for rope_type={rope_type!r}")
        if "rope_theta" in block:
            theta = float(block["rope_theta"])
        if rope_type != "default":
            if scaling is not None and scaling["rope_type"] != rope_type:
                raise ValueError(f"{source}: rope_scaling and rope_parameters disagree ({scaling['rope_type']!r} "
                                 f"vs {rope_type!r})")
            scaling = _filled(rope_type, block, cfg)
    return theta, scaling


def _filled(rope_type: str, block: dict, cfg: dict) -> dict:
    out: dict[str, Any] = {"rope_type": rope_type}
    out.update({k: block[k] for k in _ALLOWED[rope_type] if block.get(k) is not None})
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    if rope_type in ("llama3", "yarn"):
        out.setdefault("original_max_position_embeddings",
                       int(cfg.get("original_max_position_embeddings") or max_pos))
    if rope_type == "yarn":
        out.setdefault("beta_fast", 32.0)
        out.setdefault("beta_slow", 1.0)
        out.setdefault("truncate", True)
    return out


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: dict | None) -> float:
    """The factor on cos/sin (both q and k): YaRN's temperature, 1 for every other type."""
    if not scaling or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, ms, ms_all = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if ms and ms_all:
        return _yarn_mscale(factor, float(ms)) / _yarn_mscale(factor, float(ms_all))
    return _yarn_mscale(factor)


def inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """The (head_dim / 2,) float32 inverse frequencies of a rope type (float64 inside)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    base = 1.0 / theta ** exponents
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "linear":
        base = base / float(scaling["factor"])
    elif kind == "llama3":
        base = _llama3(base, scaling)
    elif kind == "yarn":
        base = _yarn(base, head_dim, theta, scaling)
    return base.to(torch.float32)


def _llama3(freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    context = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / freq
    # long wavelengths (beyond context / lo) are interpolated, short ones (below context / hi) kept, the band
    # between blends the two with weight (context / wavelen - lo) / (hi - lo)
    smooth = ((context / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)
    blended = (1 - smooth) * freq / factor + smooth * freq
    out = torch.where(wavelen > context / lo, freq / factor, blended)
    return torch.where(wavelen < context / hi, freq, out)


def _yarn(freq: torch.Tensor, dim: int, theta: float, s: dict) -> torch.Tensor:
    factor, context = float(s["factor"]), float(s["original_max_position_embeddings"])

    def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the context
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(float(s["beta_fast"])), dim_of(float(s["beta_slow"]))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    return freq / factor * (1 - keep) + freq * keep
