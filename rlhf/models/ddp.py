"""Wrap a megatron model for training: megatron DDP (grad buffers, DP all-reduce) plus the schedule hooks."""
from __future__ import annotations

import torch


def wrap_ddp(model: torch.nn.Module, *, use_distributed_optimizer: bool = False,
             grad_reduce_in_fp32: bool = True, bucket_size: int | None = None) -> torch.nn.Module:
    """megatron-core DDP around ``model``; sets ``finalize_model_grads`` (DP all-reduce, tied-embedding sync
    across the first and last pipeline stages) and ``no_sync`` on the model config so that the pipeline
    schedule drives gradient reduction. Gradients land in ``param.main_grad``."""
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)

    from rlhf.compat import cuda as cuda_shim

    cuda_shim.install()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=False,
                                               use_distributed_optimizer=use_distributed_optimizer,
                                               bucket_size=bucket_size)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    from rlhf.distributed.shm_allreduce import install_on_ddp

    install_on_ddp(ddp)  # CPU, one host: the gradient all-reduce through shared memory, not gloo's TCP
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp
