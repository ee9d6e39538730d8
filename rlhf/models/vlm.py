"""Vision-language models: Qwen2.5-VL (``model_type`` ``qwen2_5_vl``), Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``) and
Qwen3-VL (``qwen3_vl``), docs/vlm.md.

The language model is megatron-core's GPTModel: for Qwen2.5-VL a Qwen2 decoder with megatron's multimodal rotary
(``position_embedding_type "mrope"``, its ``MultimodalRotaryEmbedding`` with the config's ``mrope_section``: the
rotary dimensions split into time, height and width blocks); for Qwen3.5 the hybrid DeltaNet / gated-attention
decoder of ``rlhf.models.hybrid`` with the *interleaved* multimodal rotary (``mrope_interleaved``: frequency i turns
by the time position, except every third from 1 (height) and from 2 (width) within their sections), computed here
(``interleaved_mrope``) from megatron's own ``inv_freq``; for Qwen3-VL a Qwen3 decoder with that rotary, and the
tower's deepstack features added to the first decoder layers' outputs (``deepstack``). Qwen3.5's tower has none.

The vision tower and its merger are transformers' own (``Qwen2_5_VisionTransformerPretrainedModel``,
``Qwen3_5VisionModel``, ``Qwen3_5MoeVisionModel``, ``Qwen3VLVisionModel``; megatron-core 0.16.1 has no such
encoder), held beside the language model on the first pipeline stage, replicated over tensor parallelism (every TP
rank computes the same features and gets the same gradients, as megatron's replicated norms do) and trained
data-parallel by megatron's DDP, or frozen (``--freeze_vision_tower``).

Layouts: the language model at any TP that fits it (``check_parallel_fit``; an MoE model at TP > 1 runs sequence
parallelism: ``whole_embedding``, the features scattered in, then the slice) and, for qwen3_5_moe, any EP; pipeline
and context parallelism, sequence packing and LoRA are refused by name (``check_vlm_layout``).

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

import contextlib
import copy
from typing import Any, Sequence

import torch

VLM_MODEL_TYPES = ("qwen2_5_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl")
VLM_ARCHS = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration",
             "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}
LANGUAGE_MODEL_TYPES = {"qwen2_5_vl": "qwen2", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",
                        "qwen3_vl": "qwen3"}
"""The model_type of each vision-language family's language model (its decoder's spec: ``rlhf.models.spec``)."""
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
    mrope, interleaved = None, False
    for name in ("rope_parameters", "rope_scaling"):
        block = text.get(name)
        if isinstance(block, dict) and "mrope_section" in block:
            mrope = [int(x) for x in block["mrope_section"]]
            interleaved = bool(block.get("mrope_interleaved", cfg["model_type"] != "qwen2_5_vl"))
            block = {k: v for k, v in block.items() if k not in ("mrope_section", "mrope_interleaved")}
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
    if interleaved != (cfg["model_type"] != "qwen2_5_vl"):
        raise ValueError(f"{source}: unsupported config field rope_parameters.mrope_interleaved={interleaved} for "
                         f"model_type={cfg['model_type']!r} (transformers' rotary for it is "
                         f"{'sectioned' if interleaved else 'interleaved'})")
    vision["mrope_interleaved"] = interleaved
    deepstack = list(vision_cfg.get("deepstack_visual_indexes") or [])
    if deepstack and cfg["model_type"] != "qwen3_vl":
        raise ValueError(f"{source}: unsupported config field vision_config.deepstack_visual_indexes for "
                         f"model_type={cfg['model_type']!r} (only Qwen3-VL's tower has deepstack features)")
    if len(deepstack) > int(text.get("num_hidden_layers", 0)):
        raise ValueError(f"{source}: vision_config.deepstack_visual_indexes={deepstack} feeds more decoder layers "
                         f"than the language model's num_hidden_layers={text.get('num_hidden_layers')}")
    vision["deepstack"] = len(deepstack)
    out_hidden = vision_cfg.get("out_hidden_size")
    if out_hidden is not None and int(out_hidden) != int(text.get("hidden_size", -1)):
        raise ValueError(f"{source}: vision_config.out_hidden_size={out_hidden} must equal the language model's "
                         f"hidden_size={text.get('hidden_size')}")
    return text, vision, mrope


def check_vlm_layout(spec, *, tp: int = 1, pp: int = 1, cp: int = 1, packing: bool = False, lora: bool = False,
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
    """transformers' vision tower and merger of ``spec``'s family (randomly initialised; loaded after)."""
    if spec.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as Tower
    elif spec.model_type == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig as Config
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel as Tower
    elif spec.model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower
    else:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig as Config
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel as Tower
    cfg = Config(**{k: v for k, v in copy.deepcopy(spec.vision["vision_config"]).items()
                    if k not in ("model_type", "transformers_version")})
    cfg._attn_implementation = "sdpa"
    return Tower._from_config(cfg, dtype=dtype)


def interleaved_mrope(inv_freq: torch.Tensor, positions: torch.Tensor, section: Sequence[int]) -> torch.Tensor:
    """(S, B, 1, 2 * F) rotary angles of the interleaved multimodal rotary (Qwen3.5; transformers 5.19's
    ``Qwen3_5TextRotaryEmbedding.apply_interleaved_mrope``) in megatron's layout, from ``inv_freq`` (F,) and
    ``positions`` (3, B, S): frequency i turns by the time position, except i = 1, 4, .. < 3 * section[1] by the
    height and i = 2, 5, .. < 3 * section[2] by the width; the F angles are repeated (rotate-half layout)."""
    freqs = positions.to(inv_freq.dtype)[..., None] * inv_freq  # (3, B, S, F)
    out = freqs[0].clone()
    for axis in (1, 2):
        idx = slice(axis, 3 * int(section[axis]), 3)
        out[..., idx] = freqs[axis, ..., idx]
    return torch.cat((out, out), dim=-1).transpose(0, 1).unsqueeze(2).contiguous()


def vlm_model_class(base):
    """A Qwen2.5-VL model class on top of ``base`` (``rlhf.models.gpt``'s LlamaGPT)."""

    class QwenVLGPT(base):
        """LlamaGPT with megatron's multimodal rotary and transformers' vision tower on the first stage."""

        def __init__(self, spec, config, padded_vocab, pre_process, post_process, value_head, use_te=None):
            self.interleaved = bool(spec.vision.get("mrope_interleaved"))  # Qwen3.5: computed here, plain RoPE's
            super().__init__(spec, config, padded_vocab, pre_process, post_process, value_head, use_te=use_te,
                             position_embedding_type="rope" if self.interleaved else "mrope")  # inv_freq
            self.image_token_id = spec.vision["image_token_id"]
            if pre_process:
                self.visual = vision_tower(spec, config.params_dtype)

        def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor):
            """((N, H) merged features of every image of the batch, row by row (padding dropped), the tower's
            deepstack features (Qwen3-VL: one (N, H) per deepstack layer; else none)), or None without images."""
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
            return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])

        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None, *, packed_seq_params=None, output="head",
                    pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                    mrope_position_ids: torch.Tensor | None = None,
                    image_mask: torch.Tensor | None = None) -> torch.Tensor:
            if packed_seq_params is not None:
                raise ValueError("packed sequences are not supported for vision-language models")
            B, seq = input_ids.shape
            if mrope_position_ids is None:  # text only: plain positions on all three axes
                mrope_position_ids = torch.arange(seq, device=input_ids.device).expand(B, 3, seq)
            sp = self.config.sequence_parallel  # an MoE model at TP > 1: padded to a multiple of TP, scattered
            if sp:
                input_ids, mrope_position_ids, image_mask = sp_pad(input_ids, mrope_position_ids, image_mask,
                                                                   self.config.tensor_model_parallel_size)
            pos = mrope_position_ids.transpose(0, 1)  # (3, B, S), megatron's layout
            decoder_input = None
            if self.pre_process:
                emb = whole_embedding(self.embedding, input_ids) if sp else self.embedding(input_ids=input_ids,
                                                                                           position_ids=None)
                mask = image_mask if image_mask is not None else input_ids == self.image_token_id
                feats = (self.image_features(pixel_values, image_grid_thw)
                         if pixel_values is not None and image_grid_thw is not None else None)
                feats, deep = feats if feats is not None else (None, [])
                n = int(mask.sum())
                if n != (0 if feats is None else feats.shape[0]):
                    raise ValueError(f"{n} image placeholders in the batch but "
                                     f"{0 if feats is None else feats.shape[0]} image features")
                if n:
                    emb = emb.transpose(0, 1).masked_scatter(mask.unsqueeze(-1), feats.to(emb.dtype))
                    emb = emb.transpose(0, 1).contiguous()
                if sp:  # this rank's S / TP positions; the scatter's backward all-gathers, so every rank's tower
                    # gets the whole sequence's gradient, as without sequence parallelism (not summed over TP)
                    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

                    emb = scatter_to_sequence_parallel_region(emb)
                decoder_input = emb
            else:
                deep = []
            pre = self._preprocess(input_ids=input_ids, position_ids=pos, decoder_input=decoder_input)
            decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset = pre[:5]
            if self.interleaved:
                rotary_pos_emb = interleaved_mrope(self.rotary_pos_emb.inv_freq, pos, self.config.mrope_section)
            with deepstack(self.decoder, mask if deep else None, deep):
                hidden = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                      rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                                      rotary_pos_sin=rotary_pos_sin, sequence_len_offset=sequence_len_offset)
            return self._head(hidden, output, seq)

    return QwenVLGPT


