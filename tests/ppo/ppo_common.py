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


def family_grpo_job(setup, path, arch, layout, tmp_path):
    """A 2-step GRPO job on 2 ranks for one model family (tests/ppo/test_families_moe.py, test_families_hybrid.py):
    the generator's log-probs within 1e-4 of the trainer's in every step, gradients non-zero, with R3 (when the
    layout asks for it) no routing flip and no replayed expert differing from the generator's; the export loads in
    transformers as ``arch`` under the source's tensor names and training moved the weights. Returns the source's
    and the export's tensors."""
    import glob
    import os

    import torch
    import transformers
    from helpers import REPO, run_torchrun, tail
    from safetensors.torch import load_file

    here = os.path.dirname(os.path.abspath(__file__))
    save, dump = str(tmp_path / "out"), tmp_path / "dump"
    dump.mkdir()
    args = ppo_args({**setup, "actor": path}, save,
                    **{"--advantage_estimator": "grpo", "--rollout_batch_size": 4, "--n_samples_per_prompt": 2,
                       "--train_batch_size": 8, "--micro_train_batch_size": 4, "--micro_rollout_batch_size": 4,
                       "--num_episodes": 1, "--max_samples": 8, "--init_kl_coef": 0.05,
                       "--reward_fn": "_rule_reward:length_reward", "--reward_pretrain": None,
                       "--generate_max_len": 6, **layout})
    replay = "--moe_router_replay" in layout
    script = os.path.join(here, "_routing_worker.py") if replay else os.path.join(REPO, "launch/ppo.py")
    p = run_torchrun(script, 2, args, timeout=900, PYTHONPATH=f"{REPO}{os.pathsep}{here}",
                     RLHF_TEST_ROUTING_DUMP=str(dump))
    assert p.returncode == 0, tail(p)
    hist = json.load(open(os.path.join(save, "ppo_result.json")))["history"]
    assert len(hist) == 2
    for m in hist:
        assert m["rollout_logprob_drift_max"] <= 1e-4, m
        assert m["actor/grad_norm"] > 0, m
        if replay:
            assert m["moe/routing_flip_tokens"] == 0.0, m
    if replay:
        counts = [json.load(open(dump / f"rank{r}.json")) for r in (0, 1)]
        assert all(c["replay_forward"] > 0 and c["replayed_flips"] == 0 for c in counts), counts
    model = transformers.AutoModelForCausalLM.from_pretrained(save, dtype=torch.float32)
    assert type(model).__name__ == arch
    before = load_file(os.path.join(path, "model.safetensors"))
    after = {k: v for f in glob.glob(os.path.join(save, "*.safetensors")) for k, v in load_file(f).items()}
    assert set(before) == set(after)  # the checkpoint's own names (DeepSeek's MTP layer's tensors too)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    return before, after
