"""A negative control's launcher: a workflow's launch script with the context-parallel readers' gradient counted on
every CP rank, as an all-reduce in their backward would (the bug class of the first CP design). The readers'
sums over the CP group (``cp_sum``) and their gathers of per-token outputs (``gather_tokens``) all-reduce their
gradient before each rank keeps its own positions, so every rank's gradient of the positions it holds is CP times
the whole one. The forward is unchanged: the same losses, the gradients CP times larger.

    torchrun --nproc_per_node 2 tests/_cp_counted_twice.py launch/dpo.py --context_parallel_size 2 ...

Used by tests/dpo/test_dpo_cp.py and tests/ppo/test_ppo_cp.py."""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rlhf.models import context_parallel as cpm  # noqa: E402


class _SumOverCPCountedTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def cp_sum(x: torch.Tensor, layout) -> torch.Tensor:
    return _SumOverCPCountedTwice.apply(x, layout.group)


def gather_tokens(x: torch.Tensor, layout) -> torch.Tensor:
    full = cpm.gather_padded_stream(x.transpose(0, 1), layout, reduce=True)  # (padded_len, B, ...)
    return full.index_select(0, layout.keep.to(x.device)).transpose(0, 1)


if __name__ == "__main__":
    cpm.cp_sum, cpm.gather_tokens = cp_sum, gather_tokens  # the readers import them at call time
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
