"""Reference SFT step of HuggingFace transformers' Llama, plain and with liger-kernel.

Measures one full optimizer step (gradient accumulation over micro-batches, then
clip_grad_norm_(1.0), AdamW step, zero_grad) the way HF Trainer does with bf16=True:
fp32 master parameters, forward under torch.autocast(bfloat16), backward outside
autocast, fused AdamW (lr 1e-5) on CUDA.  labels=input_ids (HF shifts inside, loss is
the mean over all tokens of a micro-batch), each micro-batch loss divided by the number
of micro-batches.  attn_implementation="sdpa", use_cache=False.

Reports per-step tokens/s (batch_rows * L / step seconds, CUDA-synchronized), the median
over steps 3..N (all steps if N <= 3), per-step losses, peak memory and versions.

liger=1 calls liger_kernel.transformers.apply_liger_kernel_to_llama() with its defaults
(rope, rms_norm, swiglu, fused_linear_cross_entropy) before the model is built.  That
patches transformers.models.llama globally, so each configuration runs in its own
process: `run_both` spawns this file once per configuration and collects the JSON.

  python tests/gpu/gpu_hf_baseline.py --shape smollm2_135m --liger 0|1|both --steps 8 \
      --micro_rows 4 --batch_rows 16 --seq_len 2048 --device cuda --json out.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    "smollm2_135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True),
    "llama32_1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       tie_word_embeddings=True, rope_theta=500000.0),
}


def _versions():
    import transformers
    try:
        from importlib.metadata import version
        liger_v = version("liger-kernel")
    except Exception:
        liger_v = None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "liger_kernel": liger_v}


def _rss_gib():
    import psutil
    return psutil.Process().memory_info().rss / 2**30


def run_hf(dims: dict, rows: list[list[int]], micro_rows: int, batch_rows: int, steps: int, liger: bool,
           seed: int = 0, device: str = "cuda", bf16: bool = True) -> dict:
    """One configuration, in this process. rows are cycled: step s uses rows[s*batch_rows ...]."""
    if liger and not device.startswith("cuda"):
        raise ValueError("--liger 1 needs --device cuda (liger-kernel's Triton kernels need a GPU)")
    if batch_rows % micro_rows:
        raise ValueError(f"batch_rows {batch_rows} is not a multiple of micro_rows {micro_rows}")
    L = len(rows[0])
    if any(len(r) != L for r in rows):
        raise ValueError("all rows must have the same length")
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()  # rope, rms_norm, swiglu, fused_linear_cross_entropy
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = device.startswith("cuda")
    dims = dict(dims)
    dims.setdefault("max_position_embeddings", max(2048, L))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**dims, attn_implementation="sdpa")).to(device=device, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    data = torch.tensor(rows, dtype=torch.long)
    n_micro = batch_rows // micro_rows
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    peak_rss = _rss_gib()
    secs, losses = [], []
    for s in range(steps):
        idx = [(s * batch_rows + i) % len(rows) for i in range(batch_rows)]
        batch = data[idx].to(device)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for m in range(n_micro):
            ids = batch[m * micro_rows:(m + 1) * micro_rows]
            with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss / n_micro
            loss.backward()
            total += loss.detach().float()
            if not cuda:
                peak_rss = max(peak_rss, _rss_gib())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        secs.append(time.perf_counter() - t0)
        losses.append(float(total))
        if not cuda:
            peak_rss = max(peak_rss, _rss_gib())
    tps = [batch_rows * L / t for t in secs]
    timed = tps[2:] if steps > 3 else tps
    out = {"liger": bool(liger), "device": device, "bf16": bf16, "dims": dims, "seq_len": L,
           "micro_rows": micro_rows, "batch_rows": batch_rows, "steps": steps, "seed": seed,
           "n_params": sum(p.numel() for p in model.parameters()),
           "median_tokens_per_s": statistics.median(timed), "tokens_per_s": tps, "step_seconds": secs,
           "losses": losses, "versions": _versions()}
    if cuda:
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["gpu"] = torch.cuda.get_device_name(device)
    else:
        out["peak_rss_gib"] = peak_rss
    return out


def run_both(cli_args: list[str], liger_values=(0, 1)) -> dict:
    """Run each liger setting in a separate process (the patch is global); return {liger: result}."""
    results = {}
    for lg in liger_values:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "r.json")
            cmd = [sys.executable, os.path.abspath(__file__), *cli_args, "--liger", str(lg), "--json", path]
            subprocess.run(cmd, check=True)
            with open(path) as f:
                results[lg] = json.load(f)
    return results


def make_rows(vocab_size: int, n: int, seq_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, seq_len), generator=g).tolist()


def _summary(r: dict) -> str:
    mem = f"peak_mem {r['peak_mem_gib']:.2f} GiB" if "peak_mem_gib" in r else f"peak_rss {r['peak_rss_gib']:.2f} GiB"
    return (f"liger={int(r['liger'])} {r['device']} L={r['seq_len']} micro={r['micro_rows']} batch={r['batch_rows']} "
            f"median {r['median_tokens_per_s']:.0f} tok/s {mem} losses "
            + " ".join(f"{x:.4f}" for x in r["losses"]))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--liger", choices=["0", "1", "both"], default="0")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro_rows", type=int, default=2)
    p.add_argument("--batch_rows", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_bf16", action="store_true", help="fp32 forward (no autocast)")
    p.add_argument("--rows_file", help="JSON list of equal-length token-id lists (overrides random rows)")
    p.add_argument("--save_rows", help="write the rows used to this JSON file (to feed another trainer)")
    p.add_argument("--json", help="write the result JSON here")
    a = p.parse_args()
    if a.liger == "both":
        argv = [f"--{k}={v}" for k, v in vars(a).items() if k not in ("liger", "json", "no_bf16") and v is not None]
        res = run_both(argv + (["--no_bf16"] if a.no_bf16 else []))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({str(k): v for k, v in res.items()}, f, indent=1)
        return
    dims = dict(SHAPES[a.shape])
    if a.rows_file:
        with open(a.rows_file) as f:
            rows = json.load(f)
    else:
        rows = make_rows(dims["vocab_size"], a.steps * a.batch_rows, a.seq_len, seed=0)
    if a.save_rows:
        with open(a.save_rows, "w") as f:
            json.dump(rows, f)
    r = run_hf(dims, rows, a.micro_rows, a.batch_rows, a.steps, a.liger == "1", seed=a.seed,
               device=a.device, bf16=not a.no_bf16)
    r["shape"] = a.shape
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    print(_summary(r), flush=True)


if __name__ == "__main__":
    main()
