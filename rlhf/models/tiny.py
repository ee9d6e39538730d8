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
               "mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig}[model_type]
    cfg = cfg_cls(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  **dims)
    if seq_cls:
        cfg.num_labels = 1
    torch.manual_seed(seed)
    cls = transformers.AutoModelForSequenceClassification if seq_cls else transformers.AutoModelForCausalLM
    model = cls.from_config(cfg, dtype=dtype)
    with torch.no_grad():  # HF zero-inits some tensors (biases); random values make the tests sharper
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".gate.weight") and "experts" not in name:  # an MoE router (HF: zeros for qwen3_moe)
                p.copy_(torch.randn_like(p))  # logits far apart: the top-k choice is not a rounding coin toss
    model.save_pretrained(out)
    return out


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
    import json

    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if tokenizer_dir is None:
        tok = make_tokenizer(out, vocab_size=vocab_size, seed=seed, texts=texts)
    else:
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    missing = [t for t in VLM_SPECIAL_TOKENS if t not in tok.get_vocab()]
    if missing:
        tok.add_special_tokens({"additional_special_tokens": missing})
    tok.chat_template = VLM_CHAT_TEMPLATE
    tok.save_pretrained(out)
    ids = dict(zip(VLM_SPECIAL_TOKENS, tok.convert_tokens_to_ids(list(VLM_SPECIAL_TOKENS))))
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
    proc = Qwen2VLImageProcessorPil(min_pixels=pixels[0], max_pixels=pixels[1])
    proc.save_pretrained(out)
    with open(os.path.join(out, "preprocessor_config.json")) as f:
        json.load(f)  # written, and readable
    return out
