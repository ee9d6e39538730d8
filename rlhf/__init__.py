"""Megatron-style, 3D-parallel, single-job RLHF trainer. Importing this package imports no heavy dependency."""
__version__ = "0.1.0"
