"""Vision-language models: the Qwen2.5-VL family (``model_type`` ``qwen2_5_vl``), docs/vlm.md.

The language model is megatron-core's GPTModel with its multimodal rotary embedding (``position_embedding_type
"mrope"``, megatron's ``MultimodalRotaryEmbedding`` with the config's ``mrope_section``): a Qwen2 decoder whose
query/key rotation takes three position ids per token (time, height, width). The vision tower and its merger are
transformers' own ``Qwen2_5_VisionTransformerPretrainedModel`` (megatron-core 0.16.1 has no Qwen2.5-VL vision
encoder), held beside the language model on the first pipeline stage, replicated over tensor parallelism (every TP
rank computes the same features and gets the same gradients, as megatron's replicated norms do) and trained
data-parallel by megatron's DDP, or frozen (``--freeze_vision_tower``).

Layouts: the language model at any TP that fits it (``check_parallel_fit``); pipeline and context parallelism,
sequence packing and LoRA are refused by name (``check_vlm_layout``).

A batch with images carries, beside ``input_ids`` (B, S) whose image placeholders are already expanded (one
``image_token_id`` per merged patch):

* ``pixel_values`` (B, P, C*T*p*p): each row's image patches, right-padded with zeros to the batch's longest;
* ``image_grid_thw`` (B, I, 3): each row's images' (t, h, w) patch grids, zero rows past its images;
* ``mrope_position_ids`` (B, 3, S): the 3-D positions (``mrope_positions``), the same rule as transformers'
  ``Qwen2_5_VLModel.get_rope_index``;
* ``image_mask`` (B, S): the tokens that take an image's features: each image's placeholders, in order. An image
  token past the row's images (one a policy generated) is text, as it is to vLLM, which places images in the
  prompt only (transformers would count it as an image and refuse the mismatch).

Rows without images have no grid rows, and text-only batches none of the three (their positions are the plain
ones, broadcast to three).
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

VLM_MODEL_TYPES = ("qwen2_5_vl",)
VLM_ARCHS = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
VISION_KEYS = ("pixel_values", "image_grid_thw", "mrope_position_ids", "image_mask")
"""The batch entries of a vision-language batch (``rlhf.models.vlm``)."""
_TOP_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def is_vlm_config(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") in VLM_MODEL_TYPES


def split_vlm_config(cfg: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any], list[int]]:
    """(the language model's config as a plain qwen2 config dict, the vision part, mrope_section) of a Qwen2.5-VL
    ``config.json``: transformers 5's nested ``text_config`` or the hub's flat layout (text fields at the top,
    ``rope_scaling: {"type": "mrope", "mrope_section": [...]}``). Raises ValueError naming the field."""
    if "vision_config" not in cfg:
        raise ValueError(f"{source}: model_type={cfg.get('model_type')!r} needs a vision_config")
    nested = cfg.get("text_config") or {}
    for key in _TOP_KEYS:
        if key not in cfg and key not in nested:
            raise ValueError(f"{source}: missing required config field {key!r}")
    drop = ("text_config", "vision_config", "model_type", "vision_token_id", *_TOP_KEYS)
    text = {k: v for k, v in {**cfg, **nested}.items() if k not in drop}  # pre-5 configs repeat some inside
    mrope = None
    for name in ("rope_parameters", "rope_scaling"):
        block = text.get(name)
        if isinstance(block, dict) and "mrope_section" in block:
            mrope = [int(x) for x in block["mrope_section"]]
            block = {k: v for k, v in block.items() if k != "mrope_section"}
            if block.get("rope_type", block.get("type")) == "mrope":
                block["rope_type"] = "default"
                block.pop("type", None)
            text[name] = block
    if mrope is None:
        raise ValueError(f"{source}: missing required config field rope_parameters.mrope_section (the multimodal "
                         "rotary's split of the rotary dimensions into time, height and width)")
    # transformers 5 ties at the top level; pre-5 saves had it inside text_config (its BC rule: either ties)
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings") or nested.get("tie_word_embeddings"))
    vision_cfg = dict(cfg["vision_config"])
    vision = {"vision_config": vision_cfg, **{k: int(cfg[k] if k in cfg else nested[k]) for k in _TOP_KEYS}}
    out_hidden = vision_cfg.get("out_hidden_size")
    if out_hidden is not None and int(out_hidden) != int(text.get("hidden_size", -1)):
        raise ValueError(f"{source}: vision_config.out_hidden_size={out_hidden} must equal the language model's "
                         f"hidden_size={text.get('hidden_size')}")
    return text, vision, mrope


def check_vlm_layout(spec, *, pp: int = 1, cp: int = 1, packing: bool = False, lora: bool = False,
                     what: str = "a vision-language model") -> None:
    """Refuse, before any weight is read, the layouts the vision-language path does not run."""
    if spec.vision is None:
        return
    if pp > 1:
        raise ValueError(f"--pp {pp} with {what} ({spec.model_type}): pipeline parallelism is not supported for "
                         "vision-language models (the vision tower and the 3-D positions live on the first stage "
                         "only); use --tp and data parallelism")
    if cp > 1:
        raise ValueError(f"--context_parallel_size {cp} with {what} ({spec.model_type}): not supported (an image's "
                         "patches would be split across ranks)")
    if packing:
        raise ValueError(f"--packing_samples with {what} ({spec.model_type}): not supported (the 3-D positions and "
                         "image patches of packed rows are not wired); drop --packing_samples")
    if lora:
        raise ValueError(f"--lora_rank with {what} ({spec.model_type}): not supported yet")


# -------------------------------------------------------------------------------------------- 3-D positions
def image_token_count(grid: Sequence[int], merge: int) -> int:
    """Placeholders one image takes in the language model: its (t, h, w) patch grid over merge x merge."""
    t, h, w = (int(x) for x in grid)
    return t * h * w // (merge * merge)


def mrope_positions(ids: Sequence[int], grids: Sequence[Sequence[int]], image_token_id: int, merge: int,
                    length: int | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(3, length) multimodal rotary positions of one sequence ``ids`` whose images' placeholders are expanded
    (``image_token_count`` consecutive ``image_token_id`` per image, in order, one per entry of ``grids``).

    Text tokens take one position more than the token before on all three axes; an image starting at position p
    takes time p and heights p .. p + h/merge - 1, widths p .. p + w/merge - 1 (row-major over its merged grid),
    and the text after it starts at p + max(h, w) / merge (transformers 5.19's ``Qwen2_5_VLModel.get_rope_index``
    for still images; vLLM's ``Qwen2_5_VLForConditionalGeneration.get_mrope_input_positions`` the same). Positions
    past ``len(ids)`` (padding up to ``length``) continue the text rule. An image token after the last image is text.
    ``mask`` ((length,) bool): set True at the images' placeholders."""
    n = len(ids)
    length = n if length is None else length
    out = torch.empty(3, length, dtype=torch.long)
    pos, i, g = 0, 0, 0
    while i < n:
        if ids[i] != image_token_id or g >= len(grids):
            out[:, i] = pos
            pos += 1
            i += 1
            continue
        t, h, w = (int(x) for x in grids[g])
        hh, ww = h // merge, w // merge
        count = t * hh * ww
        if i + count > n or any(ids[j] != image_token_id for j in range(i, i + count)):
            raise ValueError(f"image {g}: {count} placeholders expected at token {i}")
        tt = torch.arange(t).view(t, 1, 1).expand(t, hh, ww).reshape(-1)
        yy = torch.arange(hh).view(1, hh, 1).expand(t, hh, ww).reshape(-1)
        xx = torch.arange(ww).view(1, 1, ww).expand(t, hh, ww).reshape(-1)
        out[0, i:i + count] = tt + pos
        out[1, i:i + count] = yy + pos
        out[2, i:i + count] = xx + pos
        if mask is not None:
            mask[i:i + count] = True
        pos += max(hh, ww)
        i += count
        g += 1
    if g != len(grids):
        raise ValueError(f"{len(grids)} images but placeholders for {g}")
    if length > n:
        out[:, n:] = torch.arange(pos, pos + length - n)
    return out


def vision_batch(rows: Sequence[dict | None], input_ids: torch.Tensor, image_token_id: int,
                 merge: int) -> dict[str, torch.Tensor]:
    """The vision entries of a batch (``VISION_KEYS``) from each row's images (``None``, or a dict with
    ``pixel_values`` (P_b, D) and ``image_grid_thw`` (I_b, 3)) and the batch's ``input_ids`` (B, S)."""
    B, S = input_ids.shape
    img = image_token_id
    P = max([r["pixel_values"].shape[0] for r in rows if r] or [0])
    I = max([r["image_grid_thw"].shape[0] for r in rows if r] or [0])
    D = next((r["pixel_values"].shape[1] for r in rows if r), 1)
    pixels = torch.zeros(B, max(P, 1), D, dtype=torch.float32)
    grids = torch.zeros(B, max(I, 1), 3, dtype=torch.long)
    pos = torch.empty(B, 3, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids = input_ids[b].tolist()
        g = r["image_grid_thw"].tolist() if r else []
        if r:
            pixels[b, :r["pixel_values"].shape[0]] = r["pixel_values"]
            grids[b, :len(g)] = r["image_grid_thw"]
        # placeholders of images cut off by truncation would not be whole: the rows' own ids decide
        pos[b] = mrope_positions(ids, g, img, merge, S, mask[b]) if g else torch.arange(S).expand(3, S)
    return {"pixel_values": pixels, "image_grid_thw": grids, "mrope_position_ids": pos, "image_mask": mask}


# ------------------------------------------------------------------------------------------------- the model
def vision_tower(spec, dtype: torch.dtype = torch.float32):
    """transformers' Qwen2.5-VL vision tower and merger for ``spec`` (randomly initialised; loaded after)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = Qwen2_5_VLVisionConfig(**{k: v for k, v in copy.deepcopy(spec.vision["vision_config"]).items()
                                    if k not in ("model_type", "transformers_version")})
    cfg._attn_implementation = "sdpa"
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, dtype=dtype)


def vlm_model_class(base):
    """A Qwen2.5-VL model class on top of ``base`` (``rlhf.models.gpt``'s LlamaGPT)."""

    class QwenVLGPT(base):
        """LlamaGPT with megatron's multimodal rotary and transformers' vision tower on the first stage."""

        def __init__(self, spec, config, padded_vocab, pre_process, post_process, value_head, use_te=None):
            super().__init__(spec, config, padded_vocab, pre_process, post_process, value_head, use_te=use_te,
                             position_embedding_type="mrope")
            self.image_token_id = spec.vision["image_token_id"]
            if pre_process:
                self.visual = vision_tower(spec, config.params_dtype)

        def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor | None:
            """(N, H) merged features of every image of the batch, row by row (padding dropped)."""
            patches, grids = [], []
            for b in range(image_grid_thw.shape[0]):
                g = image_grid_thw[b]
                g = g[g.prod(-1) > 0]
                if len(g):
                    patches.append(pixel_values[b, : int(g.prod(-1).sum())])
                    grids.append(g)
            if not patches:
                return None
            out = self.visual(torch.cat(patches).to(self.visual.dtype), grid_thw=torch.cat(grids))
            return out.pooler_output

        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None, *, packed_seq_params=None, output="head",
                    pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                    mrope_position_ids: torch.Tensor | None = None,
                    image_mask: torch.Tensor | None = None) -> torch.Tensor:
            if packed_seq_params is not None:
                raise ValueError("packed sequences are not supported for vision-language models")
            B, S = input_ids.shape
            if mrope_position_ids is None:  # text only: plain positions on all three axes
                mrope_position_ids = torch.arange(S, device=input_ids.device).expand(B, 3, S)
            pos = mrope_position_ids.transpose(0, 1)  # (3, B, S), megatron's layout
            decoder_input = None
            if self.pre_process:
                emb = self.embedding(input_ids=input_ids, position_ids=None)  # (S, B, H)
                mask = image_mask if image_mask is not None else input_ids == self.image_token_id
                feats = (self.image_features(pixel_values, image_grid_thw)
                         if pixel_values is not None and image_grid_thw is not None else None)
                n = int(mask.sum())
                if n != (0 if feats is None else feats.shape[0]):
                    raise ValueError(f"{n} image placeholders in the batch but "
                                     f"{0 if feats is None else feats.shape[0]} image features")
                if n:
                    emb = emb.transpose(0, 1).masked_scatter(mask.unsqueeze(-1), feats.to(emb.dtype))
                    emb = emb.transpose(0, 1).contiguous()
                decoder_input = emb
            pre = self._preprocess(input_ids=input_ids, position_ids=pos, decoder_input=decoder_input)
            decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset = pre[:5]
            hidden = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                  rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                                  rotary_pos_sin=rotary_pos_sin, sequence_len_offset=sequence_len_offset)
            return self._head(hidden, output)

    return QwenVLGPT


# --------------------------------------------------------------------------------------------- HF names
def is_vision_param(name: str) -> bool:
    return name.startswith("visual.")


def vision_hf_names(spec) -> set[str]:
    """The vision tower's tensor names in an HF Qwen2.5-VL folder (``visual.*``, as transformers saves them)."""
    with torch.device("meta"):
        tower = vision_tower(spec)
    return {"visual." + k for k in tower.state_dict()}
