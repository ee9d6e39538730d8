"""Flags users bring from the seed systems' launchers and Ray placement, accepted where they mean something in
one colocated SPMD job and refused with the replacement command where they do not.

* ``--local-rank=N`` (``python -m torch.distributed.launch``) and ``--local_rank N`` (the DeepSpeed launcher):
  every entry point accepts them; the environment (``LOCAL_RANK``) decides, the flag only fills it when absent.
* ``--num_nodes`` x ``--num_gpus_per_node`` (AIAK-RLHF): checked against the job's world size.
* OpenRLHF's per-role placement (PPO): ``--{actor,critic,ref,reward}_num_nodes`` / ``_num_gpus_per_node`` must
  describe the whole job (every role is on every rank here); ``--colocate_actor_ref``,
  ``--colocate_critic_reward`` are what this trainer always does.
"""
from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger(__name__)

ROLES = ("actor", "critic", "ref", "reward")


def add_launcher_args(p: argparse.ArgumentParser) -> None:
    """Added to every entry point by ``rlhf.config.cli_main``."""
    g = p.add_argument_group("launchers (compatibility)")
    g.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None,
                   help="added by torch.distributed.launch / deepspeed; LOCAL_RANK in the environment wins")
    g.add_argument("--num_nodes", type=int, default=None, help="AIAK-RLHF: nodes of the job (checked)")
    g.add_argument("--num_gpus_per_node", type=int, default=None, help="AIAK-RLHF: ranks per node (checked)")


def add_placement_args(g) -> None:
    """OpenRLHF's Ray placement flags (PPO)."""
    for role in ROLES:
        g.add_argument(f"--{role}_num_nodes", type=int, default=None, help=argparse.SUPPRESS)
        g.add_argument(f"--{role}_num_gpus_per_node", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--colocate_actor_ref", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--colocate_critic_reward", action="store_true", help=argparse.SUPPRESS)


def _relaunch(nodes: int, per_node: int) -> str:
    return (f"torchrun --nnodes {nodes} --nproc_per_node {per_node} launch/<entry>.py ... (Slurm: srun -N {nodes} "
            f"--ntasks-per-node {per_node} ...)")


def apply_launcher_args(args: argparse.Namespace, environ: dict | None = None) -> None:
    """Before anything else: the launcher's local rank into the environment when it has none, and the node
    counts against the world size. ValueError naming the flag otherwise."""
    from rlhf.distributed.env import DistEnv

    environ = os.environ if environ is None else environ
    local_rank = getattr(args, "local_rank", None)
    if local_rank is not None:
        if "LOCAL_RANK" not in environ:
            environ["LOCAL_RANK"] = str(local_rank)
        log.debug("--local-rank %d ignored in favour of LOCAL_RANK=%s", local_rank, environ["LOCAL_RANK"])
    world = DistEnv.from_environ(environ).world_size
    nodes, per_node = getattr(args, "num_nodes", None), getattr(args, "num_gpus_per_node", None)
    for flag, v in (("--num_nodes", nodes), ("--num_gpus_per_node", per_node)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    local_world = int(environ.get("LOCAL_WORLD_SIZE", 0)) or None
    if nodes is not None and per_node is not None:
        ok = nodes * per_node == world
    elif nodes is not None:
        ok = world % nodes == 0
    elif per_node is not None:
        ok = per_node == local_world if local_world else world % per_node == 0
    else:
        ok = True
    if not ok:
        n = nodes or max(world // (per_node or world), 1)
        raise ValueError(f"--num_nodes {nodes} --num_gpus_per_node {per_node} do not match this job's {world} ranks"
                         f"{f' ({local_world} per node)' if local_world else ''}: the launcher decides the ranks; "
                         f"start it with {_relaunch(n, per_node or max(world // n, 1))}")
    _check_role_placement(args, world)


def _check_role_placement(args: argparse.Namespace, world: int) -> None:
    given = {r: (getattr(args, f"{r}_num_nodes", None), getattr(args, f"{r}_num_gpus_per_node", None))
             for r in ROLES}
    for role, (nodes, per_node) in given.items():
        if nodes is None and per_node is None:
            continue
        n, g = nodes or 1, per_node or 1
        if n * g != world:
            raise ValueError(f"--{role}_num_nodes {nodes} --{role}_num_gpus_per_node {per_node}: this trainer is one "
                             f"colocated SPMD job in which every role (actor, critic, reference, reward, vLLM) runs on "
                             f"all {world} ranks; there are no Ray placement groups. Drop the placement flags and "
                             f"start the job on the GPUs you want, e.g. {_relaunch(n, g)}")
        log.info("--%s_num_nodes/--%s_num_gpus_per_node: %d rank(s), the whole job (every role is colocated)", role,
                 role, n * g)
    for flag in ("colocate_actor_ref", "colocate_critic_reward"):
        if getattr(args, flag, False):
            log.info("--%s: every role already shares every rank here (--colocate_all)", flag)
