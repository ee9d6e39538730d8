"""Convert an HF Llama/Qwen2/Qwen3/Mistral/Mixtral/Qwen3-MoE folder (CausalLM or SequenceClassification) to a
megatron-core checkpoint.

    python tools/convert_hf_to_megatron.py --hf DIR --out DIR --tp 2 --pp 2 [--ep 2]

The result is a ``dist_checkpointing`` folder that loads at any TP/PP(/EP) that fits the model, with the
tokenizer files and ``rlhf_manifest.json`` beside it. TP x PP x EP local processes write it, each reading only its
shard.
"""
import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--out", required=True, help="output checkpoint folder (must not exist)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to write at")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to write at")
    p.add_argument("--ep", "--expert_model_parallel_size", type=int, default=1,
                   help="expert-parallel size to write at (MoE models)")
    p.add_argument("--cp", "--context_parallel_size", "--ring_attn_size", type=int, default=1,
                   help="context-parallel size of the job that will load it: accepted so a layout's flags can be "
                        "passed whole; CP does not shard parameters, so the checkpoint is the same at every CP size")
    p.add_argument("--make_vocab_size_divisible_by", type=int, default=128)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    if args.cp < 1:
        print(f"error: --context_parallel_size must be >= 1, got {args.cp}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rlhf.models.convert import convert_hf_to_megatron, plan_hf_to_megatron

    try:
        plan = plan_hf_to_megatron(args.hf, args.out, args.tp, args.pp, args.overwrite,
                                   args.make_vocab_size_divisible_by, ep=args.ep)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = convert_hf_to_megatron(plan, overwrite=args.overwrite)
    print(f"converted {args.hf} -> {args.out} at tp={args.tp} pp={args.pp} ep={args.ep} in {seconds:.1f}s" +
          (f"; it loads at every CP size (--cp {args.cp} shards no parameter)" if args.cp > 1 else ""))
    return 0


if __name__ == "__main__":
    from rlhf.distributed.failures import run_then_exit

    run_then_exit(main)  # run_then_exit(main): without the interpreter's teardown (its last full collection)
