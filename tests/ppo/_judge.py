"""A judge whose verdicts are known, for the LLM-judge tests: a one-layer Llama whose weights are set by hand so
that its greedy answer to any input is ``Y`` when the input holds a token with an upper-case letter or a digit, and
``N`` otherwise (``rule``), with margins far above float rounding.

How: every token embeds as ``e0``, plus ``e1`` for a marked token (one whose text has such a character). Queries and
keys are zero, so attention averages the values over the causal prefix; the value reads ``e1`` and the output
projection writes that mean to ``e2``; the MLP is zero. At the last position the residual is
``e0 (+ e1) + a * frac * e2`` (``frac``: the fraction of marked tokens). The LM head gives ``N`` a zero row, ``Y``
the row ``e2 - t * e0`` (``t`` half the smallest mean a single marked token gives within the context) and every
other token ``-10 * e0``: after the final RMSNorm ``Y`` wins exactly when ``frac > 0``."""
from __future__ import annotations

import os

import torch

TEMPLATE = "{response}\nverdict:"
"""the tests' judge template: lower-case letters and punctuation only, so the reply alone decides the verdict (the
tiny tokenizer's chat template, ``user: ...\\nassistant:``, marks nothing either)"""


def rule(text: str) -> bool:
    """The verdict the judge gives a reply: ``Y`` (True) when it has an upper-case ASCII letter or a digit."""
    return any(c.isascii() and (c.isupper() or c.isdigit()) for c in text)


def make_rule_judge(out: str, tokenizer_dir: str, max_positions: int = 256) -> str:
    """Save the judge (HF Llama folder with the tokenizer of ``tokenizer_dir``) into ``out``."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    V, d = len(tok), 64
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=d, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = transformers.LlamaForCausalLM(cfg)
    marked = torch.tensor([rule(tok.decode([t])) for t in range(V)])
    y, n = tok.convert_tokens_to_ids("Y"), tok.convert_tokens_to_ids("N")
    a = 10.0
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 1.0
        emb[marked, 1] = 1.0
        layer = model.model.layers[0]
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        layer.self_attn.v_proj.weight[0, 1] = 1.0  # value dim 0 of the KV head: the normalised e1
        layer.self_attn.o_proj.weight[2, 0] = a  # head 0, dim 0 -> e2
        layer.self_attn.o_proj.weight[2, 32] = a  # head 1 shares the KV head: the same mean
        one = (1.0 / ((2.0 / d) + 1e-6) ** 0.5)  # a marked token's normalised e1
        t = 0.5 * 2 * a * one / max_positions  # half the e2 that one marked token in a full context gives
        head = model.lm_head.weight
        head[:, 0] = -10.0
        head[n].zero_()
        head[y, 2], head[y, 0] = 1.0, -t
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
