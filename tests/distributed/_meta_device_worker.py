"""The device rule end to end, with the ``meta`` device standing in for the GPU (one process, world size 1).

megatron's "cuda" (through the CPU shim) and the mesh's device both become ``meta``, as both are the rank's GPU
in a CUDA run; batches are collated on the host as always. Then any tensor that library code leaves on, or
creates on, the host and mixes into the model's computation raises, as it would on a GPU. Runs: an SFT engine's
forward + backward through megatron's schedule and DDP (fp32), PPO's actor log-probs (fused kernel), a reward and
a critic forward. Prints one JSON line of the devices found.

Not covered: packed (THD) batches, whose reference attention reads ``cu_seqlens`` on the host (a sync that is
legal on CUDA but that the meta device cannot answer), the optimizer step and metric reductions (``.item()``),
and megatron's data-parallel gradient all-reduce (an identity at world size 1, and it branches on a token count).
"""
import dataclasses
import json
import os
import sys

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rlhf.distributed.env import free_port  # noqa: E402

os.environ["MASTER_PORT"] = str(free_port())
torch.set_num_threads(1)
META = torch.device("meta")


def redirect_cuda_to_meta() -> None:
    from rlhf.compat import cuda as cuda_shim

    cuda_shim._cpu_device = lambda d: None if d is None else (
        META if isinstance(d, int) or torch.device(d).type == "cuda" else d)
    cuda_shim._CPU_TORCH.cuda.current_device = lambda: META
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast"):
        real = getattr(dist, name)
        # world size 1: every collective is the identity, and gloo cannot take meta tensors
        setattr(dist, name, lambda t, *a, _real=real, **k: None if t.device == META else _real(t, *a, **k))


def main(hf_dir: str) -> None:
    from rlhf.data import SFTSample, collate_sft
    from rlhf.distributed import initialize_mesh
    from rlhf.distributed.device import to_device
    from rlhf.runtime.role import ModelRole, OptimConfig
    from rlhf.ppo.experience import collate_sequences, forward_role, select_rows
    from rlhf.models import pipeline
    from rlhf.rollout.types import Sample
    from rlhf.supervised.sft import SFTTask

    mesh = dataclasses.replace(initialize_mesh(1, 1), device=META)
    redirect_cuda_to_meta()
    sft = ModelRole(mesh, hf_dir, optim=OptimConfig(lr=1e-3, total_steps=4, warmup_ratio=0.0), name="sft")
    sft.config.finalize_model_grads_func = None
    t = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    mb = collate_sft([SFTSample(t([5, 6, 7, 2, 9]), torch.tensor([0, 0, 1, 1, 1]).bool(), 2, "a"),
                      SFTSample(t([8, 9, 2]), torch.tensor([0, 1, 1]).bool(), 1, "b")], 0)
    loss_fn = SFTTask().loss_fn(sft)
    found: dict = {}
    # Negative control: without the forward step's move, the host batch meets the device model and fails.
    real_move = pipeline.to_device
    pipeline.to_device = lambda obj, device, non_blocking=False: obj
    try:
        pipeline.run_microbatches(sft.module, [mb], loss_fn=loss_fn, device=mesh.device)
        found["unmoved_batch_error"] = None
    except (RuntimeError, NotImplementedError) as e:
        found["unmoved_batch_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    pipeline.to_device = real_move
    sft.ddp.zero_grad_buffer()
    outs = pipeline.run_microbatches(sft.module, [mb, mb], loss_fn=loss_fn, device=mesh.device)
    found["sft_params"] = sorted({str(p.device) for p in sft.model.parameters()})
    found["sft_main_grads"] = sorted({str(p.main_grad.device) for p in sft.model.parameters()})
    found["sft_losses"] = sorted({str(x.device) for o in outs for x in o["loss"]})
    samples = [Sample(0, [5, 6, 7], [8, 9], [-0.5, -0.25], True), Sample(0, [5, 6], [4, 3, 2], [-1.0] * 3, False)]
    batch = to_device(collate_sequences(samples, pad_id=0, T=4), mesh.device)  # as PPO does
    mbs = [select_rows(batch, [0, 1], trim=False)]
    found["actor_logprobs"] = str(forward_role(sft, "actor", mbs, 0.7).device)
    rm = ModelRole(mesh, hf_dir, value_head=True, name="reward")
    found["reward_scores"] = str(forward_role(rm, "reward", mbs, 1.0).device)
    found["critic_values"] = str(forward_role(rm, "critic", mbs, 1.0).device)
    print("RESULT " + json.dumps(found), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
