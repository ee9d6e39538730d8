"""Images in prompts (vision-language models, ``rlhf.models.vlm``, docs/vlm.md).

A record's images are the ``--image_key`` field (default ``images``, OpenRLHF's ``--data.image_key`` and verl's
``data.image_key``): one image or a list, each a file path (relative paths from the data file's folder), raw bytes,
a dict with ``bytes`` (raw, or base64 text in JSON) and/or ``path`` (how HF ``datasets`` stores an Image column in parquet, verl's geo3k), a
``data:image/...;base64,`` string, or a PIL image. URLs are refused (no network is assumed).

Placeholders, as the peers read them: a string prompt or message content holding ``<image>`` (verl's
``RLHFDataset._build_messages``, OpenRLHF's ``_str_to_content_list``) is split into content items
``{"type": "image"}`` / ``{"type": "text", "text": ...}``; message content already given as such a list is kept.
The placeholders must match the images one for one, in order. The chat template then writes each image as
``<|vision_start|><|image_pad|><|vision_end|>``; without ``--apply_chat_template`` each ``<image>`` is replaced by
that text. After tokenizing, each ``<|image_pad|>`` is expanded to the image's token count (its patch grid over the
merge size), which is what the language model sees and what the trainer's log-probs index; vLLM gets the images
and one placeholder per image (``collapse_placeholders``) and expands them the same way.

Images are resized by transformers' PIL image processor for Qwen2-VL (``Qwen2VLImageProcessorPil``, no torchvision)
with the model folder's ``preprocessor_config.json``, ``--min_pixels``/``--max_pixels`` overriding its limits
(verl passes them as processor kwargs, qwen-vl-utils per image).

Every record's images are opened and checked with the records (``record_problem``): a missing file, an unreadable
image or a count that does not match the placeholders is a ``ValueError`` naming the record, before any model loads.
"""
from __future__ import annotations

import base64
import io
import os
import re
from dataclasses import dataclass, field
from typing import Any

from rlhf.config.part import Part, flag

PLACEHOLDER = "<image>"
VISION_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"
_SPLIT = re.compile(r"(<image>)")


@dataclass
class VisionPart(Part):
    """Images in prompts, for vision-language models (``--pretrain`` of model_type qwen2_5_vl)."""

    image_key: str = flag(help="vision-language models: the record field with the prompt's images (paths, bytes, "
                               "{bytes, path} dicts, data: URIs)", default="images")
    """(--image_key) the record field holding its images (OpenRLHF's --data.image_key, verl's data.image_key)"""
    max_images_per_prompt: int = flag(type=int, help="vision-language models: the most images one prompt may hold "
                                                     "(0: text-only prompts)", default=1)
    """(--max_images_per_prompt) the most images one prompt may hold (OpenRLHF's --data.max_images_per_prompt; 0:
    text-only prompts); the generator reserves room for this many"""
    min_pixels: int | None = flag(type=int, help="vision-language models: scale smaller images up to this many "
                                                 "pixels (default: the model's preprocessor_config.json)", default=None)
    """(--min_pixels) images smaller than this many pixels are scaled up (default: the model's preprocessor)"""
    max_pixels: int | None = flag(type=int, help="vision-language models: scale larger images down to this many "
                                                 "pixels (default: the model's preprocessor_config.json)", default=None)
    """(--max_pixels) images larger than this many pixels are scaled down (default: the model's preprocessor)"""
    freeze_vision_tower: bool = flag(action="store_true", help="vision-language models: train the language model "
                                                               "only, the vision tower frozen", default=False)
    """(--freeze_vision_tower) train the language model only (verl's actor.freeze_vision_tower, OpenRLHF's
    --actor.freeze_visual_encoder)"""


    def check(self) -> None:
        if not self.image_key:
            raise ValueError("--image_key must not be empty")
        if self.max_images_per_prompt < 0:
            raise ValueError(f"--max_images_per_prompt must be >= 0, got {self.max_images_per_prompt}")
        for name in ("min_pixels", "max_pixels"):
            v = getattr(self, name)
            if v is not None and v < 28 * 28:
                raise ValueError(f"--{name} must be >= {28 * 28} (one merged patch), got {v}")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"--min_pixels {self.min_pixels} > --max_pixels {self.max_pixels}")


