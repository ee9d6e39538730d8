"""Batch inference: generate-only (vLLM) or reward-only scoring over a dataset, sharded over the ranks, resumable.

    torchrun --nproc_per_node 2 launch/batch_inference.py --mode generate --pretrain <policy> \
        --dataset prompts.jsonl --input_key prompt --n_samples_per_prompt 4 --max_new_tokens 256 --output_path gen.jsonl
    torchrun --nproc_per_node 2 launch/batch_inference.py --mode reward --reward_pretrain <rm> \
        --dataset gen.jsonl --input_key input --output_key output --output_path scored.jsonl

See `python launch/batch_inference.py --help` and rlhf/offline/batch_inference.py.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv=None) -> int:
    from rlhf.offline.batch_inference import main as run_main

    return run_main(argv)


if __name__ == "__main__":
    from rlhf.distributed.failures import run_then_exit

    run_then_exit(main)  # run_then_exit(main): without the interpreter's teardown (its last full collection)
