"""Benchmark the fused kernels against naive torch, on whatever device this runs on (CPU here).

    OMP_NUM_THREADS=1 .venv/bin/python bench/fused_kernels.py --part a

Part (a): peak extra memory and time of one forward + backward of
    token_logprobs(logits, targets, return_entropy=True)          vs  naive log_softmax + gather + entropy
    token_logprobs(..., inplace_backward=True)                    (the gradient overwrites the logits)
    fused_linear_logprobs(hidden, weight, targets, return_entropy=True)  vs  naive hidden @ W.T, then the same
at N=4096, H=512, V=32000, fp32 by default. Both outputs get an upstream gradient, so the entropy
backward is included. The logits are a non-leaf, as a model output is: a stand-in for the layer that made them
takes their gradient and drops it (a matmul backward would consume it), so no variant keeps a `.grad`.

How memory is measured (torch's CPU allocator has no peak counter and tracemalloc does not see it):
every variant runs in a fresh subprocess with `MALLOC_MMAP_THRESHOLD_=65536`, which makes glibc serve every
allocation >= 64 KiB with its own mmap and return it to the OS on free, so the resident set tracks live
tensors. After one warm-up step and a gc, the subprocess resets the kernel's peak-RSS counter (write "5" to
/proc/self/clear_refs), runs one step, and reports VmHWM minus the RSS at the reset: the peak of everything
the step allocated, including the gradients it hands back (e.g. the [N, V] grad of the logits). Linux only.
"workspace" is that peak minus the size of those gradients, which every implementation must return.
Time is the median over --repeats steps in another fresh subprocess with the default allocator, both
wall-clock and process CPU time (the latter is robust to other jobs sharing the machine).

    OMP_NUM_THREADS=1 .venv/bin/python bench/fused_kernels.py --part b --repeats 1    # about 75 s

Part (b): one training forward + backward (sum of next-token log-probs, through `run_microbatches`) of a small
Llama in megatron (local spec, TP1, fp32 by default, 8 layers, hidden 512, 8 heads, --b-kv-heads KV heads,
vocab 1000) on the same sequences, lengths uniform in [16, 512] (fixed seed), as padded micro-batches (each
padded to its longest sequence, causal mask, megatron's DotProductAttention) and as packed micro-batches
(the same sequences per micro-batch in one THD row, `kernels.varlen_attention`). Sequences are taken in
their random order, as a rollout batch arrives, not sorted by length. A third variant, padded+varlen, runs
the padded rows (padding included) through the packed path, which splits the speed-up into its attention-
kernel part and its padding part. It reports real (non-padding) tokens per second for each and the ratio
packed / padded, from the median wall and CPU time of --repeats passes.
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
VARIANTS = ("naive_logprobs", "kernel_logprobs", "kernel_logprobs_inplace", "naive_fused", "kernel_fused")


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1))


def _upstream_layer():
    import torch

    class Upstream(torch.autograd.Function):
        """Stands in for the layer that produced the logits: makes them a non-leaf and drops their gradient."""

        @staticmethod
        def forward(ctx, anchor, logits):
            return logits.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad.new_zeros(()), None

    return Upstream


def _make_inputs(variant: str, n: int, h: int, v: int, dtype):
    """(inputs of the op, leaves whose .grad to reset, targets, grad of logprobs, grad of entropy)."""
    import torch

    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, v, (n,), generator=g)
    grad_lp = torch.randn(n, generator=g)
    grad_ent = torch.randn(n, generator=g)
    if "logprobs" in variant:
        anchor = torch.zeros((), requires_grad=True)
        logits = _upstream_layer().apply(anchor, (torch.randn(n, v, generator=g) * 2).to(dtype))
        return (logits,), (anchor,), targets, grad_lp, grad_ent
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_(True)
    return (hidden, weight), (hidden, weight), targets, grad_lp, grad_ent


def _grad_mib(variant: str, inputs) -> float:
    """Gradients the step has to allocate: wrt the logits (none with inplace_backward), or hidden and weight."""
    if variant == "kernel_logprobs_inplace":
        return 0.0
    return sum(t.numel() * t.element_size() for t in inputs) / 2**20


def _naive_logprobs(logits, targets, temperature: float):
    import torch

    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, V) fp32
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def _step(variant: str, inputs, targets, grad_lp, grad_ent, temperature: float, chunk_size: int | None) -> None:
    import rlhf.kernels as kernels

    if variant == "naive_logprobs":
        lp, ent = _naive_logprobs(inputs[0], targets, temperature)
    elif variant in ("kernel_logprobs", "kernel_logprobs_inplace"):
        lp, ent = kernels.token_logprobs(inputs[0], targets, temperature=temperature, return_entropy=True,
                                         chunk_size=chunk_size, inplace_backward=variant.endswith("inplace"))
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
    inputs, leaves, targets, grad_lp, grad_ent = _make_inputs(args.worker, args.n, args.h, args.v, dtype)

    def step():
        _step(args.worker, inputs, targets, grad_lp, grad_ent, args.temperature, args.chunk_size)
        for t in leaves:
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
            for t in leaves:
                t.grad = None
        print(json.dumps({"time_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
                          "grad_mib": _grad_mib(args.worker, inputs)}))


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
    print(f"{'variant':<25}{'peak extra MiB':>15}{'of which grads':>15}{'workspace MiB':>15}{'wall s':>9}"
          f"{'cpu s':>9}")
    for variant in VARIANTS:
        r = res[variant]
        print(f"{variant:<25}{r['extra_mib']:>15.1f}{r['grad_mib']:>15.1f}{r['extra_mib'] - r['grad_mib']:>15.1f}"
              f"{r['time_s']:>9.3f}{r['cpu_s']:>9.3f}")
    print()
    print("kernel / naive ratios (targets: peak extra memory <= 0.125, time <= 1.2)")
    print(f"{'op':<40}{'peak extra':>12}{'workspace':>12}{'wall':>8}{'cpu':>8}")
    for op, (naive, kernel) in {"token_logprobs": ("naive_logprobs", "kernel_logprobs"),
                                "token_logprobs(inplace_backward=True)": ("naive_logprobs", "kernel_logprobs_inplace"),
                                "fused_linear_logprobs": ("naive_fused", "kernel_fused")}.items():
        n, k = res[naive], res[kernel]
        ratios = (k["extra_mib"] / n["extra_mib"],
                  (k["extra_mib"] - k["grad_mib"]) / (n["extra_mib"] - n["grad_mib"]),
                  k["time_s"] / n["time_s"], k["cpu_s"] / n["cpu_s"])
        print(f"{op:<40}" + "".join(f"{x:>{w}.3f}" for x, w in zip(ratios, (12, 12, 8, 8))))


def _part_b_model(args: argparse.Namespace):
    import torch

    from rlhf.distributed import initialize_mesh
    from rlhf.models.gpt import build_model
    from rlhf.models.spec import ModelSpec, padded_vocab_size

    torch.set_num_threads(args.threads)
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    mesh = initialize_mesh(1, 1)
    spec = ModelSpec(model_type="llama", vocab_size=1000, hidden_size=512, intermediate_size=1376, num_layers=8,
                     num_attention_heads=8, num_kv_heads=args.b_kv_heads, head_dim=64, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False, qkv_bias=False)
    dtype = getattr(torch, args.dtype)
    model = build_model(spec, tp=1, pp=1, pp_rank=0, padded_vocab=padded_vocab_size(spec.vocab_size),
                        params_dtype=dtype, bf16=dtype == torch.bfloat16, init_weights=True)
    return spec, model.to(mesh.device)


B_VARIANTS = ("padded", "padded+varlen", "packed")


def _part_b_microbatch(variant: str, group: list):
    """One micro-batch of `group` (1-D token tensors) for `variant`:
    padded: [B, L] right-padded rows through megatron's DotProductAttention (causal mask, so real tokens never
        see the padding);
    padded+varlen: the same padded rows, each packed as one full-length sequence (same tokens as padded, but
        kernels.varlen_attention): separates the attention kernel's share of the speed-up from the padding's;
    packed: the sequences in one THD row, no padding."""
    import torch

    import rlhf.kernels as kernels
    from rlhf.models.packing import make_packed_batch

    if variant == "packed":
        mb = make_packed_batch(group)
        targets, valid = kernels.packed_next_tokens(mb["input_ids"][0], mb["cu_seqlens"])
        return {**mb, "targets": targets.unsqueeze(0), "valid": valid.unsqueeze(0)}
    width = max(s.numel() for s in group)
    ids = torch.zeros(len(group), width, dtype=torch.long)
    valid = torch.zeros(len(group), width, dtype=torch.bool)
    for r, s in enumerate(group):
        ids[r, : s.numel()] = s
        valid[r, : s.numel() - 1] = True
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    if variant == "padded":
        return {"input_ids": ids, "targets": targets, "valid": valid}
    return make_packed_batch(ids, per_token={"targets": targets, "valid": valid})


def run_part_b(args: argparse.Namespace) -> None:
    if str(REPO) not in sys.path:  # part (b) runs in this process: the repo must be importable
        sys.path.insert(0, str(REPO))
    import torch

    import rlhf.kernels as kernels
    from rlhf.models.pipeline import run_microbatches

    spec, model = _part_b_model(args)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 513, (args.b_seqs,), generator=g).tolist()
    seqs = [torch.randint(3, spec.vocab_size, (n,), generator=g) for n in lengths]
    groups = [seqs[i:i + args.b_mbs] for i in range(0, len(seqs), args.b_mbs)]
    n_real = sum(lengths)

    def loss_fn(batch, logits):  # logits (B, S, V_local); sum of next-token log-probs, as in training
        lp = kernels.token_logprobs(logits, batch["targets"], vocab_size=spec.vocab_size)
        return -(lp * batch["valid"]).sum() / n_real, {}

    def step(mbs):
        run_microbatches(model, mbs, loss_fn=loss_fn)
        for p in model.parameters():
            p.grad = None

    res = {}
    for variant in B_VARIANTS:
        mbs = [_part_b_microbatch(variant, grp) for grp in groups]
        step([_part_b_microbatch(variant, [s[:64] for s in groups[0][:2]])])  # warm-up: lazy initialisation
        wall, cpu = [], []
        for _ in range(args.repeats):
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            step(mbs)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        processed = sum(mb["input_ids"].numel() for mb in mbs)
        res[variant] = {"wall": statistics.median(wall), "cpu": statistics.median(cpu), "processed": processed}
    print(f"part (b): megatron Llama, 8 layers, hidden 512, heads 8, kv heads {args.b_kv_heads}, vocab 1000, "
          f"{args.dtype}, threads={args.threads}; {len(lengths)} sequences, lengths U[16, 512] (seed 0, mean "
          f"{n_real / len(lengths):.0f}, {n_real} real tokens), {args.b_mbs} per micro-batch; one forward+backward "
          f"over all micro-batches, median of {args.repeats}")
    print(f"{'variant':<15}{'tokens run':>11}{'padding':>9}{'wall s':>9}{'cpu s':>9}{'real tok/s wall':>17}"
          f"{'real tok/s cpu':>16}")
    for name, r in res.items():
        print(f"{name:<15}{r['processed']:>11}{1 - n_real / r['processed']:>9.1%}{r['wall']:>9.2f}{r['cpu']:>9.2f}"
              f"{n_real / r['wall']:>17.0f}{n_real / r['cpu']:>16.0f}")
    pad, var, pk = res["padded"], res["padded+varlen"], res["packed"]
    print(f"packed / padded tokens/s (target >= 1.7): wall {pad['wall'] / pk['wall']:.2f}x, "
          f"cpu {pad['cpu'] / pk['cpu']:.2f}x")
    print(f"  of which varlen attention (padded+varlen / padded): cpu {pad['cpu'] / var['cpu']:.2f}x; "
          f"dropping the padding (packed / padded+varlen): cpu {var['cpu'] / pk['cpu']:.2f}x")


PARTS = {"a": run_part_a, "b": run_part_b}


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
    p.add_argument("--b-seqs", type=int, default=16, help="part b: number of sequences")
    p.add_argument("--b-mbs", type=int, default=8, help="part b: sequences per micro-batch")
    p.add_argument("--b-kv-heads", type=int, default=4, choices=[4, 8], help="part b: KV heads (8 heads)")
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