@dataclass
class VisionData:
    """What the data layer needs to read, size and place images for one model (``vision_data``)."""

    image_key: str
    max_images: int
    processor: Any
    """transformers' ``Qwen2VLImageProcessorPil`` with the model's settings and the flags' pixel limits"""
    image_token_id: int
    merge: int
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def pixels(self) -> tuple[int, int]:
        """(min_pixels, max_pixels) the processor applies (vLLM gets the same)."""
        size = self.processor.size
        return int(size["shortest_edge"]), int(size["longest_edge"])


def vision_data(spec, model_dir: str, part: VisionPart) -> VisionData | None:
    """The image settings for ``spec`` (None for a text model)."""
    if spec.vision is None:
        return None
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    kw = {k: v for k, v in (("min_pixels", part.min_pixels), ("max_pixels", part.max_pixels)) if v is not None}
    if os.path.exists(os.path.join(model_dir, "preprocessor_config.json")):
        proc = Qwen2VLImageProcessorPil.from_pretrained(model_dir, **kw)
    else:
        proc = Qwen2VLImageProcessorPil(**kw)
    if kw:  # from_pretrained keeps the file's size dict: the flags win
        lo, hi = proc.size["shortest_edge"], proc.size["longest_edge"]
        proc.size = {"shortest_edge": kw.get("min_pixels", lo), "longest_edge": kw.get("max_pixels", hi)}
    merge = int(spec.vision["vision_config"].get("spatial_merge_size", 2))
    if int(proc.merge_size) != merge or int(proc.patch_size) != int(spec.vision["vision_config"].get("patch_size",
                                                                                                        14)):
        raise ValueError(f"{model_dir}: preprocessor_config.json's patch/merge size ({proc.patch_size}/"
                         f"{proc.merge_size}) differ from the vision tower's")
    return VisionData(part.image_key, part.max_images_per_prompt, proc, int(spec.vision["image_token_id"]), merge)


# ---------------------------------------------------------------------------------------------------- images
def _as_list(v) -> list:
    if v is None:
        return []
    return list(v) if isinstance(v, (list, tuple)) else [v]


def load_image(v, base_dir: str):
    """One image of a record as an RGB PIL image; ValueError saying what is wrong with it."""
    from PIL import Image

    if isinstance(v, Image.Image):
        return v.convert("RGB")
    if isinstance(v, dict):
        if isinstance(v.get("bytes"), str):  # JSON holds bytes as base64 text
            try:
                return load_image(base64.b64decode(v["bytes"], validate=True), base_dir)
            except ValueError as e:
                raise ValueError(f"'bytes' is neither base64 nor an image: {e}") from None
        if v.get("bytes") is not None:
            v = v["bytes"]
        elif v.get("path"):
            v = v["path"]
        elif v.get("image") is not None:
            v = v["image"]
        else:
            raise ValueError(f"an image dict needs 'bytes' or 'path', got keys {sorted(v)}")
        return load_image(v, base_dir)
    if isinstance(v, (bytes, bytearray)):
        data = bytes(v)
    elif isinstance(v, str):
        if v.startswith(("http://", "https://")):
            raise ValueError(f"image URLs are not fetched ({v[:60]}): download the images and give their paths")
        if v.startswith("data:image"):
            data = base64.b64decode(v.split(",", 1)[1])
        else:
            path = v if os.path.isabs(v) else os.path.join(base_dir, v)
            if not os.path.exists(path):
                raise ValueError(f"image file not found: {path}")
            with open(path, "rb") as f:
                data = f.read()
    else:
        raise ValueError(f"an image must be a path, bytes, a {{bytes, path}} dict or a data: URI, got "
                         f"{type(v).__name__}")
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as e:  # PIL's UnidentifiedImageError, truncated files, ...
        raise ValueError(f"unreadable image ({type(e).__name__}: {e})") from None
    return img.convert("RGB")


def record_images(data: dict, vd: VisionData, base_dir: str) -> list:
    """The record's images, opened (ValueError on the first bad one, naming its index)."""
    out = []
    for i, v in enumerate(_as_list(data.get(vd.image_key))):
        try:
            out.append(load_image(v, base_dir))
        except ValueError as e:
            raise ValueError(f"key {vd.image_key!r}: image {i}: {e}") from None
    return out


