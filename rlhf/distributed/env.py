"""Where this process sits in the job: rank, world size, local rank and the rendezvous address.

One SPMD job can be started by torchrun, by OpenMPI's ``mpirun`` or by Slurm's ``srun``; each announces the
rank layout through its own environment variables. ``DistEnv.from_environ`` reads whichever is present
(torchrun first, then OpenMPI, then Slurm) so the rest of the code never looks at the environment again.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    """Rank layout of this process, independent of the launcher that produced it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "openmpi" | "slurm" | "single"

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size} (from {self.launcher})")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size} (from {self.launcher})")
        if self.local_rank < 0:
            raise ValueError(f"local rank must be >= 0, got {self.local_rank} (from {self.launcher})")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"MASTER_PORT={self.master_port} is not a valid port")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "DistEnv":
        env = os.environ if environ is None else environ
        addr = env.get("MASTER_ADDR")
        port = _port(env.get("MASTER_PORT"))
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                       addr or "127.0.0.1", port, "torchrun")
        if "OMPI_COMM_WORLD_RANK" in env:
            return cls(int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                       int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)), addr or "127.0.0.1", port, "openmpi")
        if "SLURM_PROCID" in env:
            world = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
            if world is None:
                raise ValueError("SLURM_PROCID is set but neither SLURM_NTASKS nor SLURM_NPROCS is")
            if addr is None:
                nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
                addr = first_slurm_host(nodelist) if nodelist else "127.0.0.1"
            if env.get("MASTER_PORT") is None and env.get("SLURM_JOB_ID"):
                # Every task of a job derives the same port, and concurrent jobs on one node rarely collide.
                port = 20000 + int(env["SLURM_JOB_ID"]) % 20000
            return cls(int(env["SLURM_PROCID"]), int(world), int(env.get("SLURM_LOCALID", 0)), addr, port, "slurm")
        return cls(0, 1, 0, addr or "127.0.0.1", port, "single")

    def export(self) -> None:
        """Write the torchrun-style variables, which torch.distributed's env:// rendezvous and vLLM read."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
                          MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))


def _port(value: str | None) -> int:
    if value is None:
        return DEFAULT_MASTER_PORT
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"MASTER_PORT={value!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``node[003-005,007],gpu1`` -> ``node003``.

    This is what ``scontrol show hostnames | head -1`` prints, without needing scontrol on the compute node.
    """
    nodelist = nodelist.strip()
    m = re.match(r"^([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        raise ValueError(f"cannot parse Slurm node list {nodelist!r}")
    prefix, _, ranges = m.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


# What torchrun (and our launchers) put in a rank's environment. A child process started from a rank with these
# set would try to join the job's rendezvous instead of running on its own.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def env_without_launcher(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default: ``os.environ``) without torchrun's rank variables and ``TORCHELASTIC_*``."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if not k.startswith("TORCHELASTIC") and k not in LAUNCHER_VARS}


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port for a local rendezvous (torchrun ``--master_port``, a spawned job's store).

    It is drawn below the kernel's ephemeral range (``ip_local_port_range``): a port the kernel hands out for
    ``bind(0)`` lies inside that range, where any outgoing connection (gloo opens many) may take it again before
    the store binds it, which made concurrent jobs fail with EADDRINUSE."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low) if low > 2048 else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free TCP port found on {host}")


def local_world_size(environ: Mapping[str, str] | None = None) -> int:
    """Ranks on this node as the launcher states it (torchrun, Open MPI, SLURM with a uniform task count); 1 when
    no launcher says."""
    env = os.environ if environ is None else environ
    for key in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = env.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1