def sp_pad(input_ids: torch.Tensor, positions: torch.Tensor, image_mask: torch.Tensor | None, tp: int):
    """Sequence parallelism: (B, S) ids, (B, 3, S) positions and (B, S) image mask padded to a multiple of ``tp``
    (the text rule continues; padding is no image)."""
    from rlhf.models.sequence_parallel import pad_inputs

    B, S = input_ids.shape
    input_ids, _, _ = pad_inputs(input_ids, None, None, tp)
    pad = input_ids.shape[1] - S
    if pad == 0:
        return input_ids, positions, image_mask
    tail = positions[..., -1:] + torch.arange(1, pad + 1, device=positions.device)
    if image_mask is not None:
        image_mask = torch.cat([image_mask, image_mask.new_zeros(B, pad)], dim=1)
    return input_ids, torch.cat([positions, tail], dim=-1), image_mask


def whole_embedding(embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """megatron's word embedding of the whole sequence, (S, B, H) on every TP rank, under sequence parallelism
    (whose own forward reduce-scatters it before the image features could go in; the caller scatters after).
    VocabParallelEmbedding without its reduce-scatter all-reduces over the vocab shards instead; no position
    embedding or dropout in these models."""
    words = embedding.word_embeddings
    keep = words.reduce_scatter_embeddings
    words.reduce_scatter_embeddings = False
    try:
        out = words(input_ids)  # (B, S, H)
    finally:
        words.reduce_scatter_embeddings = keep
    return out.transpose(0, 1).contiguous()


@contextlib.contextmanager
def deepstack(decoder, mask: torch.Tensor | None, features: Sequence[torch.Tensor]):
    """Qwen3-VL's deepstack (transformers 5.19's ``Qwen3VLTextModel._deepstack_process``): the output of decoder
    layer j (j < len(features)) gains ``features[j]`` (N, H) at the image placeholders ``mask`` (B, S), for the
    forward inside the block (megatron's recompute included: the hooks stay until the block returns). Dense
    decoders only: each TP rank holds the whole sequence (no sequence parallelism), so every rank adds the same."""
    if not features:
        yield
        return
    B, S = mask.shape
    adds = []
    for f in features:
        z = torch.zeros(B, S, f.shape[-1], dtype=f.dtype, device=f.device)
        adds.append(z.masked_scatter(mask.unsqueeze(-1), f).transpose(0, 1))  # (S, B, H), megatron's layout

    def hook_for(add):
        def hook(module, args, out):
            if isinstance(out, tuple):
                return (out[0] + add.to(out[0].dtype), *out[1:])
            return out + add.to(out.dtype)
        return hook

    handles = [decoder.layers[j].register_forward_hook(hook_for(a)) for j, a in enumerate(adds)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------------------------- HF names
def is_vision_param(name: str) -> bool:
    return name.startswith("visual.")


def saved_hf_name(spec, name: str) -> str:
    """The name an HF tensor is saved under: Qwen3.5's folders name the language model ``model.language_model.*``
    and the tower ``model.visual.*`` (transformers 5.19 maps no other layout for them); everything else as read."""
    if spec.vision is None or spec.model_type == "qwen2_5_vl":
        return name
    if name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return "model." + name if name.startswith("visual.") else name


def vision_hf_names(spec) -> set[str]:
    """The vision tower's tensor names in an HF Qwen2.5-VL folder (``visual.*``, as transformers saves them)."""
    with torch.device("meta"):
        tower = vision_tower(spec)
    return {"visual." + k for k in tower.state_dict()}
