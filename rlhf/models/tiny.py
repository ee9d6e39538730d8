"""Tiny, deterministic HF models and tokenizers for tests, demos and benchmarks (no model hub needed)."""
from __future__ import annotations

import os
from typing import Any

import torch

DEFAULT_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256)
_CORPUS_WORDS = ("the quick brown fox jumps over lazy dog apple banana cherry delta echo golf hotel india "
                 "juliet kilo lima mike november oscar papa quebec romeo sierra tango uniform victor whiskey "
                 "xray yankee zulu one two three four five six seven eight nine ten sort reverse repeat").split()


def make_tokenizer(out: str, vocab_size: int = 256, seed: int = 0, texts: list[str] | None = None):
    """Train a small byte-level BPE tokenizer on a generated corpus (or ``texts``) and save it as a fast HF
    tokenizer. The 256 byte tokens come first, so ``vocab_size`` above 259 buys merges (whole words)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = texts or [" ".join(rng.choice(_CORPUS_WORDS) for _ in range(rng.randint(3, 12))) for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    os.makedirs(out, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def make_tiny_hf(out: str, model_type: str = "llama", seq_cls: bool = False, seed: int = 0,
                 tokenizer_dir: str | None = None, dtype: torch.dtype = torch.float32, **overrides: Any) -> str:
    """Save a randomly initialised (seeded) HF model of ``model_type`` with a tokenizer into ``out``."""
    import transformers

    if tokenizer_dir is None:
        tok = make_tokenizer(out)
    else:
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        tok.save_pretrained(out)
    dims = dict(DEFAULT_DIMS)
    dims.update(overrides)
    dims.setdefault("vocab_size", len(tok))
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig,
               "mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
               "deepseek_v3": transformers.DeepseekV3Config, "glm4_moe": transformers.Glm4MoeConfig,
               "gpt_oss": transformers.GptOssConfig, "qwen3_next": transformers.Qwen3NextConfig,
               "qwen3_5_text": transformers.Qwen3_5TextConfig,
               "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig}[model_type]
    cfg = cfg_cls(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  **dims)
    if seq_cls:
        cfg.num_labels = 1
    torch.manual_seed(seed)
    cls = transformers.AutoModelForSequenceClassification if seq_cls else transformers.AutoModelForCausalLM
    model = cls.from_config(cfg, dtype=dtype)
    _randomize(model, sigmoid_router=model_type in ("deepseek_v3", "glm4_moe"))
    model.save_pretrained(out)
    if model_type == "deepseek_v3":  # as DeepSeek's released config.json says (vLLM reads it for the expert bias)
        import json

        with open(os.path.join(out, "config.json")) as f:
            saved = json.load(f)
        saved.setdefault("topk_method", "noaux_tc")
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(saved, f, indent=2)
    return out


def _randomize(model, sigmoid_router: bool = False) -> None:
    """Draw the tensors transformers initialises to zeros or ones (biases, norms, GPT-OSS's sinks, DeepSeek's expert
    bias correction, the routers) at random, so that a missing term changes the output (tests' controls)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # a Gated DeltaNet's decay rate A: slow enough that the state carries
                p.copy_(torch.empty_like(p).uniform_(0.02, 0.3).log())  # over tens of tokens (HF: 0.01 .. 16)
            elif name.endswith("bias") or "norm" in name or name.endswith("sinks"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith((".gate.weight", ".router.weight")) and "experts" not in name:  # an MoE router
                # softmax: logits far apart, so the top-k choice is not a rounding coin toss; sigmoid: logits of
                # about unit spread, so the scores do not saturate at 1 (ties) and the bias correction moves choices
                p.copy_(torch.randn_like(p) * (1.6 / p.shape[1] ** 0.5 if sigmoid_router else 1.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's / GLM's load-balancing bias (HF: zeros)
                b.copy_(torch.randn_like(b) * 0.2)


_FAMILY_COMMON = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
TINY_FAMILIES = {
    # MLA (q LoRA 48, kv LoRA 32, 32 + 32 q/k head dims, v 32), YaRN as DeepSeek's (mscale = mscale_all_dim = 1:
    # the softmax scaled by mscale**2), 8 experts in 4 groups of 2, top 4 of the 2 best groups, 1 shared expert,
    # the first layer dense, one MTP layer (its tensors added by make_tiny_family)
    "deepseek_v3": ("deepseek_v3", dict(num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32,
                                        n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
                                        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                                        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                                        routed_scaling_factor=2.5, num_nextn_predict_layers=1,
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                         "original_max_position_embeddings": 16, "mscale": 1.0,
                                                         "mscale_all_dim": 1.0, "beta_fast": 32.0,
                                                         "beta_slow": 1.0})),
    # DeepSeek-V2-Lite-style: no q LoRA (a plain q projection), plain RoPE, one group
    "deepseek_v3-noqlora": ("deepseek_v3", dict(num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32,
                                                n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                                n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=32,
                                                q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=32,
                                                v_head_dim=16, routed_scaling_factor=1.5,
                                                num_nextn_predict_layers=0)),
    # partial rotary (half of each 64-wide head), q/k norms, q/k/v biases, 8 experts top 2, 1 shared, the first
    # layer dense
    "glm4_moe": ("glm4_moe", dict(num_key_value_heads=1, head_dim=64, intermediate_size=96, moe_intermediate_size=32,
                                  n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                  first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
                                  routed_scaling_factor=2.0, num_nextn_predict_layers=0,
                                  partial_rotary_factor=0.5)),
    # sinks, a sliding layer (window 8) then a full one, YaRN (truncate False, as released), 4 experts top 2 with
    # biases; swiglu_limit 0.1 so that the clamp acts on these small activations (the released value is 7); 2 KV
    # heads of 4 (vLLM 0.32's gpt_oss splits the KV heads over its TP ranks without replicating them)
    "gpt_oss": ("gpt_oss", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=64,
                                num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.1,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 150000.0,
                                                 "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False})),
}
"""Tiny models of the families of rlhf.models.spec_families, built by transformers' own classes: name ->
(model_type, overrides of ``make_tiny_hf``). Sequences of 24 tokens run past the window (8) and the original
contexts (16)."""


def make_tiny_family(out: str, name: str, seed: int = 0, tokenizer_dir: str | None = None, **overrides: Any) -> str:
    """``make_tiny_hf`` of ``TINY_FAMILIES[name]``; a model with ``num_nextn_predict_layers`` also gets random MTP
    tensors (DeepSeek's names: ``model.layers.N.{enorm,hnorm,eh_proj,shared_head.norm}`` and a decoder layer's
    norms), which transformers ignores and a round trip must keep (``rlhf.models.mtp``)."""
    model_type, kw = TINY_FAMILIES[name]
    make_tiny_hf(out, model_type, seed=seed, tokenizer_dir=tokenizer_dir, **{**_FAMILY_COMMON, **kw, **overrides})
    mtp = {**kw, **overrides}.get("num_nextn_predict_layers", 0)
    if mtp:
        from safetensors.torch import load_file, save_file

        path = os.path.join(out, "model.safetensors")
        tensors = load_file(path)
        g = torch.Generator().manual_seed(seed + 101)
        h, n = _FAMILY_COMMON["hidden_size"], _FAMILY_COMMON["num_hidden_layers"]
        for i in range(n, n + mtp):
            p = f"model.layers.{i}."
            for k, shape in (("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)),
                             ("shared_head.norm.weight", (h,)), ("input_layernorm.weight", (h,))):
                tensors[p + k] = torch.randn(shape, generator=g).to(next(iter(tensors.values())).dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return out


TINY_HYBRIDS = {
    # 3 Gated DeltaNet layers then one gated softmax attention layer; 2 key heads of 16 serving 4 value heads of 8
    # (q/k repeated), a width-4 convolution; the attention: 4 heads of 16 over 2 KV heads, a quarter of each head
    # rotary; dense MLPs (num_experts 0)
    "qwen3_next": ("qwen3_next", dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                                      linear_conv_kernel_dim=4, num_experts=0, max_position_embeddings=256,
                                      tie_word_embeddings=False,
                                      layer_types=["linear_attention"] * 3 + ["full_attention"])),
    # the same with MoE layers: 4 experts top 2 (renormalised), the sigmoid-gated shared expert; layer 1 dense
    # (mlp_only_layers)
    "qwen3_next-moe": ("qwen3_next", dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                          linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True,
                                          max_position_embeddings=256, tie_word_embeddings=False,
                                          layer_types=["linear_attention"] * 3 + ["full_attention"])),
    # Qwen3.5's text model: Qwen3-Next's dense layers, the DeltaNet's input projections apart, the multimodal rotary
    # (equal positions on text)
    "qwen3_5_text": ("qwen3_5_text", dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                          linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                          max_position_embeddings=256, tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                                           "mrope_interleaved": True},
                                          layer_types=["linear_attention"] * 3 + ["full_attention"])),
    # Qwen3.5's MoE text model: every layer MoE (4 experts top 2, renormalised; the gated shared expert), the
    # DeltaNet's projections apart, the multimodal rotary (transformers' default sections)
    "qwen3_5_moe_text": ("qwen3_5_moe_text", dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                                  linear_num_value_heads=4, linear_key_head_dim=16,
                                                  linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                                                  num_experts_per_tok=2, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=48, max_position_embeddings=256,
                                                  tie_word_embeddings=False,
                                                  layer_types=["linear_attention"] * 3 + ["full_attention"])),
}
"""Tiny hybrid (Gated DeltaNet) models built by transformers' own classes: name -> (model_type, overrides of
``make_tiny_hf``). ``_randomize`` draws their dt_bias, the zero-initialised (1 + w) norms and the gated norm."""


def make_tiny_hybrid(out: str, name: str = "qwen3_next", seed: int = 0, tokenizer_dir: str | None = None,
                     **overrides: Any) -> str:
    model_type, kw = TINY_HYBRIDS[name]
    return make_tiny_hf(out, model_type, seed=seed, tokenizer_dir=tokenizer_dir, **{**kw, **overrides})


VLM_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
"""The tiny VLM's chat template: each image item becomes ``<|vision_start|><|image_pad|><|vision_end|>`` (one
placeholder, expanded to the image's patch count by the processor), as Qwen2.5-VL's own template writes it."""
TINY_VLM_PIXELS = (56 * 56, 112 * 112)
"""(min_pixels, max_pixels) of the tiny VLM's image processor: a 112 x 112 image is 8 x 8 patches, 16 tokens"""


def make_tiny_vlm(out: str, seed: int = 0, tokenizer_dir: str | None = None, texts: list[str] | None = None,
                  vocab_size: int = 256, hidden_size: int = 64, num_hidden_layers: int = 2,
                  num_attention_heads: int = 2, num_key_value_heads: int = 1, intermediate_size: int = 128,
                  vision_depth: int = 2, vision_hidden: int = 32, mrope_section=(4, 6, 6),
                  tie_word_embeddings: bool = False, pixels: tuple[int, int] = TINY_VLM_PIXELS) -> str:
    """A randomly initialised (seeded) Qwen2.5-VL HF folder: config, weights, a tokenizer with the vision tokens
    and a chat template that places images, and the image processor's config (transformers'
    ``Qwen2VLImageProcessorPil``, ``min_pixels``/``max_pixels`` = ``pixels``). The defaults: a 2-layer language
    model of hidden 64 with 2 heads of 32 (one KV head; vLLM's CPU attention takes head_dim 32) and a 2-block vision
    tower of hidden 32, patch 14, merge 2."""
    import transformers

    tok, ids = _vlm_tokenizer(out, seed, tokenizer_dir, texts, vocab_size)
    head_dim = hidden_size // num_attention_heads
    if sum(mrope_section) != head_dim // 2:
        raise ValueError(f"mrope_section {mrope_section} must sum to head_dim / 2 = {head_dim // 2}")
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=4096, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": list(mrope_section)},
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id),
        vision_config=dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                           num_heads=4, out_hidden_size=hidden_size, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=112, fullatt_block_indexes=[vision_depth - 1],
                           tokens_per_second=2, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    with torch.no_grad():  # HF zero-inits biases; random values make the tests sharper
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    _save_image_processor(out, pixels, 14)
    return out


