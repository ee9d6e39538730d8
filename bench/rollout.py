"""Generation throughput on 2 ranks: the trainer's vLLM engine at TP 2 (one engine over both ranks) or TP 1 (one
engine per rank, each with half the prompts), or transformers' ``generate`` (KV cache, each rank half the
prompts), at the same batch and lengths as ``bench/ppo_vs_trl.py`` (32 prompts, exactly 32 new tokens).

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/rollout.py --size 25m --engine vllm --vllm_tp 2
    ... --engine vllm --vllm_tp 1
    ... --engine hf

One thread per rank, as in the trainer. Prints the median over ``--rounds`` (after a warm-up) and, as its last
line, ``tokens_per_s=<new tokens per second, both ranks together>``.
"""
from __future__ import annotations

import argparse
import os
import random
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
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--vllm_tp", type=int, default=2, choices=[1, 2])
    p.add_argument("--compiled", action="store_true", help="vLLM without enforce_eager (torch.compile)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", default="/tmp/bench_weight_sync", help="model folders (shared with bench/weight_sync.py)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import logging

    import torch
    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    from rlhf.distributed import DistEnv, initialize_mesh

    env = DistEnv.from_environ()
    root = os.path.join(args.work, args.size)
    if env.rank == 0:
        from ppo_vs_trl import build_models

        build_models(args.size, root, seed=0)
    mesh = initialize_mesh(1, 1, env, seed=1)
    dist.barrier()
    actor_dir = os.path.join(root, "actor")
    import transformers

    vocab = transformers.AutoConfig.from_pretrained(actor_dir).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    mine = prompts[mesh.rank * args.batch // 2:(mesh.rank + 1) * args.batch // 2]
    if args.engine == "vllm":
        from rlhf.rollout import RolloutConfig, build_rollout

        cfg = RolloutConfig(tensor_parallel_size=args.vllm_tp, kv_cache_bytes=64 << 20,
                            max_model_len=args.prompt_len + args.new_tokens + 8, backend="vllm",
                            enforce_eager=not args.compiled)
        engine = build_rollout(mesh, None, cfg, actor_dir)

        def generate(seed):
            engine.generate(prompts, n=1, temperature=1.0, top_p=1.0, max_tokens=args.new_tokens, seed=seed,
                            ignore_eos=True)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float32).eval()
        ids = torch.tensor(mine)

        def generate(seed):
            torch.manual_seed(seed)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                     top_k=0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                     pad_token_id=0)
            assert out.shape[1] == args.prompt_len + args.new_tokens

    times = []
    for r in range(args.rounds + 1):
        dist.barrier()
        t0 = time.perf_counter()
        generate(r)
        dist.barrier()
        if r:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    if mesh.is_rank0:
        layout = f"vllm tp{args.vllm_tp}" + (" (one engine)" if args.vllm_tp == 2 else " (two engines)") \
            if args.engine == "vllm" else "transformers generate (each rank half)"
        print(f"size={args.size} {layout}: {args.batch} prompts x {args.new_tokens} tokens, median {med:.3f} s "
              "(" + " ".join(f"{t:.3f}" for t in times) + ")")
        print(f"tokens_per_s={args.batch * args.new_tokens / med:.1f}", flush=True)
    if args.engine == "vllm":
        from rlhf.rollout import shutdown

        shutdown(mesh, engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
