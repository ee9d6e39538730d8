"""DPO / IPO / cDPO on the megatron stack, one SPMD job (torchrun, mpirun or srun). The reference is a frozen copy
of --ref_pretrain (default --pretrain) with the same TP/PP layout.

    torchrun --nproc_per_node 2 launch/dpo.py --pretrain <SFT model> --dataset pairs.jsonl --prompt_key prompt \
        --chosen_key chosen --rejected_key rejected --save_path out/dpo --loss_type dpo --beta 0.1 \
        [--loss_type cdpo --label_smoothing 0.1] [--ref_offload] [--tensor_model_parallel_size 2] ...

See `python launch/dpo.py --help` for the flags (OpenRLHF names).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from rlhf.supervised import dpo
    from rlhf.supervised.loop import main as run_main

    return run_main(dpo, argv)


if __name__ == "__main__":
    from rlhf.distributed.failures import run_then_exit

    run_then_exit(main)  # run_then_exit(main): without the interpreter's teardown (its last full collection)
