"""The DP gradient all-reduce of a CPU job: shared memory (rlhf.distributed.shm_allreduce) against gloo's.

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/allreduce.py \\
        [--mb 105,538] [--rounds 5]

``--mb``: buffer sizes in MB of fp32 (105 and 538 are the actor gradient buffers of bench/ppo_vs_trl.py's 25M model
and of SmolLM2-135M). Each round times, alternately, gloo's ``all_reduce`` of the buffer after megatron's scaling
pass (``grad_data *= 1/dp``, as megatron's DDP does it) and the shared-memory all-reduce with the scaling folded
in, after one warm-up each; both results are checked equal (bit for bit on 2 ranks). Rank 0 prints the medians
and ``shm_over_gloo=<ratio>`` per size.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf.distributed import shm_allreduce  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", default="105,538", help="comma-separated fp32 buffer sizes in MB")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    reducer = shm_allreduce.ShmAllReduce(dist.group.WORLD)
    scale = 1.0 / world
    for mb in (float(m) for m in args.mb.split(",")):
        x = torch.randn(int(mb * 1e6) // 4, generator=torch.Generator().manual_seed(rank))
        a, b = x.clone(), x.clone()

        def gloo():
            a.copy_(x)
            dist.barrier()
            t = time.perf_counter()
            a.mul_(scale)
            dist.all_reduce(a)
            return time.perf_counter() - t

        def shm():
            b.copy_(x)
            dist.barrier()
            t = time.perf_counter()
            reducer.all_reduce(b, scale)
            return time.perf_counter() - t

        times = {"gloo": [], "shm": []}
        gloo(), shm()
        for _ in range(args.rounds):
            times["gloo"].append(gloo())
            times["shm"].append(shm())
        same = torch.equal(a, b) if world == 2 else torch.allclose(a, b, rtol=1e-6, atol=1e-7)
        med = {k: statistics.median(v) for k, v in times.items()}
        if rank == 0:
            print(f"{mb:g} MB over {world} ranks: gloo {med['gloo'] * 1e3:.1f} ms, shared memory "
                  f"{med['shm'] * 1e3:.1f} ms ({'equal' if same else 'NOT EQUAL'}); "
                  f"shm_over_gloo={med['shm'] / med['gloo']:.2f}", flush=True)
        if not same:
            return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
