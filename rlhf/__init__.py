"""Megatron-style, 3D-parallel, single-job RLHF trainer. Importing this package imports no heavy dependency."""
from rlhf.compat.lazy_jit import install as _install_lazy_jit
from rlhf.compat.quiet import quiet_megatron as _quiet_megatron

__version__ = "0.1.0"
_install_lazy_jit()  # megatron-core's torch.compile decorators compile at first call (rlhf/compat/lazy_jit.py)
_quiet_megatron()  # megatron-core's Transformer Engine / Apex fallback warnings (rlhf/compat/quiet.py)
