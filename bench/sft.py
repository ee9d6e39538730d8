"""SFT training throughput (real tokens/s) of a tiny Llama at TP1 vs TP2 on 2 ranks, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sft.py                       # about a minute on 2 CPU cores
    OMP_NUM_THREADS=1 .venv/bin/python bench/sft.py --hidden 128 --layers 2 --steps 3   # a quick check

It makes a tiny Llama (``rlhf.models.tiny``, seeded) and synthetic SFT samples in a temporary folder, then
starts itself under ``torchrun --nproc_per_node 2``. Both ranks run the same optimizer steps (same global
batch, same data, fp32) twice: at TP1 (so DP2) and at TP2 (DP1), through the trainer's own pieces
(``ModelRole.train_step``, ``rlhf.supervised.loop.make_microbatches``, the SFT task's loss). Rank 0 prints the real
(non-padding) tokens per second of each layout over ``--steps`` timed steps (after ``--warmup`` untimed ones),
the median step time, and the ratio TP2 / TP1. ``--packing_samples`` runs packed micro-batches instead.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
WORDS = ("the quick brown fox jumps over lazy dog apple banana cherry delta echo golf hotel india juliet kilo "
         "lima mike november oscar papa quebec romeo sierra tango uniform victor whiskey").split()
LAYOUTS = (1, 2)  # TP sizes, on 2 ranks


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--max-len", type=int, default=256, help="tokens per sample at most")
    p.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch")
    p.add_argument("--steps", type=int, default=5, help="timed steps per layout (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--packing_samples", action="store_true", help="packed micro-batches (padding-free rows)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--_workdir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def prepare(work: Path, args: argparse.Namespace) -> None:
    """The tiny model and a JSONL of SFT samples, a few to about max_len tokens long (short prompts, so that
    truncation to max_len never drops a sample)."""
    from rlhf.models.tiny import make_tiny_hf

    make_tiny_hf(str(work / "model"), "llama", seed=0, hidden_size=args.hidden, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                 intermediate_size=args.hidden * 8 // 3 // 16 * 16, max_position_embeddings=max(256, args.max_len))
    rng = random.Random(0)
    n = args.global_batch * (args.warmup + args.steps)
    with open(work / "sft.jsonl", "w") as f:
        for _ in range(n):
            words = rng.randint(2, max(2, args.max_len // 6))  # ~6 tokens a word (byte-level tokenizer)
            text = [rng.choice(WORDS) for _ in range(words)]
            cut = rng.randint(1, max(1, words // 4))
            f.write(json.dumps({"input": " ".join(text[:cut]), "output": " " + " ".join(text[cut:])}) + "\n")


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="bench_sft_") as tmp:
        prepare(Path(tmp), args)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))))
        env.setdefault("OMP_NUM_THREADS", str(args.threads))
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               __file__, *argv, "--_workdir", tmp]
        return subprocess.call(cmd, env=env)


def run_layout(tp: int, args: argparse.Namespace, work: Path, samples: list, tokenizer) -> dict:
    import torch
    import torch.distributed as dist

    from rlhf.supervised import sft
    from rlhf.distributed import initialize_mesh
    from rlhf.runtime.role import ModelRole, OptimConfig
    from rlhf.supervised.loop import make_microbatches, tokens_in

    mesh = initialize_mesh(tp, 1, seed=0)
    task = sft.TASK()
    total = args.warmup + args.steps
    engine = ModelRole(mesh, str(work / "model"), optim=OptimConfig(lr=1e-4, warmup_ratio=0.0, total_steps=total),
                         name="sft")
    loss_fn = task.loss_fn(engine)
    per_rank = args.global_batch // mesh.dp
    times, tokens = [], []
    for step in range(total):
        batch = samples[step * args.global_batch:(step + 1) * args.global_batch]
        mine = batch[mesh.dp_rank * per_rank:(mesh.dp_rank + 1) * per_rank]
        groups = [mine[i:i + args.micro_batch] for i in range(0, len(mine), args.micro_batch)]
        dist.barrier()
        t0 = time.perf_counter()
        mbs = make_microbatches(task, groups, tokenizer, packing=args.packing_samples, same_shape=False)
        engine.train_step(mbs, loss_fn, task.metric_keys, output=task.output)
        dist.barrier()
        dt = time.perf_counter() - t0
        ntok = torch.tensor([tokens_in(mbs)], dtype=torch.float64)
        dist.all_reduce(ntok, group=mesh.dp_group)  # every TP rank of a replica counts the same tokens
        if step >= args.warmup:
            times.append(dt)
            tokens.append(ntok.item())
    del engine
    return {"tokens_per_s": sum(tokens) / sum(times), "step_s": statistics.median(times),
            "tokens_per_step": statistics.mean(tokens)}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from rlhf.supervised import sft
    from rlhf.distributed import destroy_mesh
    from rlhf.observability.metrics import setup_logging

    torch.set_num_threads(args.threads)
    work = Path(args._workdir)
    setup_logging(int(os.environ.get("RANK", 0)))
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    p = argparse.ArgumentParser()
    sft.add_args(p)
    data_args = p.parse_args(["--pretrain", str(work / "model"), "--dataset", str(work / "sft.jsonl"),
                              "--save_path", str(work / "unused"), "--max_len", str(args.max_len)])
    from rlhf.supervised.loop import build_job

    task = sft.TASK()
    samples, _, _ = task.load_data(build_job(data_args, task), tokenizer)
    # Every rank must get its share of every step: a rank with no micro-batch would skip the DP all-reduces.
    assert len(samples) >= args.global_batch * (args.warmup + args.steps), (len(samples), "samples dropped")
    if args.global_batch % (2 * args.micro_batch):
        raise ValueError(f"--global-batch {args.global_batch} must divide by 2 x --micro-batch {args.micro_batch}")
    res = {f"tp{tp}": run_layout(tp, args, work, samples, tokenizer) for tp in LAYOUTS}
    if dist.get_rank() == 0:
        print(f"SFT, tiny llama (hidden {args.hidden}, {args.layers} layers, heads {args.heads}/{args.kv_heads}, "
              f"vocab {len(tokenizer)}), fp32, 2 ranks x {args.threads} thread(s); global batch {args.global_batch} "
              f"samples (~{res['tp1']['tokens_per_step']:.0f} real tokens), micro-batch {args.micro_batch}, "
              f"{'packed' if args.packing_samples else 'padded'}; {args.steps} timed steps after {args.warmup}")
        print(f"{'layout':<12}{'tokens/s':>10}{'median step s':>15}")
        for tp in LAYOUTS:
            r = res[f"tp{tp}"]
            print(f"{f'tp{tp} (dp{2 // tp})':<12}{r['tokens_per_s']:>10.0f}{r['step_s']:>15.3f}")
        print(f"tp2 / tp1 tokens/s: {res['tp2']['tokens_per_s'] / res['tp1']['tokens_per_s']:.2f}")
    destroy_mesh()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args._workdir is None:
        return launch(args, argv)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
