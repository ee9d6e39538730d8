"""LoRA weight sync: the adapters alone (``--lora_sync adapter``) against merged weights, side by side in one run.

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/lora_sync.py --size smollm2 --rank 16
    ... [--vllm_tp 1] [--rounds 5] [--json bench/results/lora_sync_smollm2.json]

A LoRA actor (all linear layers, ``--rank``, alpha = 2 x rank, B drawn at random so every adapter is live) at TP 1
on 2 ranks and one vLLM engine with its LoRA path on per rank (``--vllm_tp 1``; 2: one over both), in the same
processes as ``launch/ppo.py`` builds them. Each round, alternately:

    merged   the merged weights (``W + alpha/r B A``) gathered, converted and loaded (what ``--lora_sync merged``
             sends after every update), then a generation with no adapter
    adapter  the base once (untimed), then the timed adapter sync (gather, PEFT folder, vLLM's ``add_lora``),
             then the same generation under the adapter (punica's LoRA kernels)

Both syncs are checked: vLLM's log-probs of its own samples equal the trainer's (fp32, within 1e-4). It prints
the medians of the sync and generation times, the bytes each sync sends, and the ratios. Both generations run in
the same LoRA-enabled engine; a plain engine (``--lora_sync merged``) has no LoRA layers, so its generation may
be a little faster than the ``merged`` row here.
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
    p.add_argument("--size", default="smollm2", help="4m | 25m | smollm2 (bench/ppo_vs_trl.py's models)")
    p.add_argument("--rank", type=int, default=16, help="--lora_rank")
    p.add_argument("--vllm_tp", type=int, default=1, choices=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=16, help="prompts per generation (32 tokens each)")
    p.add_argument("--work", default="/tmp/bench_weight_sync", help="model folders (reused)")
    p.add_argument("--json", default=None, help="also write the figures here (rank 0)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    from weight_sync import drift, timed

    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.models.lora import LoraConfig, lora_modules
    from rlhf.rollout import RolloutConfig, build_rollout, shutdown
    from rlhf.rollout.weight_sync import WeightSync
    from rlhf.runtime.role import ModelRole

    env = DistEnv.from_environ()
    if env.world_size != 2:
        print("error: run on 2 ranks (torch.distributed.run --nproc_per_node 2)", file=sys.stderr)
        return 2
    root = os.path.join(args.work, args.size)
    if env.rank == 0:
        from ppo_vs_trl import build_models

        build_models(args.size, root, seed=0)
    mesh = initialize_mesh(1, 1, env, seed=1)
    torch.distributed.barrier()
    actor_dir = os.path.join(root, "actor")
    actor = ModelRole(mesh, actor_dir, value_head=False, name="actor",
                      lora=LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # live adapters: B A moves each adapted weight by about 1% of its own scale
        for m in lora_modules(actor.model).values():
            spread = m.lora_scale * m.lora_A.shape[0] ** 0.5 * m.lora_A.float().std()  # of (B A)'s entries per B's
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.01 * m.weight.float().std() / spread)
    cfg = RolloutConfig(tensor_parallel_size=args.vllm_tp, kv_cache_bytes=64 << 20, max_model_len=64, backend="vllm",
                        lora_adapter_rank=args.rank)
    engine = build_rollout(mesh, actor, cfg, actor_dir)
    sync = WeightSync(actor, mesh)
    prompts = [[1, 20 + i, 30 + i, 40 + i] for i in range(args.prompts)]

    def generate():
        engine.generate(prompts, n=1, temperature=1.0, top_p=1.0, max_tokens=32, seed=2, ignore_eos=True)

    times: dict[str, list[float]] = {"merged_sync": [], "adapter_sync": [], "merged_generate": [],
                                     "adapter_generate": []}
    sent, check = {}, {}
    for r in range(args.rounds + 1):  # round 0 warms up
        t = {"merged_sync": timed(lambda: engine.load_weights(sync.iter_hf_tensors(), sync.version))}
        sent["merged"] = sync.last_stats["weight_sync/bytes"]
        t["merged_generate"] = timed(generate)
        check["merged"] = drift(engine, actor, mesh)
        engine.needs_base = True
        sync.sync(engine)  # the base (unmerged) and the adapters: once per round, untimed
        t["adapter_sync"] = timed(lambda: sent.update(adapter=sync.sync(engine)["weight_sync/bytes"]))
        t["adapter_generate"] = timed(generate)
        check["adapter"] = drift(engine, actor, mesh)
        if r:
            for k, v in t.items():
                times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {"sync_merged_over_adapter": med["merged_sync"] / med["adapter_sync"],
              "bytes_merged_over_adapter": sent["merged"] / sent["adapter"],
              "generate_adapter_over_merged": med["adapter_generate"] / med["merged_generate"]}
    if mesh.is_rank0:
        print(f"size={args.size} lora_rank={args.rank} vllm_tp={args.vllm_tp} rounds={args.rounds} "
              f"prompts={args.prompts}x32 tokens; drift merged {check['merged']:.2e}, adapter {check['adapter']:.2e}")
        print(f"bytes per sync: merged {sent['merged'] / 2**20:.1f} MB, adapter {sent['adapter'] / 2**20:.2f} MB")
        for k in times:
            print(f"{k:>16}: median {med[k]:.3f} s  (" + " ".join(f"{v:.3f}" for v in times[k]) + ")")
        print(" ".join(f"{k}={v:.2f}" for k, v in ratios.items()), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"size": args.size, "lora_rank": args.rank, "vllm_tp": args.vllm_tp, "bytes": sent,
                           "times": times, "median": med, "ratios": ratios, "drift": check}, f, indent=2)
    ok = max(check.values()) <= 1e-4
    shutdown(mesh, engine)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
