"""Shared by the PPO tests: tiny model dims, prompt files, launch/ppo.py arguments."""
import json
import random

WORDS = "apple banana cherry delta echo golf hotel india juliet kilo lima mike".split()
# head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ...
DIMS = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2)


def write_prompts(path, n, seed=0, key="prompt"):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({key: "say: " + " ".join(rng.sample(WORDS, 3))}) + "\n")
    return str(path)


TINY_GRPO = {"--reward_pretrain": None, "--advantage_estimator": "grpo", "--vllm_tensor_parallel_size": "1",
             "--rollout_batch_size": "4", "--n_samples_per_prompt": "2", "--train_batch_size": "8",
             "--micro_train_batch_size": "4", "--micro_rollout_batch_size": "4", "--generate_max_len": "3"}
"""One rank, GRPO, 4 prompts x 2 samples of 3 tokens, one update per step, no reward model (add --reward_fn)."""


def ppo_args(setup, save, **kw):
    args = {"--pretrain": setup["actor"], "--reward_pretrain": setup["rm"], "--prompt_data": setup["prompts"],
            "--input_key": "prompt", "--save_path": save, "--vllm_tensor_parallel_size": "2",
            "--rollout_batch_size": "16", "--n_samples_per_prompt": "4", "--train_batch_size": "32",
            "--micro_train_batch_size": "8", "--micro_rollout_batch_size": "16", "--generate_max_len": "6",
            "--prompt_max_len": "32", "--actor_learning_rate": "1e-2", "--critic_learning_rate": "1e-2",
            "--max_epochs": "2", "--lr_warmup_ratio": "0", "--lr_scheduler": "constant", "--seed": "3",
            "--vllm_kv_cache_mb": "32"}
    args.update({k: str(v) for k, v in kw.items() if v is not None})
    for k in [k for k, v in kw.items() if v is None]:  # None drops a default flag
        args.pop(k, None)
    out = []
    for k, v in args.items():
        out += [k] if v == "" else [k, v]
    return out
