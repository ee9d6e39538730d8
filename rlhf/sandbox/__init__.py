"""A sandbox for model-written programs (RL on code): ``run_batch`` runs a reply's programs one after another in one
sandbox, each with its own stdin, limits and verdict, isolated by bubblewrap's namespaces, a host uid of the run's
own, a seccomp filter, a cgroup and rlimits (``rlhf.sandbox.core``); ``run_program`` runs one. ``python -m
rlhf.sandbox`` is its command line, ``rlhf.sandbox.fusion`` the SandboxFusion-compatible HTTP client and server,
``rlhf.sandbox.code_reward`` the reward that grades replies with test cases. Imports nothing heavy (no torch)."""
from rlhf.sandbox.core import LAYERS, STATUSES, Run, SandboxConfig, SandboxResult, probe, run_batch, run_program

__all__ = ["LAYERS", "STATUSES", "Run", "SandboxConfig", "SandboxResult", "probe", "run_batch", "run_program"]
