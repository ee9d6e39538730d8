"""A job that never hangs (SFT and RM, 2 and 4 ranks): one rank's SIGKILL, SIGSTOP, or exception inside an
update, a collective or a checkpoint save ends the job within --dist_timeout_s with one line naming the rank and
the phase, publishes nothing partial and leaves no process behind; a launcher that dies takes its ranks with it;
under ``torchrun --max-restarts`` a job that loses a rank twice heals itself and ends bit-identical to an
uninterrupted run. rlhf/distributed/watchdog.py has the mechanisms; docs/reliability.md the measured times.

The negative controls run the same fault with the watchdog off (``RLHF_WATCHDOG=0``): a stall outside any
collective then outlives the bound, and ranks whose launcher died live on.
"""
import os
import signal
import time

import psutil
import torch
from crash_harness import (FAULT_TIMEOUT_S, Job, assert_ends_within, assert_fresh_start, assert_named, assert_resumed,
                           fault_job, job_processes, kill_job, leftovers)
from helpers import REPO

SFT = os.path.join(REPO, "launch/sft.py")
RM = os.path.join(REPO, "launch/rm.py")
T = FAULT_TIMEOUT_S
QUICK = 10.0
"""an exception or a death ends the job in about a second (torchrun's monitor, gloo's closed connections); the
bound leaves room for a loaded 2-core machine"""
STALL = T + 10.0
"""a stall is seen after --dist_timeout_s; the rest is the teardown"""


def sft_args(setup, save, **kw):
    args = {"--pretrain": setup["model"], "--dataset": setup["sft"], "--save_path": save, "--max_samples": "96",
            "--train_batch_size": "16", "--micro_train_batch_size": "4", "--max_len": "64", "--learning_rate": "1e-3",
            "--lr_warmup_ratio": "0.0", "--seed": "7", "--save_steps": "1"}
    args.update({k: str(v) for k, v in kw.items()})
    return [x for k, v in args.items() for x in ([k] if v == "" else [k, v])]


def rm_args(setup, save, **kw):
    return sft_args({"model": setup["model"], "sft": setup["rm"]}, save, **{
        "--prompt_key": "prompt", "--chosen_key": "chosen", "--rejected_key": "rejected", **kw})


def latest(save):
    with open(os.path.join(save, "checkpoints", "latest")) as f:
        return f.read().strip()


def published(save):
    return sorted(d for d in os.listdir(os.path.join(save, "checkpoints")) if d.startswith("iter_")
                  and not d.endswith(".tmp"))


def test_sigkill_of_one_rank_sft_2(train_setup, tmp_path):
    save = str(tmp_path / "o")
    r = fault_job(SFT, 2, sft_args(train_setup, save), signal_after=(r"\[sft 2/", 1, signal.SIGKILL))
    assert_ends_within(r, QUICK)
    assert_named(r, r"rank 1 \(pid \d+\) died in phase '\w+'")


def test_raise_in_checkpoint_save_publishes_nothing_sft_2(train_setup, tmp_path):
    """Rank 1 raises after the first role's shards of step 2 are written: the job ends, `latest` still names step 1
    and no step-2 folder is published."""
    save = str(tmp_path / "o")
    r = fault_job(SFT, 2, sft_args(train_setup, save), inject="raise:checkpoint_save:1:2")
    assert_ends_within(r, QUICK)
    assert_named(r, r"^error: rank 1 failed in phase 'checkpoint_save' \(step 2\): InjectedFault")
    assert latest(save) == "iter_0000001" and published(save) == ["iter_0000001"]


def test_raise_in_a_collective_sft_4(train_setup, tmp_path):
    r = fault_job(SFT, 4, sft_args(train_setup, str(tmp_path / "o")), inject="raise:collective:3:2")
    assert_ends_within(r, QUICK)
    assert_named(r, r"^error: rank 3 failed in phase 'update' \(step 2\): InjectedFault: injected fault at collective")


def test_raise_in_an_update_rm_2(train_setup, tmp_path):
    r = fault_job(RM, 2, rm_args(train_setup, str(tmp_path / "o")), inject="raise:update:0:2")
    assert_ends_within(r, QUICK)
    assert_named(r, r"^error: rank 0 failed in phase 'update' \(step 2\): InjectedFault")


def test_sigstop_of_one_rank_rm_4(train_setup, tmp_path):
    """A stopped rank answers nothing; its peers see it after --dist_timeout_s (collective timeout or heartbeat),
    name it, and kill it (on this host: torchrun would wait 30 s for a stopped process to take its SIGTERM)."""
    save = str(tmp_path / "o")
    r = fault_job(RM, 4, rm_args(train_setup, save), signal_after=(r"\[rm 2/", 2, signal.SIGSTOP))
    assert_ends_within(r, STALL, lo=T - 1)
    assert_named(r, r"rank 2 (has not answered for \d+ s|silent for \d+ s)")
    # Rank 2 stopped just after step 2's progress line, before or during step 2's save: step 1 or 2 is the last
    # one finished, `latest` names it, and nothing later exists; only the save in flight may have left its
    # temporary folder. (A save published without every rank, or a `latest` left behind, fails here.)
    k = int(latest(save).removeprefix("iter_"))
    assert k in (1, 2), latest(save)
    assert published(save) == [f"iter_{s:07d}" for s in range(1, k + 1)], published(save)
    tmp = sorted(d for d in os.listdir(os.path.join(save, "checkpoints")) if d.endswith(".tmp"))
    assert tmp in ([], [f"iter_{k + 1:07d}.tmp"]) and k + len(tmp) <= 2, tmp


