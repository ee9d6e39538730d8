"""--use_rollout_logprobs: the generator's log-probs serve as PPO's old log-probs and the actor's experience
forward is skipped. With one optimizer step per PPO step, the first update's ratio exp(trainer - generator)
is then 1 up to the vLLM/trainer drift, and --ignore_eos gives every response exactly --generate_max_len
tokens. With RLHF_OFFLOAD_ON_CPU=0 the CPU run moves nothing between phases and says so."""
import json
import os

from ppo_common import ppo_args
from helpers import REPO, run_torchrun, tail, require

PPO = os.path.join(REPO, "launch/ppo.py")
require("vllm")


def test_rollout_logprobs_as_old_logprobs(ppo_setup, tmp_path):
    save = str(tmp_path / "out")
    args = ppo_args(ppo_setup, save, **{"--use_rollout_logprobs": "", "--ignore_eos": "", "--max_epochs": 1,
                                        "--rollout_batch_size": 8, "--n_samples_per_prompt": 2,
                                        "--train_batch_size": 16, "--micro_rollout_batch_size": 8,
                                        "--num_episodes": 1, "--max_samples": 16})
    p = run_torchrun(PPO, 2, args, timeout=900, RLHF_OFFLOAD_ON_CPU="0")
    assert p.returncode == 0, tail(p)
    assert "the device is the CPU, so parameters and optimizer states stay" in p.stdout + p.stderr
    assert "gradients are still freed outside their own update" in p.stdout + p.stderr
    h = json.load(open(os.path.join(save, "ppo_result.json")))["history"]
    assert len(h) == 2
    for m in h:
        assert "time/actor_fwd" not in m and "time/ref_fwd" in m, sorted(m)
        assert "rollout_logprob_drift" not in m
        assert m["response_length"] == 6 and m["finished_frac"] == 0.0  # --ignore_eos: all 6 tokens
        assert abs(m["actor/ratio"] - 1.0) < 1e-4 and m["actor/approx_kl"] < 1e-8, m
        assert m["time/step_wall"] >= m["time/step"] * 0.99
