"""DeepSpeed-Chat's three steps with its own flags, mapped onto launch/sft.py, launch/rm.py and launch/ppo.py.

    torchrun --nproc_per_node 2 launch/dschat.py --step 1 --model_name_or_path <model> --data_path Dahoas/rm-static \
        --data_split 2,4,4 --per_device_train_batch_size 8 --max_seq_len 512 --learning_rate 9.65e-6 \
        --num_train_epochs 1 --dtype bf16 --output_dir out/step1
    ... --step 2 --model_name_or_path <model> ... --output_dir out/step2
    ... --step 3 --actor_model_name_or_path out/step1 --critic_model_name_or_path out/step2 ... --output_dir out/step3

--data_split keeps DeepSpeed-Chat's meaning (each dataset shuffled with --seed and cut into three parts, one per
step); the datasets are local paths or Hub names already in the HF cache. Flags without a meaning here are named
in the error (rlhf/config/migration.py). The flags each step becomes are logged.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv=None) -> int:
    import argparse
    import logging

    from rlhf.distributed.env import DistEnv
    from rlhf.config.migration import DSCHAT_ENTRY, dschat_to_ours

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                add_help=False)
    p.add_argument("--step", type=int, choices=[1, 2, 3], required=True)
    known, rest = p.parse_known_args(argv)
    try:
        ours = dschat_to_ours(known.step, rest, DistEnv.from_environ().world_size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.getLogger("rlhf").info("dschat step %d -> launch/%s.py %s", known.step, DSCHAT_ENTRY[known.step],
                                   " ".join(ours))
    if known.step == 3:
        from rlhf.ppo import main as ppo_main

        return ppo_main(ours)
    from rlhf.supervised import rm
    from rlhf.supervised import sft
    from rlhf.supervised.loop import main as run_main

    return run_main(sft if known.step == 1 else rm, ours)


if __name__ == "__main__":
    from rlhf.distributed.failures import run_then_exit

    run_then_exit(main)  # run_then_exit(main): without the interpreter's teardown (its last full collection)
