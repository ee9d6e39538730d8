"""SFT on the megatron stack, one SPMD job (torchrun, mpirun or srun).

    torchrun --nproc_per_node 2 launch/sft.py --pretrain <HF dir or megatron ckpt> --dataset data.jsonl \
        --save_path out/sft [--tensor_model_parallel_size 2] ...

See `python launch/sft.py --help` for the flags (OpenRLHF names).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from rlhf.supervised import sft
    from rlhf.supervised.loop import main as run_main

    return run_main(sft, argv)


if __name__ == "__main__":
    from rlhf.distributed.failures import run_then_exit

    run_then_exit(main)  # run_then_exit(main): without the interpreter's teardown (its last full collection)
