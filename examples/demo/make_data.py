"""Generate the bundled demo task deterministically: tokenizer, initial tiny Llama, SFT corpus, preference pairs,
train and held-out prompts (see rlhf/demo/sort_task.py).

    python examples/demo/make_data.py --out outputs/demo/data [--seed 0]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ...
MODEL_DIMS = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n_pref", type=int, default=4000)
    p.add_argument("--n_train_prompts", type=int, default=512)
    a = p.parse_args()
    from rlhf.demo.sort_task import corpus, make_all
    from rlhf.models.tiny import make_tiny_hf, make_tokenizer

    os.makedirs(a.out, exist_ok=True)
    tok_dir = os.path.join(a.out, "tokenizer")
    tok = make_tokenizer(tok_dir, vocab_size=384, seed=a.seed, texts=corpus())
    make_tiny_hf(os.path.join(a.out, "init"), "llama", seed=a.seed, tokenizer_dir=tok_dir, **MODEL_DIMS)
    paths = make_all(a.out, seed=a.seed, n_pref=a.n_pref, n_train_prompts=a.n_train_prompts)
    paths["init"] = os.path.join(a.out, "init")
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(paths, f, indent=2)
    print(f"demo data in {a.out}: vocab {len(tok)}, " + ", ".join(f"{k}={os.path.basename(v)}" for k, v in paths.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
