"""SFT on the megatron stack, one SPMD job (torchrun, mpirun or srun).

    torchrun --nproc_per_node 2 launch/sft.py --pretrain <HF dir or megatron ckpt> --dataset data.jsonl \
        --save_path out/sft [--tensor_model_parallel_size 2] ...

See `python launch/sft.py --help` for the flags (OpenRLHF names).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from rlhf import sft as task_mod
    from rlhf.trainer import run

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    task_mod.add_args(p)
    args = p.parse_args(argv)
    try:
        run(args, task_mod.SFTTask())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