def _vlm_tokenizer(out: str, seed: int, tokenizer_dir: str | None, texts: list[str] | None, vocab_size: int):
    """(the tokenizer with the vision tokens and ``VLM_CHAT_TEMPLATE``, saved into ``out``; their ids)."""
    import transformers

    if tokenizer_dir is None:
        tok = make_tokenizer(out, vocab_size=vocab_size, seed=seed, texts=texts)
    else:
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    missing = [t for t in VLM_SPECIAL_TOKENS if t not in tok.get_vocab()]
    if missing:
        tok.add_special_tokens({"additional_special_tokens": missing})
    tok.chat_template = VLM_CHAT_TEMPLATE
    tok.save_pretrained(out)
    return tok, dict(zip(VLM_SPECIAL_TOKENS, tok.convert_tokens_to_ids(list(VLM_SPECIAL_TOKENS))))


def _save_image_processor(out: str, pixels: tuple[int, int], patch: int) -> None:
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(min_pixels=pixels[0], max_pixels=pixels[1], patch_size=patch).save_pretrained(out)
    with open(os.path.join(out, "preprocessor_config.json")) as f:
        json.load(f)  # written, and readable


TINY_QWEN3_5_VL_PIXELS = (64 * 64, 128 * 128)
"""(min_pixels, max_pixels) of the tiny Qwen3.5's image processor (patch 16, merge 2: 32-pixel cells)"""


