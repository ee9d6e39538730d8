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
