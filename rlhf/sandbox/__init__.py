"""A sandbox for model-written programs (RL on code): ``run_program`` runs one Python program isolated by bubblewrap's
namespaces, a seccomp filter, a cgroup and rlimits (``rlhf.sandbox.core``); ``python -m rlhf.sandbox`` is its command
line, ``rlhf.sandbox.fusion`` the SandboxFusion-compatible HTTP client and server, ``rlhf.sandbox.code_reward`` the
reward that grades replies with test cases. Imports nothing heavy (no torch)."""
from rlhf.sandbox.core import LAYERS, STATUSES, SandboxConfig, SandboxResult, probe, run_program

__all__ = ["LAYERS", "STATUSES", "SandboxConfig", "SandboxResult", "probe", "run_program"]
