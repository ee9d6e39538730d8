"""megatron-core's state-space layers (``megatron.core.ssm``) on hosts without their CUDA packages."""
from __future__ import annotations

from rlhf.compat import check_versions

check_versions(("megatron-core",))


# megatron-core 0.16.1: GatedDeltaNet.__init__ raises ImportError when flash-linear-attention is absent (CPU).
def gated_delta_net_without_fla() -> None:
    """Let megatron's ``GatedDeltaNet`` build without fla: ``rlhf.models.hybrid.GatedDeltaNetLayer`` replaces its
    forward, whose only fla calls (``l2norm``, ``chunk_gated_delta_rule``) then dispatch in
    ``rlhf.kernels.gated_delta``."""
    from megatron.core.ssm import gated_delta_net

    gated_delta_net.HAVE_FLA = True
