"""Token-budget micro-batches (``--use_dynamic_batch``) against fixed ones, at a skewed length mix, side by side.

    OMP_NUM_THREADS=2 .venv/bin/python bench/dynamic_batch.py --size 25m [--rounds 5] [--samples 32]

One gloo rank, the actor of ``bench/ppo_vs_trl.py``'s size as a trainable ``ModelRole``, and one PPO update step
(forward + backward + Adam, the real actor loss) over ``--samples`` synthetic samples whose lengths follow a long
tail: most prompt + response pairs are short, one in eight is ``--long`` tokens (reasoning traces are like this).
Three ways of forming the step's micro-batches, timed alternately, ``--rounds`` times each after a warm-up:

    padded   --micro_train_batch_size rows per micro-batch, right-padded to its longest row (no packing)
    packed   the same rows per micro-batch, packed (--packing_samples)
    budget   packed micro-batches of at most --max_tokens_per_gpu tokens (--use_dynamic_batch)

The three give the same gradient (tests/ppo/test_dynamic_batch.py); this prints their medians, tokens/s and the
ratios padded/budget and packed/budget.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))


def skewed_experience(vocab: int, n: int, short: int, long: int, seed: int):
    """``n`` samples: prompt 3/4 and response 1/4 of each length; every eighth is ``long`` tokens, the rest
    ``short`` plus a little jitter."""
    import torch

    from rlhf.ppo.experience import Experience, collate_sequences
    from rlhf.rollout.types import Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        total = long if i % 8 == 0 else short + int(torch.randint(0, short // 2 + 1, (1,), generator=g))
        p, r = total - total // 4, total // 4
        samples.append(Sample(i, torch.randint(3, vocab, (p,), generator=g).tolist(),
                              torch.randint(3, vocab, (r,), generator=g).tolist(), [-1.0] * r, True))
    T = max(len(s.response_ids) for s in samples)
    batch = collate_sequences(samples, pad_id=0, T=T)
    shape = batch["action_mask"].shape
    exp = Experience(samples=samples, batch=batch, old_logprobs=-torch.rand(shape, generator=g) - 1,
                     vllm_logprobs=-torch.rand(shape, generator=g) - 1, rewards=torch.randn(n, generator=g))
    exp.advantages, exp.returns = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return exp


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="25m", help="4m | 25m | smollm2 (bench/ppo_vs_trl.py's models)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--short", type=int, default=64, help="tokens of the short samples (plus up to half again)")
    p.add_argument("--long", type=int, default=512, help="tokens of every eighth sample")
    p.add_argument("--micro_train_batch_size", type=int, default=8)
    p.add_argument("--max_tokens_per_gpu", type=int, default=1024)
    p.add_argument("--work", default="/tmp/bench_dynamic_batch")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.samples % args.micro_train_batch_size:
        raise SystemExit("error: --rounds >= 1 and --samples a multiple of --micro_train_batch_size")

    import torch

    from ppo_vs_trl import SIZES, build_models
    from rlhf.algo.ppo_losses import ACTOR_METRICS, ActorLossConfig, make_actor_loss
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.env import free_port
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.runtime.role import ModelRole, OptimConfig
    from rlhf.models.outputs import response_logprobs
    from rlhf.ppo.experience import prepare_microbatches
    from rlhf.ppo.stages import token_budget_groups

    if args.size not in SIZES:
        raise SystemExit(f"error: --size must be one of {sorted(SIZES)}, got {args.size!r}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    actor, _, n_params = build_models(args.size, os.path.join(args.work, args.size), seed=0)
    mesh = initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "torchrun"))
    engine = ModelRole(mesh, actor, optim=OptimConfig(lr=1e-7, total_steps=10 ** 6, warmup_ratio=0.0,
                                                        scheduler="constant"), name="actor")
    exp = skewed_experience(engine.spec.vocab_size, args.samples, args.short, args.long, seed=1)
    loss = make_actor_loss(lambda b, h: response_logprobs(engine, b, h, 1.0, entropy=True), ActorLossConfig())
    rows = list(range(args.samples))
    m = args.micro_train_batch_size
    fixed = [rows[i:i + m] for i in range(0, len(rows), m)]
    budget = token_budget_groups(exp.batch, rows, args.max_tokens_per_gpu)
    ways = {"padded": (fixed, False), "packed": (fixed, True), "budget": (budget, True)}
    mbs = {k: prepare_microbatches([exp.select(g, True) for g in groups], packing=packed, pp=1, pad_id=0)
           for k, (groups, packed) in ways.items()}
    tokens = int(exp.batch["attention_mask"].sum())
    padded_tokens = sum(int(mb["input_ids"].numel()) for mb in mbs["padded"])
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(args.rounds + 1):
        for k in ways:
            t0 = time.perf_counter()
            engine.train_step(mbs[k], loss, ACTOR_METRICS, output="hidden")
            if r:  # the first round warms up
                times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    lens = exp.batch["attention_mask"].sum(1).tolist()
    print(f"{args.size} ({n_params / 1e6:.1f}M params), {args.samples} samples, lengths {min(lens)}-{max(lens)} "
          f"(mean {sum(lens) / len(lens):.0f}), {tokens} tokens ({padded_tokens} padded); "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds")
    for k, (groups, _) in ways.items():
        print(f"  {k:7s} {len(groups):2d} micro-batches  median {med[k]:.3f} s  {tokens / med[k]:8.0f} tokens/s")
    print(f"padded/budget {med['padded'] / med['budget']:.2f}x   packed/budget {med['packed'] / med['budget']:.2f}x")
    destroy_mesh()
    return 0


if __name__ == "__main__":
    sys.exit(main())
