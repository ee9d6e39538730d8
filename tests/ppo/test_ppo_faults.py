"""A job that never hangs, PPO with vLLM in every rank, 2 and 4 ranks (the mechanisms and the SFT/RM cases:
tests/train/test_sft_rm_faults.py): an exception inside the weight sync, a rank stopped (SIGSTOP) as it starts a rollout,
a rank SIGKILLed inside a data-parallel collective: the job ends within --dist_timeout_s with one line naming the
rank and the phase, publishes nothing partial and leaves no process behind (vLLM's included)."""
import os

from crash_harness import FAULT_TIMEOUT_S, assert_ends_within, assert_named, fault_job
from helpers import REPO, require
from ppo_common import ppo_args

PPO = os.path.join(REPO, "launch/ppo.py")
require("vllm")
QUICK, STALL = 10.0, FAULT_TIMEOUT_S + 10.0  # as tests/train/test_sft_rm_faults.py


def test_raise_in_weight_sync_ppo_2(ppo_setup, tmp_path):
    save = str(tmp_path / "o")
    r = fault_job(PPO, 2, ppo_args(ppo_setup, save, **{"--save_steps": 1}), inject="raise:weight_sync:1:2")
    assert_ends_within(r, QUICK)
    assert_named(r, r"^error: rank 1 failed in phase 'weight_sync' \(step 2\): InjectedFault")
    assert open(os.path.join(save, "checkpoints", "latest")).read().strip() == "iter_0000001"


def test_sigstop_in_rollout_ppo_2(ppo_setup, tmp_path):
    """Rank 0 stops as its rollout starts, rank 1 waits inside vLLM's own collectives (whose groups keep
    vLLM's timeouts): the heartbeat names rank 0 and its phase."""
    r = fault_job(PPO, 2, ppo_args(ppo_setup, str(tmp_path / "o")), inject="stop:enter-rollout:0:2")
    assert_ends_within(r, STALL, lo=FAULT_TIMEOUT_S - 1)
    assert_named(r, r"rank 0 (has not answered for \d+ s|silent for \d+ s).* phase 'rollout' \(step 2\)")


def test_sigkill_in_a_collective_ppo_4(ppo_setup, tmp_path):
    r = fault_job(PPO, 4, ppo_args(ppo_setup, str(tmp_path / "o")), inject="kill:collective:2:1")
    assert_ends_within(r, QUICK)
    assert_named(r, r"rank 2 \(pid \d+\) died in phase '\w+' \(step 1\)")
