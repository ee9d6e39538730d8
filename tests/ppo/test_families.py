"""A few PPO (GRPO) steps with each newer family, end to end on 2 ranks: the megatron actor at TP 2 or EP 2,
vLLM at TP 2, a rule reward (no reward model, no critic: the cheapest full loop).

qwen3_yarn_kv1: Qwen3 (q/k norms, explicit head_dim) with YaRN RoPE and one KV head, replicated over TP 2 in both
engines; llama3_rope: Llama 3.1-style RoPE scaling; mixtral and qwen3_moe: experts over 2 EP ranks (megatron at
TP 1, which MoE training needs), synced into vLLM's CPU MoE layers; mixtral with the load-balancing loss.
Prompts run past the original context (16 tokens). Every step logs the largest |vLLM - trainer| log-prob over
the sampled tokens; it stays at fp32 rounding, so weight sync, KV-head replication, the scaled RoPE and the
experts agree between the two engines. The export loads in transformers as the same family with the same RoPE
and KV heads, under the checkpoint's own tensor names, and training moved its weights.
"""
import glob
import json
import os

import pytest
import torch
from helpers import REPO, run_torchrun, tail, require
from ppo_common import ppo_args

require("vllm")
PPO = os.path.join(REPO, "launch/ppo.py")


@pytest.mark.parametrize("actor,arch,layout", [("qwen3_yarn_kv1", "Qwen3ForCausalLM", {"--tp": 2}),
                                               # and vLLM's KV cache sized to the batch (no flag)
                                               ("llama3_rope", "LlamaForCausalLM", {"--tp": 2,
                                                                                    "--vllm_kv_cache_mb": None}),
                                               ("mixtral", "MixtralForCausalLM", {"--ep": 2, "--aux_loss_coef": 0.01}),
                                               ("qwen3_moe", "Qwen3MoeForCausalLM", {"--ep": 2})])
def test_grpo_steps_with_newer_families(ppo_setup, family_actors, tmp_path, actor, arch, layout):
    import transformers
    from safetensors.torch import load_file

    save = str(tmp_path / "out")
    args = ppo_args({**ppo_setup, "actor": family_actors[actor]}, save,
                    **{"--advantage_estimator": "grpo", **layout, "--rollout_batch_size": 8,
                       "--train_batch_size": 16, "--micro_rollout_batch_size": 8, "--num_episodes": 1,
                       "--max_samples": 16, "--init_kl_coef": 0.05, "--reward_fn": "_rule_reward:length_reward",
                       "--reward_pretrain": None, "--generate_max_len": 8})
    p = run_torchrun(PPO, 2, args, timeout=900, PYTHONPATH=f"{REPO}{os.pathsep}{os.path.dirname(__file__)}")
    assert p.returncode == 0, tail(p)
    hist = json.load(open(os.path.join(save, "ppo_result.json")))["history"]
    assert len(hist) == 2
    for m in hist:
        assert m["rollout_logprob_drift_max"] <= 1e-4, m
        if "--aux_loss_coef" in layout:  # megatron's load-balancing loss, summed over the 2 MoE layers (1 each
            assert 1.0 < m["actor/moe_load_balancing_loss"] < 8.0, m  # when balanced; 4 experts at most)
    src = json.load(open(os.path.join(family_actors[actor], "config.json")))
    out = json.load(open(os.path.join(save, "config.json")))
    assert out["architectures"] == [arch]
    for key in ("num_key_value_heads", "head_dim", "rope_parameters", "rope_scaling"):
        assert out.get(key) == src.get(key), key
    model = transformers.AutoModelForCausalLM.from_pretrained(save, dtype=torch.float32)
    assert type(model).__name__ == arch
    before = load_file(os.path.join(family_actors[actor], "model.safetensors"))
    after = {k: v for f in glob.glob(os.path.join(save, "*.safetensors")) for k, v in load_file(f).items()}
    assert set(before) == set(after)  # the checkpoint's own names (per-expert for MoE)
    assert any(not torch.equal(before[k], after[k]) for k in before)
