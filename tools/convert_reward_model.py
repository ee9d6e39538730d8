"""Convert a reward (or critic) model folder between our HF format (``*ForSequenceClassification``, ``score.weight``,
statistics under ``rlhf.reward_mean/reward_std``) and OpenRLHF's (``value_head.weight`` or another
``value_head_prefix``, ``normalize_reward``/``mean``/``std`` in config.json).

    .venv/bin/python tools/convert_reward_model.py --to openrlhf --model out/rm --out out/rm_openrlhf
    .venv/bin/python tools/convert_reward_model.py --to hf --model openrlhf_rm --out rm_hf
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--to", choices=["openrlhf", "hf"], required=True)
    p.add_argument("--model", required=True, help="the folder to convert")
    p.add_argument("--out", default=None, help="output folder (default: convert in place)")
    p.add_argument("--value_head_prefix", default="value_head", help="--to openrlhf: the head's name")
    args = p.parse_args(argv)
    from rlhf.models.reward_format import from_openrlhf, to_openrlhf

    try:
        out = (to_openrlhf(args.model, args.out, args.value_head_prefix) if args.to == "openrlhf"
               else from_openrlhf(args.model, args.out))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({args.to})")
    return 0


if __name__ == "__main__":
    from rlhf.distributed.failures import run_then_exit

    run_then_exit(main)  # run_then_exit(main): without the interpreter's teardown (its last full collection)
