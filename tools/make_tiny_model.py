"""Generate a tiny, seeded HF model (llama / qwen2 / mistral; CausalLM or SequenceClassification) + tokenizer.

    python tools/make_tiny_model.py --out models/tiny-llama [--model_type llama] [--seq_cls] [--seed 0]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model_type", default="llama", choices=["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe"])
    p.add_argument("--seq_cls", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden_size", type=int, default=64)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--num_attention_heads", type=int, default=4)
    p.add_argument("--num_key_value_heads", type=int, default=2)
    p.add_argument("--intermediate_size", type=int, default=128)
    p.add_argument("--tokenizer_dir", default=None, help="reuse this tokenizer instead of training one")
    args = p.parse_args(argv)
    from rlhf.models.tiny import make_tiny_hf

    make_tiny_hf(args.out, args.model_type, args.seq_cls, seed=args.seed, tokenizer_dir=args.tokenizer_dir,
                 hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                 num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                 intermediate_size=args.intermediate_size)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