# ------------------------------------------------------------------------------------------------ placeholders
def to_content(text: str) -> list[dict]:
    """A string with ``<image>`` placeholders as content items."""
    items = []
    for part in _SPLIT.split(text):
        if part == PLACEHOLDER:
            items.append({"type": "image"})
        elif part:
            items.append({"type": "text", "text": part})
    return items


def with_image_items(v):
    """A prompt (string or messages) with every ``<image>`` placeholder as an image content item."""
    if isinstance(v, str):
        return [{"role": "user", "content": to_content(v)}] if PLACEHOLDER in v else v
    out = []
    for m in v:
        c = m.get("content")
        out.append({**m, "content": to_content(c)} if isinstance(c, str) and PLACEHOLDER in c else m)
    return out


def count_placeholders(v) -> int:
    """Image placeholders of a field: ``<image>`` in strings, ``{"type": "image"}`` items in message content."""
    if v is None:
        return 0
    if isinstance(v, str):
        return v.count(PLACEHOLDER)
    n = 0
    for m in v:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            n += c.count(PLACEHOLDER)
        elif isinstance(c, list):
            n += sum(1 for item in c if isinstance(item, dict) and item.get("type") == "image")
    return n


def content_problem(v) -> str | None:
    """Why a list of content items cannot be rendered, or None."""
    for item in v:
        if not isinstance(item, dict) or item.get("type") not in ("image", "text"):
            return "content items must be {'type': 'image'} or {'type': 'text', 'text': ...}"
        if item["type"] == "text" and not isinstance(item.get("text"), str):
            return "a text content item needs a 'text' string"
    return None


def images_problem(data: dict, fields: list[str], vd: VisionData, base_dir: str) -> str | None:
    """Why the record's images cannot go with its text ``fields``, or None (the images are opened: cached)."""
    n_place = sum(count_placeholders(data.get(f)) for f in fields)
    raw = _as_list(data.get(vd.image_key))
    if len(raw) != n_place:
        return (f"{len(raw)} image(s) in key {vd.image_key!r} but {n_place} placeholder(s) (<image> or "
                "{'type': 'image'} items) in the text: they must match one for one")
    if len(raw) > vd.max_images:
        return f"{len(raw)} images, more than --max_images_per_prompt {vd.max_images}"
    try:
        vd._cache[id(data)] = (data, record_images(data, vd, base_dir))
    except ValueError as e:
        return str(e)
    return None


def cached_images(data: dict, vd: VisionData, base_dir: str) -> list:
    hit = vd._cache.pop(id(data), None)
    if hit is not None and hit[0] is data:
        return hit[1]
    return record_images(data, vd, base_dir)


def replace_placeholders(text: str) -> str:
    """Without a chat template: each ``<image>`` becomes the vision tokens' text."""
    return text.replace(PLACEHOLDER, VISION_TEXT)


# ---------------------------------------------------------------------------------------------- token ids
def process(images: list, vd: VisionData) -> dict | None:
    """``{"pixel_values": (P, D) float32, "image_grid_thw": (I, 3) long, "image_token_id", "merge"}`` of a
    sample's images (None without)."""
    if not images:
        return None
    out = vd.processor(images=images, return_tensors="pt")
    return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long(),
            "image_token_id": vd.image_token_id, "merge": vd.merge}


def expand_placeholders(ids: list[int], mm: dict | None, vd: VisionData, where: str) -> list[int]:
    """Each image's single placeholder token -> as many as the image has merged patches."""
    grids = [] if mm is None else mm["image_grid_thw"].tolist()
    from rlhf.models.vlm import image_token_count

    found = sum(1 for t in ids if t == vd.image_token_id)
    if found != len(grids):
        raise ValueError(f"{where}: the rendered prompt holds {found} image placeholder token(s) for {len(grids)} "
                         "image(s) (does the chat template write <|image_pad|> for image items?)")
    out, g = [], 0
    for t in ids:
        if t == vd.image_token_id:
            out.extend([t] * image_token_count(grids[g], vd.merge))
            g += 1
        else:
            out.append(t)
    return out


def collapse_placeholders(ids, image_token_id: int) -> list[int]:
    """One placeholder per run of them: the prompt as vLLM takes it with its images (vLLM expands each again)."""
    out = []
    for t in ids:
        if t == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(int(t))
    return out
