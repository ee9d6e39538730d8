"""The megatron generator's draw per token step, side by side: the host draw it replaced (the logits copied to the
host, an fp64 ``log_softmax``, torch's ``multinomial``, which draws one exponential per vocabulary entry) against
``rlhf.rollout.megatron_generator.sample_rows`` (fp64 probabilities, the inverse of each row's cumulative
distribution at one uniform per row from the CPU generator, on the logits' device).

    .venv/bin/python bench/megatron_sampling.py [--rows 64] [--vocabs 49152,128256] [--rounds 7] [--threads 2]

Both alternated ``--rounds`` times on the same random logits (on the CPU here; on a GPU ``--device cuda`` keeps the
new draw on the device and pays the old one's copy). Prints and writes the median milliseconds of each and their
ratio to megatron_sampling.json under --out.
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


def host_draw(logits, gen):
    """The draw sample_rows replaced: (tokens, their log-probs) from the host's fp64 softmax and ``multinomial``."""
    import torch

    logp = torch.log_softmax(logits.cpu().double(), dim=-1)
    tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
    return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocabs", default="49152,128256")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    args = p.parse_args(argv)
    import torch
    from _machine import commit, cpu_model

    from rlhf.rollout.megatron_generator import sample_rows

    torch.set_num_threads(args.threads)
    rows = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        logits = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(0)).to(args.device)
        ms = {"host": [], "device": []}
        for _ in range(args.rounds):
            for name, fn in (("host", host_draw), ("device", sample_rows)):
                gen = torch.Generator().manual_seed(1)
                t0 = time.perf_counter()
                tok, _ = fn(logits, gen) if name == "host" else fn(logits, 1.0, 1.0, gen)
                tok.cpu()  # the tokens reach the host in both
                ms[name].append((time.perf_counter() - t0) * 1000)
        h, d = statistics.median(ms["host"]), statistics.median(ms["device"])
        rows.append(dict(rows=args.rows, vocab=vocab, host_ms=round(h, 1), device_ms=round(d, 1),
                         host_over_device=round(h / d, 2)))
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "megatron_sampling.json"), "w") as f:
        json.dump(dict(commit=commit(), cpu=cpu_model(), threads=args.threads, device=args.device, rows=rows), f,
                  indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
