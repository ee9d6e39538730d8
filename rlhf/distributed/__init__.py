"""Distributed runtime: launcher-independent rank discovery and the megatron mesh (the CPU shim for megatron is
``rlhf.compat.cuda``)."""
from rlhf.distributed.env import DistEnv
from rlhf.distributed.mesh import ParallelMesh, destroy_mesh, initialize_mesh, validate_layout

__all__ = ["DistEnv", "ParallelMesh", "initialize_mesh", "destroy_mesh", "validate_layout"]
