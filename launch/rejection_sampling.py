"""Rejection sampling (best-of-N) with the colocated vLLM engine and one or more reward models; writes a jsonl
that launch/sft.py trains on directly (keys input/output, plus score).

    torchrun --nproc_per_node 2 launch/rejection_sampling.py --pretrain <policy> \
        --reward_pretrain <rm_a>,<rm_b> --reward_weights 0.5,0.5 [--reward_fn module:function] \
        --dataset prompts.jsonl --input_key prompt --best_of_n 4 --temperature 1.0 --max_new_tokens 64 \
        --output_path rs.jsonl [--tp 2]
    torchrun --nproc_per_node 2 launch/sft.py --pretrain <policy> --dataset rs.jsonl --save_path out/rs_sft ...

See `python launch/rejection_sampling.py --help` and rlhf/offline/rejection_sampling.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from rlhf.offline.rejection_sampling import main as run_main

    return run_main(argv)


if __name__ == "__main__":
    from rlhf.distributed.failures import run_then_exit

    run_then_exit(main)  # run_then_exit(main): without the interpreter's teardown (its last full collection)
