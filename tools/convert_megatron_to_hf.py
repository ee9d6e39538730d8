"""Convert a megatron-core checkpoint written by this project back to an HF folder.

    python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR

``AutoModelForCausalLM`` (or ``AutoModelForSequenceClassification`` for reward/critic checkpoints) loads the
result. Runs in one process at TP=1/PP=1, whatever TP/PP the checkpoint was written at.
"""
import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint folder (with rlhf_manifest.json)")
    p.add_argument("--out", required=True, help="output HF folder (must not exist)")
    p.add_argument("--max_shard_size_gb", type=float, default=2.0)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    from rlhf.distributed.parent_death import die_with_parent_if_asked

    die_with_parent_if_asked()  # run by a rank's HF export: ends with that rank
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rlhf.models.convert import megatron_to_hf

    try:
        seconds = megatron_to_hf(args.ckpt, args.out, args.overwrite, int(args.max_shard_size_gb * (1 << 30)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"converted {args.ckpt} -> {args.out} in {seconds:.1f}s")
    return 0


if __name__ == "__main__":
    from rlhf.distributed.failures import run_then_exit

    run_then_exit(main)  # run_then_exit(main): without the interpreter's teardown (its last full collection)
