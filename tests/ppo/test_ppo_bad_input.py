"""Bad PPO input: a clear ``error:`` naming the flag, exit code 2, and no model loaded (checked by making model
construction fail loudly). An over-long prompt is not an error: it is truncated and counted."""
import argparse
import json

import pytest
from ppo_common import ppo_args, write_prompts


def run_main(argv, capsys):
    from rlhf.ppo import main

    code = main(argv)
    return code, capsys.readouterr().err


def test_empty_prompt_file(ppo_setup, tmp_path, no_models, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, err = run_main(ppo_args(ppo_setup, str(tmp_path / "o"), **{"--prompt_data": empty}), capsys)
    assert code == 2 and "error:" in err and "empty.jsonl" in err, err


def test_missing_input_key(ppo_setup, tmp_path, no_models, capsys):
    data = write_prompts(tmp_path / "q.jsonl", 8, key="question")
    code, err = run_main(ppo_args(ppo_setup, str(tmp_path / "o"), **{"--prompt_data": data}), capsys)
    assert code == 2 and "prompt" in err and "q.jsonl" in err and "line 1" in err, err


@pytest.mark.parametrize("flags,needle", [
    ({"--train_batch_size": 24}, "--train_batch_size 24"),
    ({"--micro_train_batch_size": 5}, "--micro_train_batch_size 5"),
    ({"--micro_rollout_batch_size": 6}, "--micro_rollout_batch_size 6"),
    ({"--rollout_batch_size": 15, "--vllm_tensor_parallel_size": 1}, "--rollout_batch_size 15"),
    ({"--vllm_num_engines": 2}, "--vllm_num_engines 2"),
    ({"--advantage_estimator": "grpo", "--n_samples_per_prompt": 1, "--train_batch_size": 16,
      "--micro_rollout_batch_size": 8}, "--n_samples_per_prompt"),
    ({"--advantage_estimator": "ppo2"}, "--advantage_estimator"),
    ({"--use_rollout_logprobs": "", "--use_tis": ""}, "--use_tis"),
    ({"--no-colocate_all": ""}, "--no-colocate_all"),
    # on-policy distillation: its flags without a teacher, a teacher that is no model folder
    ({"--distill_coef": 0.5}, "--distill_coef 0.5 needs --teacher_pretrain"),
    ({"--task_reward_coef": 0}, "--task_reward_coef 0.0 needs --teacher_pretrain"),
    ({"--teacher_pretrain": "/nonexistent/teacher"}, "--teacher_pretrain /nonexistent/teacher"),
    ({"--teacher_pretrain": "/nonexistent/teacher", "--distill_coef": 0}, "--distill_coef must be > 0"),
    ({"--lora_rank": 4, "--target_modules": "foo"}, "--target_modules: unknown module 'foo'"),
    ({"--critic_lora_rank": -1}, "--critic_lora_rank must be >= 0"),
    ({"--lora_sync": "adapter"}, "--lora_sync adapter needs a LoRA actor (--lora_rank > 0)"),
    ({"--lora_sync": "adapter", "--lora_rank": 4, "--rollout_backend": "megatron"},
     "--lora_sync adapter with --rollout_backend megatron: only vLLM serves adapters"),
    ({"--lora_sync": "adapter", "--lora_rank": 600}, "--lora_rank 600 with --lora_sync adapter"),
    ({"--rollout_batch_size": 128, "--train_batch_size": 64, "--micro_rollout_batch_size": 16},
     "larger than the number of prompts"),
    # the RLVR options: each bad combination, before any model
    ({"--advantage_estimator": "rloo", "--n_samples_per_prompt": 1}, "--advantage_estimator rloo needs "
                                                                      "--n_samples_per_prompt >= 2"),
    ({"--advantage_estimator": "reinforce_baseline", "--gamma": 0.9}, "--gamma 0.9"),
    ({"--policy_loss_type": "gspo"}, "--policy_loss_type gspo with --advantage_estimator gae"),
    ({"--policy_loss_type": "gspo", "--advantage_estimator": "grpo", "--loss_agg_mode": "token_mean"},
     "--policy_loss_type gspo with --loss_agg_mode token_mean"),
    ({"--dual_clip": 0.5}, "--dual_clip must be > 1"),
    ({"--entropy_coef": -1}, "--entropy_coef must be >= 0"),
    ({"--no_std_norm": "", "--advantage_estimator": "grpo"}, "--no_std_norm with --advantage_estimator grpo"),
    # verl's policy losses: their parameters, and what their losses do not have
    ({"--policy_loss_type": "sapo", "--tau_neg": 0}, "--tau_neg must be > 0"),
    ({"--policy_loss_type": "clip_cov", "--clip_cov_ratio": 2}, "--clip_cov_ratio must be in (0, 1]"),
    ({"--policy_loss_type": "sapo", "--loss_agg_mode": "token_mean"}, "--policy_loss_type sapo with --loss_agg_mode"),
    ({"--policy_loss_type": "cispo", "--dual_clip": 3}, "--policy_loss_type cispo with --dual_clip"),
    ({"--policy_loss_type": "kl_cov", "--context_parallel_size": 2, "--vllm_tensor_parallel_size": 1},
     "--policy_loss_type kl_cov with --context_parallel_size 2"),
])
def test_batch_and_flag_errors(ppo_setup, tmp_path, no_models, capsys, flags, needle):
    code, err = run_main(ppo_args(ppo_setup, str(tmp_path / "o"), **flags), capsys)
    assert code == 2 and needle in err, err


def test_lora_adapter_sync_refuses_moe(ppo_setup, family_actors, tmp_path, no_models, capsys):
    code, err = run_main(ppo_args(ppo_setup, str(tmp_path / "o"), **{
        "--pretrain": family_actors["mixtral"], "--lora_rank": 4, "--lora_sync": "adapter"}), capsys)
    assert code == 2 and "--lora_sync adapter: a MoE actor (mixtral)" in err, err


def test_unsupported_head_dim_for_vllm_cpu(ppo_setup, tmp_path, no_models, capsys):
    from rlhf.models.tiny import make_tiny_hf

    small = make_tiny_hf(str(tmp_path / "hd16"), "llama", tokenizer_dir=ppo_setup["actor"], num_hidden_layers=1)
    code, err = run_main(ppo_args(ppo_setup, str(tmp_path / "o"), **{"--pretrain": small}), capsys)
    assert code == 2 and "head_dim=16" in err and "--rollout_backend megatron" in err, err


def test_long_prompt_truncated_and_counted(ppo_setup, tmp_path):
    from transformers import AutoTokenizer

    from rlhf.ppo import load_prompts
    from rlhf.ppo.args import add_args

    path = tmp_path / "long.jsonl"
    rows = [{"prompt": "say: apple"}, {"prompt": "say: " + " ".join(["banana cherry"] * 40)}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(ppo_args(ppo_setup, str(tmp_path / "o"), **{"--prompt_data": path, "--prompt_max_len": 16}))
    tok = AutoTokenizer.from_pretrained(ppo_setup["actor"])
    prompts, stats = load_prompts(args, tok)
    assert stats == {"num_prompts": 2, "num_truncated": 1}
    long, short = sorted(prompts, key=lambda s: -len(s.prompt))
    assert len(long.prompt_ids) == 16 and len(short.prompt_ids) < 16
    full = tok(rows[1]["prompt"])["input_ids"]
    assert long.prompt_ids.tolist()[-8:] == full[-8:]  # left-truncated: the end of the prompt survives


@pytest.mark.parametrize("flags,extra,needle", [
    ({"--dynamic_filtering": ""}, [], "--dynamic_filtering filters on the scores of a rule reward"),
    ({"--dynamic_filtering": "", "--reward_pretrain": None, "--reward_fn": "rlhf.demo.sort_task:gold_rewards",
      "--advantage_estimator": "grpo"}, ["--dynamic_filtering_range", "1", "0"], "--dynamic_filtering_range 1 0"),
    ({"--dynamic_filtering": "", "--reward_pretrain": None, "--reward_fn": "rlhf.demo.sort_task:gold_rewards",
      "--n_samples_per_prompt": 1}, [], "--dynamic_filtering with --n_samples_per_prompt 1"),
    ({"--overlong_buffer_len": 7}, [], "--overlong_buffer_len 7.0 must be in (0, --generate_max_len 6]"),
    ({"--stop_properly_penalty_coef": 2}, [], "--stop_properly_penalty_coef 2.0"),
])
def test_shaping_and_filtering_errors(ppo_setup, tmp_path, no_models, capsys, flags, extra, needle):
    code, err = run_main(ppo_args(ppo_setup, str(tmp_path / "o"), **flags) + extra, capsys)
    assert code == 2 and needle in err, err


def test_openrlhf_spellings_of_the_rlvr_flags():
    """OpenRLHF's current dotted names land in the same destinations as ours."""
    from rlhf.ppo.args import add_args

    p = argparse.ArgumentParser()
    add_args(p)
    base = ["--pretrain", "x", "--prompt_data", "y", "--save_path", "z"]
    ours = p.parse_args(base + ["--eps_clip_low_high", "0.2", "0.28", "--dual_clip", "3", "--policy_loss_type", "gspo",
                                "--entropy_coef", "0.01", "--advantage_estimator", "rloo", "--no_std_norm"])
    theirs = p.parse_args(base + ["--actor.eps_clip_low_high", "0.2", "0.28", "--actor.dual_clip", "3",
                                  "--actor.policy_loss_type", "gspo", "--actor.entropy_coef", "0.01",
                                  "--algo.advantage.estimator", "rloo", "--algo.advantage.no_std_norm"])
    assert vars(ours) == vars(theirs)
    assert ours.eps_clip_low_high == [0.2, 0.28] and ours.dual_clip == 3 and ours.no_std_norm

