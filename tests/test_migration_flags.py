"""Launcher and placement flags of the seed systems (rlhf/config/migration.py): torch.distributed.launch's --local-rank,
DeepSpeed's --local_rank, AIAK-RLHF's node counts, OpenRLHF's Ray placement."""
from __future__ import annotations

import argparse
import os
import sys

import pytest
from helpers import REPO, free_port, run_tagged

from rlhf.config.migration import add_launcher_args, add_placement_args, apply_launcher_args


def parse(argv, ppo=False):
    p = argparse.ArgumentParser()
    add_launcher_args(p)
    if ppo:
        add_placement_args(p)
    return p.parse_args(argv)


def test_local_rank_fills_the_environment_only_when_absent():
    env = {"RANK": "0", "WORLD_SIZE": "1"}
    apply_launcher_args(parse(["--local-rank=3"]), env)
    assert env["LOCAL_RANK"] == "3"
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    apply_launcher_args(parse(["--local_rank", "5"]), env)  # DeepSpeed's spelling; the environment wins
    assert env["LOCAL_RANK"] == "0"


@pytest.mark.parametrize("argv,world,ok", [
    (["--num_nodes", "2", "--num_gpus_per_node", "8"], 16, True),
    (["--num_nodes", "2", "--num_gpus_per_node", "8"], 8, False),
    (["--num_nodes", "3"], 8, False),
    (["--num_gpus_per_node", "2"], 2, True),
])
def test_node_counts_are_checked_against_the_world(argv, world, ok):
    env = {"RANK": "0", "WORLD_SIZE": str(world)}
    if ok:
        apply_launcher_args(parse(argv), env)
    else:
        with pytest.raises(ValueError, match=r"--num_nodes .* do not match this job's \d+ ranks.*torchrun --nnodes"):
            apply_launcher_args(parse(argv), env)


def test_ray_placement_must_be_the_whole_job():
    env = {"RANK": "0", "WORLD_SIZE": "8"}
    apply_launcher_args(parse(["--actor_num_nodes", "1", "--actor_num_gpus_per_node", "8", "--colocate_actor_ref"],
                              ppo=True), env)
    with pytest.raises(ValueError, match=r"--critic_num_nodes 1 --critic_num_gpus_per_node 4: .*one colocated SPMD "
                                         r"job.*torchrun --nnodes 1 --nproc_per_node 4"):
        apply_launcher_args(parse(["--critic_num_nodes", "1", "--critic_num_gpus_per_node", "4"], ppo=True), env)


@pytest.mark.parametrize("entry", ["launch/sft.py", "launch/ppo.py"])
def test_torch_distributed_launch_passes_local_rank(entry, tmp_path):
    """``python -m torch.distributed.launch`` adds ``--local-rank=0``: the entry point parses it and stops at the
    first real check (the missing data file), not at argparse's "unrecognized arguments"."""
    missing = str(tmp_path / "missing.jsonl")
    flags = (["--dataset", missing] if entry.endswith("sft.py") else ["--prompt_data", missing, "--reward_fn",
                                                                      "_rule_reward:one_nan_reward"])
    cmd = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "1", "--master_port",
           str(free_port()), os.path.join(REPO, entry), "--pretrain", str(tmp_path), "--save_path",
           str(tmp_path / "o"), *flags]
    proc = run_tagged(cmd, 300)
    out = proc.stdout + proc.stderr
    assert "unrecognized arguments" not in out, out[-2000:]
    assert f"error: {'--dataset' if entry.endswith('sft.py') else '--prompt_data'}: not found: {missing}" in out, \
        out[-2000:]
