"""A job that never hangs, DPO on 2 and 4 ranks (the mechanisms and the SFT/RM cases:
tests/train/test_sft_rm_faults.py): an exception inside an update, and the SIGKILL of one rank, end the job
promptly with one line naming the rank and the phase, and leave no process behind."""
import os
import signal

from crash_harness import assert_ends_within, assert_named, fault_job
from helpers import REPO

DPO = os.path.join(REPO, "launch/dpo.py")
QUICK = 10.0  # as tests/train/test_sft_rm_faults.py


def dpo_args(setup, save):
    return ["--pretrain", setup["model"], "--dataset", setup["pref"], "--save_path", save, "--max_samples", "96",
            "--train_batch_size", "16", "--micro_train_batch_size", "4", "--max_len", "32", "--learning_rate", "1e-3",
            "--lr_warmup_ratio", "0.0", "--seed", "7", "--save_steps", "2"]


def test_raise_in_an_update_dpo_2(pref_setup, tmp_path):
    r = fault_job(DPO, 2, dpo_args(pref_setup, str(tmp_path / "o")), inject="raise:update:1:2")
    assert_ends_within(r, QUICK)
    assert_named(r, r"^error: rank 1 failed in phase 'update' \(step 2\): InjectedFault")


def test_sigkill_of_one_rank_dpo_4(pref_setup, tmp_path):
    r = fault_job(DPO, 4, dpo_args(pref_setup, str(tmp_path / "o")), signal_after=(r"\[dpo 2/", 3, signal.SIGKILL))
    assert_ends_within(r, QUICK)
    assert_named(r, r"rank 3 \(pid \d+\) died in phase '\w+'")
