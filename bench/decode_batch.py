"""What one decode step costs at batch 1 to 96 on this machine: why over-sampling does not pay on a CPU (issue 44).

    .venv/bin/python bench/decode_batch.py [--model DIR] [--batches 1,8,32,64,96] [--tokens 64] [--threads 1]

The vLLM engine the trainer runs (in-process, eager, fp32, SmolLM2-135M-Instruct, one thread as each of the
partial-rollout bench's two ranks has), fed B copies-apart of the RLVR example's prompts, every reply forced to
``--tokens`` tokens (``ignore_eos``). Decode time = (time for 1 + T tokens) - (time for 1 token: the prefill and
the first sample), over T steps. Reports per batch: seconds per decode step, seconds per generated token, and the
step's cost against batch 1 and batch 64. On a GPU a decode step is memory-bound (the weights are read once per
step whatever B is) until B is in the hundreds, so a step at B = 96 costs about what one at B = 64 does; where a
CPU is compute-bound the step grows with B and the extra sequences of over-sampling are paid in proportion.
Writes decode_batch.json under --out.
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="1,8,32,64,96")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--work", default="/tmp/partial_rollout")
    args = p.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from _machine import commit, cpu_model
    from examples.rlvr.run import smollm2_or
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from rlhf.demo.arith_task import write

    torch.set_num_threads(args.threads)
    model = smollm2_or(args.model, args.work)
    data = write(os.path.join(args.work, "data"), seed=0)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [json.loads(ln)["prompt"] for ln in open(data["train"]) if ln.strip()]
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for q in prompts]
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              kv_cache_memory_bytes=256 << 20, enable_chunked_prefill=False, max_num_batched_tokens=8192,
              enable_prefix_caching=False, max_num_seqs=max(batches))

    def timed(b: int, n_tokens: int) -> float:
        params = SamplingParams(n=1, temperature=1.0, max_tokens=n_tokens, min_tokens=n_tokens, ignore_eos=True,
                                seed=0)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": ids[i % len(ids)]} for i in range(b)], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == n_tokens for o in outs)
        return dt

    timed(batches[-1], 4)  # warm-up: first-call allocations
    rows = {}
    for b in batches:
        prefill = statistics.median(timed(b, 1) for _ in range(args.repeats))
        whole = statistics.median(timed(b, 1 + args.tokens) for _ in range(args.repeats))
        step = (whole - prefill) / args.tokens
        rows[b] = {"prefill_s": prefill, "decode_s_per_step": step, "decode_s_per_token": step / b}
        print(f"batch {b:3d}: prefill {prefill:.3f} s, decode {step * 1e3:.1f} ms/step, "
              f"{step / b * 1e3:.2f} ms/token", flush=True)
    base, at64 = rows[batches[0]]["decode_s_per_step"], rows.get(64, {}).get("decode_s_per_step")
    for b, r in rows.items():
        r["step_vs_batch1"] = r["decode_s_per_step"] / base
        if at64:
            r["step_vs_batch64"] = r["decode_s_per_step"] / at64
    result = {"machine": cpu_model(), "date": time.strftime("%Y-%m-%d"), "commit": commit(), "threads": args.threads,
              "tokens": args.tokens, "engine": "vLLM in-process, eager, fp32, SmolLM2-135M-Instruct",
              "batches": {str(b): r for b, r in rows.items()}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_batch.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({b: round(r["step_vs_batch1"], 2) for b, r in rows.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
