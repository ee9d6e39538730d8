"""The megatron generator with its decode cache against feeding the whole sequence per token, side by side.

    .venv/bin/python bench/megatron_decode_cache.py [--tokens 32,128] [--prompt 64] [--n 4] [--rounds 2]

One rank, one thread, fp32, in process: a Llama and a Qwen3-Next (three Gated DeltaNet layers of four) of hidden
256, 4 layers, random weights (``rlhf.models.tiny``). Each case samples ``--n`` replies of exactly T tokens to one
prompt of ``--prompt`` tokens (``ignore_eos``), cached then whole, alternated over ``--rounds`` (A B A B: the
machine's drift falls on both); reports the median seconds of each and whole / cached. Writes
megatron_decode_cache.json under --out.
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
sys.path.insert(0, os.path.join(REPO, "tests"))

DIMS = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, max_position_embeddings=1024)


def build(name: str, path: str) -> str:
    from rlhf.models.tiny import make_tiny_hf, make_tiny_hybrid

    if name == "llama":
        return make_tiny_hf(path, "llama", seed=0, **DIMS)
    return make_tiny_hybrid(path, "qwen3_next", seed=0, **DIMS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="32,128")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--work", default="/tmp/megatron_decode_cache")
    args = p.parse_args(argv)
    import torch
    from _machine import commit, cpu_model
    from helpers import free_port

    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.rollout.megatron_generator import MegatronRollout
    from rlhf.rollout.types import RolloutConfig
    from rlhf.runtime.role import ModelRole

    torch.set_num_threads(1)
    rows = []
    for name in ("llama", "qwen3_next"):
        path = build(name, os.path.join(args.work, name))
        mesh = initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"))
        gen = MegatronRollout(mesh, ModelRole(mesh, path, value_head=False, name="actor"),
                              RolloutConfig(backend="megatron"), announce=False)
        prompt = [(7 * i) % 200 + 3 for i in range(args.prompt)]
        gen.generate([prompt], n=args.n, temperature=1.0, top_p=1.0, max_tokens=4, seed=0, ignore_eos=True)  # warm
        for T in (int(t) for t in args.tokens.split(",")):
            times = {True: [], False: []}
            for _ in range(args.rounds):
                for cached in (True, False):
                    gen.use_decode_cache = cached
                    t0 = time.perf_counter()
                    gen.generate([prompt], n=args.n, temperature=1.0, top_p=1.0, max_tokens=T, seed=0,
                                 ignore_eos=True)
                    times[cached].append(time.perf_counter() - t0)
            c, w = statistics.median(times[True]), statistics.median(times[False])
            rows.append(dict(model=name, prompt=args.prompt, n=args.n, tokens=T, cached_s=round(c, 3),
                             whole_s=round(w, 3), whole_over_cached=round(w / c, 2)))
            print(json.dumps(rows[-1]), flush=True)
        destroy_mesh()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "megatron_decode_cache.json"), "w") as f:
        json.dump(dict(commit=commit(), cpu=cpu_model(), threads=1, rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