def test_stall_outside_any_collective_ends_by_heartbeat_sft_2(train_setup, tmp_path):
    """Rank 1 stops at the export while rank 0 waits for it in the export's long barrier (hours of timeout: the
    conversion of a large model may take that long). Only the heartbeats see it. Negative control: with the
    watchdog off the same job is still waiting 5 s past the bound (then killed). The control runs beside the
    watched job (both stall idle after their few steps), so the test waits for the bound once, not twice."""
    job = Job(SFT, 2, sft_args(train_setup, str(tmp_path / "off"), **{"--dist_timeout_s": T}),
              RLHF_FAULT_INJECT="stop:export:1", RLHF_WATCHDOG="0")
    try:
        r = fault_job(SFT, 2, sft_args(train_setup, str(tmp_path / "o")), inject="stop:export:1")
        assert_ends_within(r, STALL, lo=T - 1)
        assert_named(r, r"^error: rank 0: rank 1 has not answered for \d+ s \(--dist_timeout_s 20\); it was last "
                        r"in phase 'export' \(step \d+\)")
        fault_at = job.wait_for(r"^fault injection: ", timeout=300)
        assert fault_at is not None, job.log[-3000:]
        while time.monotonic() < fault_at + STALL + 5:
            assert job.proc.poll() is None, f"the job ended without the watchdog:\n{job.log[-3000:]}"
            time.sleep(1)
    finally:
        kill_job(job.tag, job.proc.pid)
        job.proc.wait(timeout=60)


def test_ranks_end_with_their_launcher_sft_2(train_setup, tmp_path):
    """torchrun SIGKILLed alone, mid-run: its ranks get SIGKILL from the kernel (parent-death signal). Negative
    control: with the watchdog off they outlive it (rank 0 is made to hang at the export, so that they cannot
    simply finish first). Both jobs start together; each is checked in turn. torchrun's own launch: forkrun's ranks
    are children of torch's multiprocessing, which arms a parent-death SIGINT of its own."""
    jobs = {watchdog: Job(SFT, 2, sft_args(train_setup, str(tmp_path / f"w{watchdog}"), **{"--dist_timeout_s": T}),
                          launcher="torchrun", RLHF_WATCHDOG=watchdog, RLHF_FAULT_INJECT="hang:enter-export:0")
            for watchdog in ("1", "0")}
    try:
        for watchdog, expect_left in (("1", False), ("0", True)):
            job = jobs[watchdog]
            try:
                assert job.wait_for(r"\[sft 2/", timeout=300) is not None, job.log[-3000:]
                ranks = [p for p in job_processes(job.tag) if p.pid != job.proc.pid]
                assert len(ranks) >= 2
                psutil.Process(job.proc.pid).kill()
                job.proc.wait(timeout=60)
                gone, alive = psutil.wait_procs(ranks, timeout=5)
                assert bool(alive) == expect_left, (watchdog, [p.pid for p in alive])
            finally:
                left = leftovers(job.tag, grace=0 if expect_left else 5)
            assert bool(left) == expect_left, left
    finally:  # a failed check of the first job leaves the second running
        for job in jobs.values():
            kill_job(job.tag, job.proc.pid)
            job.proc.wait(timeout=60)


def test_healing_under_torchrun_max_restarts_is_exact_rm_2(train_setup, tmp_path):
    """One command line for every launch (--load_checkpoint starts fresh where nothing is published): rank 1 is
    SIGKILLed at step 3, then rank 0 stops at step 5's save; torchrun restarts the job twice, each attempt resumes
    from the latest checkpoint and runs only the remaining steps, and the exported model equals an uninterrupted
    run's bit for bit."""
    straight = str(tmp_path / "straight")
    job = Job(RM, 2, rm_args(train_setup, straight))
    rc, _ = job.wait()
    job.close()
    assert rc == 0, job.log[-3000:]
    save = str(tmp_path / "healed")
    job = Job(RM, 2, rm_args(train_setup, save, **{"--load_checkpoint": "", "--dist_timeout_s": T}),
              max_restarts=2, launcher="torchrun",
              RLHF_FAULT_INJECT="kill:update:1:3:0,stop:enter-checkpoint_save:0:5:1")
    rc, _ = job.wait()
    job.close()
    assert rc == 0, job.log[-3000:]
    log = job.log
    # the three attempts' logs, split at each attempt's start (the mesh line)
    attempts = log.split("INFO rlhf.distributed.mesh: mesh:")[1:]
    assert len(attempts) == 3, len(attempts)
    assert_fresh_start(attempts[0], "rm")
    assert assert_resumed(attempts[1], "rm") == 2  # killed in step 3: step 2 was the last published
    assert assert_resumed(attempts[2], "rm", total=6) == 4  # stopped entering step 5's save
    from safetensors.torch import load_file

    a, b = load_file(os.path.join(straight, "model.safetensors")), load_file(os.path.join(save, "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
