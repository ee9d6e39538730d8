"""KTO on unpaired desirable / undesirable samples, on the megatron stack, one SPMD job (torchrun, mpirun or srun).

    torchrun --nproc_per_node 2 launch/kto.py --pretrain <SFT model> --dataset kto.jsonl --input_key prompt \
        --output_key completion --label_key label --save_path out/kto --beta 0.1 \
        [--desirable_loss_weight 1.0 --undesirable_loss_weight 1.0] [--ref_offload] ...

See `python launch/kto.py --help` for the flags (OpenRLHF names).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from rlhf.supervised import kto
    from rlhf.supervised.loop import main as run_main

    return run_main(kto, argv)


if __name__ == "__main__":
    from rlhf.distributed.failures import run_then_exit

    run_then_exit(main)  # run_then_exit(main): without the interpreter's teardown (its last full collection)