def make_tiny_qwen3_5_vl(out: str, moe: bool = False, seed: int = 0, tokenizer_dir: str | None = None,
                         texts: list[str] | None = None, vocab_size: int = 256,
                         pixels: tuple[int, int] = TINY_QWEN3_5_VL_PIXELS, **text_overrides: Any) -> str:
    """A randomly initialised (seeded) Qwen3.5 vision-language HF folder (``qwen3_5``, or ``qwen3_5_moe`` with
    ``moe``), built by transformers' ``Qwen3_5(Moe)ForConditionalGeneration``: the text model of
    ``TINY_HYBRIDS`` (three DeltaNet layers, one gated attention) with heads of 32, half of them rotated by the
    interleaved multimodal rotary over all three axes (``mrope_section`` [3, 3, 2]); a 2-block vision tower of hidden
    32, patch 16, merge 2; the tokenizer, chat template and image processor of ``make_tiny_vlm``."""
    import transformers

    tok, ids = _vlm_tokenizer(out, seed, tokenizer_dir, texts, vocab_size)
    name = "qwen3_5_moe_text" if moe else "qwen3_5_text"
    text = {**TINY_HYBRIDS[name][1], "head_dim": 32, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "partial_rotary_factor": 0.5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                "mrope_section": [3, 3, 2], "mrope_interleaved": True}, **text_overrides}
    text.pop("tie_word_embeddings", None)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=text["hidden_size"],
                  num_position_embeddings=64)
    cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    cfg = cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = (transformers.Qwen3_5MoeForConditionalGeneration if moe
             else transformers.Qwen3_5ForConditionalGeneration)(cfg)
    _randomize(model)
    model.save_pretrained(out)
    _save_image_processor(out, pixels, 16)
    return out


def make_tiny_qwen3_vl(out: str, seed: int = 0, tokenizer_dir: str | None = None, texts: list[str] | None = None,
                       vocab_size: int = 256, pixels: tuple[int, int] = TINY_QWEN3_5_VL_PIXELS) -> str:
    """A randomly initialised (seeded) Qwen3-VL HF folder built by transformers' ``Qwen3VLForConditionalGeneration``:
    a 3-layer Qwen3 decoder of hidden 64 (2 heads of 32, one KV head, q/k norms) with the interleaved multimodal
    rotary (``mrope_section`` [6, 5, 5]); a 3-block vision tower of hidden 32, patch 16, merge 2, whose blocks 0 and 1
    feed deepstack features into decoder layers 0 and 1; the tokenizer, chat template and image processor of
    ``make_tiny_vlm``."""
    import transformers

    tok, ids = _vlm_tokenizer(out, seed, tokenizer_dir, texts, vocab_size)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                                 "mrope_interleaved": True},
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1])
    cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                                     video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                                     vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen3VLForConditionalGeneration(cfg)
    _randomize(model)
    model.save_pretrained(out)
    _save_image_processor(out, pixels, 16)
    return out
