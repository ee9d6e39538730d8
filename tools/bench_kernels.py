"""Benchmark the fused kernels against naive torch, on whatever device this runs on (CPU here).

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench_kernels.py --part a

Part (a): peak extra memory and time of one forward + backward of
    token_logprobs(logits, targets, return_entropy=True)          vs  naive log_softmax + gather + entropy
    fused_linear_logprobs(hidden, weight, targets, return_entropy=True)  vs  naive hidden @ W.T, then the same
at N=4096, H=512, V=32000, fp32 by default. Both outputs get an upstream gradient, so the entropy
backward is included.

How memory is measured (torch's CPU allocator has no peak counter and tracemalloc does not see it):
every variant runs in a fresh subprocess with `MALLOC_MMAP_THRESHOLD_=65536`, which makes glibc serve every
allocation >= 64 KiB with its own mmap and return it to the OS on free, so the resident set tracks live
tensors. After one warm-up step and a gc, the subprocess resets the kernel's peak-RSS counter (write "5" to
/proc/self/clear_refs), runs one step, and reports VmHWM minus the RSS at the reset: the peak of everything
the step allocated, including the gradients it hands back (e.g. the [N, V] grad of the logits). Linux only.
"workspace" is that peak minus the size of those gradients, which every implementation must return.
Time is the median over --repeats steps in another fresh subprocess with the default allocator, both
wall-clock and process CPU time (the latter is robust to other jobs sharing the machine).

Part (b) (packed vs padded training) is reserved: add it to PARTS.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("naive_logprobs", "kernel_logprobs", "naive_fused", "kernel_fused")


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1))


def _make_inputs(variant: str, n: int, h: int, v: int, dtype):
    import torch

    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, v, (n,), generator=g)
    grad_lp = torch.randn(n, generator=g)
    grad_ent = torch.randn(n, generator=g)
    if variant.endswith("logprobs"):
        logits = (torch.randn(n, v, generator=g) * 2).to(dtype).requires_grad_(True)
        return (logits,), targets, grad_lp, grad_ent
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_(True)
    return (hidden, weight), targets, grad_lp, grad_ent


def _naive_logprobs(logits, targets, temperature: float):
    import torch

    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, V) fp32
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def _step(variant: str, inputs, targets, grad_lp, grad_ent, temperature: float, chunk_size: int | None) -> None:
    import kernels

    if variant == "naive_logprobs":
        lp, ent = _naive_logprobs(inputs[0], targets, temperature)
    elif variant == "kernel_logprobs":
        lp, ent = kernels.token_logprobs(inputs[0], targets, temperature=temperature, return_entropy=True,
                                         chunk_size=chunk_size)
    elif variant == "naive_fused":
        lp, ent = _naive_logprobs(inputs[0] @ inputs[1].t(), targets, temperature)
    else:
        lp, ent = kernels.fused_linear_logprobs(inputs[0], inputs[1], targets, temperature=temperature,
                                                return_entropy=True, chunk_size=chunk_size)
    ((lp * grad_lp).sum() + (ent * grad_ent).sum()).backward()


def _worker(args: argparse.Namespace) -> None:
    """Runs inside the per-variant subprocess; prints one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    inputs, targets, grad_lp, grad_ent = _make_inputs(args.worker, args.n, args.h, args.v, dtype)

    def step():
        _step(args.worker, inputs, targets, grad_lp, grad_ent, args.temperature, args.chunk_size)
        for t in inputs:
            t.grad = None
        gc.collect()

    step()  # warm-up: lazy initialisation must not count
    if args.mode == "mem":
        rss0 = _proc_status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        _step(args.worker, inputs, targets, grad_lp, grad_ent, args.temperature, args.chunk_size)
        peak = _proc_status_kib("VmHWM")
        print(json.dumps({"extra_mib": (peak - rss0) / 1024}))
    else:
        wall, cpu = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            _step(args.worker, inputs, targets, grad_lp, grad_ent, args.temperature, args.chunk_size)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            for t in inputs:
                t.grad = None
        grad_mib = sum(t.numel() * t.element_size() for t in inputs) / 2**20
        print(json.dumps({"time_s": statistics.median(wall), "cpu_s": statistics.median(cpu), "grad_mib": grad_mib}))


def _run_variant(args: argparse.Namespace, variant: str, mode: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO))
    if mode == "mem":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [sys.executable, __file__, "--part", "a", "--_worker", variant, "--_mode", mode,
           "--n", str(args.n), "--h", str(args.h), "--v", str(args.v), "--dtype", args.dtype,
           "--temperature", str(args.temperature), "--threads", str(args.threads), "--repeats", str(args.repeats)]
    if args.chunk_size:
        cmd += ["--chunk-size", str(args.chunk_size)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} ({mode}) failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_part_a(args: argparse.Namespace) -> None:
    res = {}
    for variant in VARIANTS:
        res[variant] = {**_run_variant(args, variant, "mem"), **_run_variant(args, variant, "time")}
    print(f"part (a): N={args.n} H={args.h} V={args.v} dtype={args.dtype} T={args.temperature} "
          f"threads={args.threads}, one forward+backward with entropy; times are medians of {args.repeats}")
    print(f"{'variant':<17}{'peak extra MiB':>15}{'of which grads':>15}{'workspace MiB':>15}{'wall s':>9}{'cpu s':>9}")
    for variant in VARIANTS:
        r = res[variant]
        print(f"{variant:<17}{r['extra_mib']:>15.1f}{r['grad_mib']:>15.1f}{r['extra_mib'] - r['grad_mib']:>15.1f}"
              f"{r['time_s']:>9.3f}{r['cpu_s']:>9.3f}")
    print()
    print("kernel / naive ratios (targets: peak extra memory <= 0.125, time <= 1.2)")
    print(f"{'op':<24}{'peak extra':>12}{'workspace':>12}{'wall':>8}{'cpu':>8}")
    for op, (naive, kernel) in {"token_logprobs": ("naive_logprobs", "kernel_logprobs"),
                                "fused_linear_logprobs": ("naive_fused", "kernel_fused")}.items():
        n, k = res[naive], res[kernel]
        ratios = (k["extra_mib"] / n["extra_mib"],
                  (k["extra_mib"] - k["grad_mib"]) / (n["extra_mib"] - n["grad_mib"]),
                  k["time_s"] / n["time_s"], k["cpu_s"] / n["cpu_s"])
        print(f"{op:<24}" + "".join(f"{x:>{w}.3f}" for x, w in zip(ratios, (12, 12, 8, 8))))


PARTS = {"a": run_part_a}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=sorted(PARTS), default="a", help="which benchmark to run")
    p.add_argument("--n", type=int, default=4096, help="tokens")
    p.add_argument("--h", type=int, default=512, help="hidden size (fused variants)")
    p.add_argument("--v", type=int, default=32000, help="vocab size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per variant (median reported)")
    p.add_argument("--chunk-size", type=int, default=None, help="rows per chunk (default: the library's)")
    p.add_argument("--_worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_mode", choices=["mem", "time"], default="time", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.worker, args.mode = args._worker, args._mode
    if args.worker:
        _worker(args)
    else:
        PARTS[args.part](args)


if __name__ == "__main__":
    main()
