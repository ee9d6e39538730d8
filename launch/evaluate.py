"""Offline evaluation: n samples per prompt from a checkpoint (HF or megatron) with the colocated generator, scored
by any reward source or verifier; pass@k (unbiased), avg@k and maj@k as JSON and a table; sharded, resumable.

    torchrun --nproc_per_node 2 launch/evaluate.py --pretrain <policy> --dataset math.jsonl --input_key prompt \
        --label_key answer --reward_fn rlhf.rewards.verifiers:math_reward --n_samples_per_prompt 8 \
        --max_new_tokens 512 --output_dir out/eval

See `python launch/evaluate.py --help` and rlhf/offline/evaluate.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv=None) -> int:
    from rlhf.offline.evaluate import main as run_main

    return run_main(argv)


if __name__ == "__main__":
    from rlhf.distributed.failures import run_then_exit

    run_then_exit(main)  # run_then_exit(main): without the interpreter's teardown (its last full collection)
