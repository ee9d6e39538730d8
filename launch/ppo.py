"""PPO / GRPO / REINFORCE++ with four colocated models and in-process vLLM, in one SPMD job.

    torchrun --nproc_per_node 2 launch/ppo.py --pretrain <actor HF dir> --reward_pretrain <RM HF dir> \
        --prompt_data prompts.jsonl --input_key prompt --vllm_tensor_parallel_size 2 \
        --rollout_batch_size 16 --n_samples_per_prompt 2 --train_batch_size 16 --micro_train_batch_size 4 \
        --micro_rollout_batch_size 8 --generate_max_len 16 --save_path out/ppo

Flags follow OpenRLHF / AIAK-RLHF (``--help`` lists them). Bad input prints ``error: ...`` and exits 2.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rlhf.ppo import main  # noqa: E402

if __name__ == "__main__":
    from rlhf.distributed.failures import run_then_exit

    run_then_exit(main)  # run_then_exit(main): without the interpreter's teardown (its last full collection)
