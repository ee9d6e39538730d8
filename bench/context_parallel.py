"""Context parallelism on 2 CPU ranks: the longest sequence one rank can train within a memory limit, alone (CP1)
and with two ranks sharing it (CP2), and training tokens/s for one long sequence at DP2 vs CP2, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/context_parallel.py              # a few minutes on 2 cores
    OMP_NUM_THREADS=1 .venv/bin/python bench/context_parallel.py --limit_mib 256 --tps_len 1024  # quicker

It makes a seeded tiny Llama (``rlhf.models.tiny``; long max_position_embeddings) in a temporary folder and
starts itself under ``torchrun --nproc_per_node 2``. Each measurement is one optimizer step of the trainer's
``ModelRole.train_step`` (fp32, megatron DDP, the per-token next-token loss) on one sequence per replica:

* longest sequence: lengths doubling from ``--start_len``, then bisected to ``--granularity`` tokens; a length
  fits when rank 0's peak of live torch allocations during the step (``rlhf.planner.measure.allocation_peak``,
  the CPU analogue of CUDA's peak allocated bytes, on top of the model and optimizer state) stays within
  ``--limit_mib``. At CP1 both ranks train their own sequence (DP2), which is what one rank alone needs.
* tokens/s: ``--tps_len`` tokens, the median of ``--steps`` timed steps after a warm-up: DP2 trains two such
  sequences a step (one per rank), CP2 one (split over the two ranks); the ratio is CP2 / DP2.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size (default: the tiny byte-level tokenizer's, 259); e.g. 49152, SmolLM2's, "
                        "to see the head's share")
    p.add_argument("--limit_mib", type=float, default=512.0, help="activation memory limit per rank")
    p.add_argument("--start_len", type=int, default=256)
    p.add_argument("--granularity", type=int, default=128)
    p.add_argument("--tps_len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def step_fn(engine, length: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, engine.spec.vocab_size, (1, length), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    from rlhf.models.context_parallel import current_layout, reads_local_tokens

    @reads_local_tokens  # as the SFT trainer's loss: under CP the logits of this rank's tokens only
    def loss_fn(b, logits):
        from rlhf.algo.losses import sft_loss

        return sft_loss(logits, b["input_ids"], b["attention_mask"], tp_group=engine.mesh.tp_group,
                        vocab_size=engine.spec.vocab_size, cp=current_layout())

    return lambda: engine.train_step([batch], loss_fn, ("loss",))


def longest(engine, args, peaks: dict) -> int:
    """The longest length whose step peaks within the limit (rank 0's measure, shared with every rank)."""
    import torch
    import torch.distributed as dist

    from rlhf.planner.measure import allocation_peak

    def fits(n: int) -> bool:
        fn = step_fn(engine, n, seed=n)
        fn()  # warm-up: Adam's state, first-call caches
        peak = torch.tensor([float(allocation_peak(fn))])
        dist.broadcast(peak, 0)
        peaks[n] = peak.item() / 2**20
        return peaks[n] <= args.limit_mib

    lo, n = 0, args.start_len
    while n <= engine.spec.max_position_embeddings and fits(n):
        lo, n = n, n * 2
    hi = n
    while hi - lo > args.granularity:
        mid = (lo + hi) // 2 // args.granularity * args.granularity
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from rlhf.distributed import initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.runtime.role import ModelRole, OptimConfig

    torch.set_num_threads(1)
    out = {}
    for cp in (1, 2):
        mesh = initialize_mesh(1, 1, cp=cp, seed=1)
        engine = ModelRole(mesh, args.worker, optim=OptimConfig(lr=1e-5, warmup_ratio=0.0, total_steps=1000),
                             name=f"cp{cp}")
        peaks: dict = {}
        best = longest(engine, args, peaks)
        fn = step_fn(engine, args.tps_len, seed=7)
        fn()
        times = []
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        sec = statistics.median(times)
        tokens = args.tps_len * mesh.dp  # DP2: one sequence per rank; CP2: one sequence split over both
        out[f"cp{cp}"] = {"longest": best, "peaks_mib": peaks, "step_s": sec, "tokens_per_s": tokens / sec}
        del engine
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    destroy_mesh()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from rlhf.distributed.env import env_without_launcher, free_port
    from rlhf.models.tiny import make_tiny_hf

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_hf(os.path.join(tmp, "model"), "llama", seed=0, hidden_size=args.hidden,
                             intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                             num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                             max_position_embeddings=65536,
                             **({"vocab_size": args.vocab} if args.vocab else {}))
        env = env_without_launcher()
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), __file__, "--worker", model, *(argv if argv is not None else sys.argv[1:])]
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not lines:
            print(p.stdout[-3000:] + p.stderr[-3000:], file=sys.stderr)
            return 1
        r = json.loads(lines[0][7:])
    one, two = r["cp1"], r["cp2"]
    print(f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, vocab {args.vocab or 259}, fp32, "
          f"2 ranks")
    print(f"longest sequence within {args.limit_mib:.0f} MiB of activations per rank: CP1 {one['longest']} tokens, "
          f"CP2 {two['longest']} tokens ({two['longest'] / max(one['longest'], 1):.2f}x)")
    print(f"training tokens/s at {args.tps_len} tokens: DP2 {one['tokens_per_s']:.0f} ({one['step_s']:.2f} s a step of "
          f"2 sequences), CP2 {two['tokens_per_s']:.0f} ({two['step_s']:.2f} s a step of 1); CP2 / DP2 = "
          f"{two['tokens_per_s'] / one['tokens_per_s']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, **r}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
