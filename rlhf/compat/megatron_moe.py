"""megatron-core 0.16.1's MoE layers: workarounds for experts with biases and for the token dispatcher's uneven
gathers on CPU (checked against the installed release at import)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.compat import check_versions

check_versions(("megatron-core", "torch"))


# megatron-core 0.16.1, experts with biases (expert-TP 1 only): MLP.forward adds the fc2 bias in place to a view
# autograd forbids to modify at TP 1 / EP 1. At TP > 1 (sequence parallel) finalize_model_grads sums that bias (marked
# sequence_parallel) over TP on top of the DDP's expert-DP sum, which holds the TP ranks: 2x (measured, gpt_oss); and
# without EP megatron marks no expert parameter an expert's (allreduce), so the DDP missed the other TP ranks' tokens.
def expert_fc2_bias(model: torch.nn.Module) -> int:
    """Biased experts: ``linear_fc2`` returns a fresh output; gradients summed once. Returns how many wrapped."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.experts import SequentialMLP

    whole = ps.model_parallel_is_initialized() and (ps.get_expert_tensor_parallel_world_size()
                                                    < ps.get_tensor_model_parallel_world_size())
    wrapped = 0
    for module in model.modules():
        if not isinstance(module, SequentialMLP):
            continue
        for expert in module.local_experts:
            fc2 = expert.linear_fc2
            for p in expert.parameters() if whole else ():  # reduced once, over expert-DP (TP included)
                p.allreduce, p.sequence_parallel = False, False
            if fc2.bias is None or getattr(fc2, "_rlhf_bias_wrapped", False):
                continue
            orig = fc2.forward

            def forward(x, *args, _orig=orig, **kwargs):
                out, bias = _orig(x, *args, **kwargs)
                return out.clone(), bias

            fc2.forward, fc2._rlhf_bias_wrapped = forward, True
            wrapped += 1
    return wrapped


# megatron-core 0.16.1 / torch 2.13: MoE's token dispatcher all-gathers and reduce-scatters uneven token counts over
# the expert-TP group (tensor_parallel.mappings, output_split_sizes / input_split_sizes) through list collectives,
# which gloo refuses ("ProcessGroupGloo::allgather: invalid tensor size"); the counts differ between TP ranks under
# sequence parallelism.
def uneven_gather_on_cpu() -> None:
    """Host tensors with uneven splits: the all-gather pads every part to the largest and cuts the result; the
    reduce-scatter all-reduces the whole tensor and keeps this rank's part (the same sums). Equal splits and
    device tensors go to megatron's own functions."""
    from megatron.core.tensor_parallel import mappings

    if getattr(mappings._gather_along_first_dim, "_rlhf_uneven", False):
        return
    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or input_.device.type != "cpu" or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        most = max(output_split_sizes)
        padded = torch.zeros((most, *input_.shape[1:]), dtype=input_.dtype)
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)])

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or input_.device.type != "cpu" or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return list(torch.split(total, input_split_sizes, dim=0))[group.rank()].contiguous()

    _gather_along_first_dim._rlhf_uneven = True
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim
