"""GRPO with a verifiable reward on SmolLM2-135M-Instruct: ours (launch/ppo.py, colocated vLLM) against Hugging Face
TRL 1.12.0's ``GRPOTrainer``, same model, prompts, group size, learning rate, temperature, reward and steps.

    bash bench/setup_trl.sh                       # TRL in its own venv, bench/.venv-trl
    .venv/bin/python bench/rlvr_vs_trl.py [--seeds 1,2,3] [--steps 30] [--bf16] [--out bench/results]

Per seed, alternately (ours, TRL): a 30-step run of each (8 prompts x 8 replies of up to 24 tokens per step, one
update per batch, no KL, Adam(0.9, 0.999) at a constant rate: examples/rlvr/run.py's LR, or --lr; ours on 2
ranks with vLLM as examples/rlvr/run.py runs it, TRL as one process on both cores, bench/_trl_grpo.py), then
both final models, and the model they started from,
evaluated the same way by examples/rlvr/eval.py (transformers' generate, 64 held-out questions x 4 replies at
temperature 0.6: accuracy and pass@4). Samples/s: 64 over the median step time, the first step excluded.

Writes rlvr_results_<fp32|bf16>.json and rlvr_curves_<fp32|bf16>.png (training reward per step, mean over seeds,
both systems) under --out and prints held-out accuracy before -> after per system and seed, samples/s, and the
ratio ours/TRL. Seeds already in rlvr_results_<fp32|bf16>.json with the same --steps and --lr stay (a seed run again
is replaced), so the comparison can be run one seed per sitting (a bf16 seed takes about 85 minutes on a 2-core AMD
EPYC); the summary covers every seed in the file.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))
TRL_PY = os.path.join(REPO, "bench", ".venv-trl", "bin", "python")


def env(threads: int) -> dict:
    from rlhf.distributed.env import env_without_launcher

    e = env_without_launcher()
    e.update(OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=REPO)
    return e


def run_ours(model: str, data: dict, out: str, seed: int, steps: int, bf16: bool, lr: str) -> dict:
    from rlhf.observability.metrics import read_metrics_jsonl
    from examples.rlvr.run import ppo_command, ppo_flags

    cmd = ppo_command(ppo_flags(model, data, out, seed, steps, ["--bf16"] if bf16 else [], lr))
    with open(os.path.join(out, "train.log"), "w") as log:
        if subprocess.run(cmd, cwd=REPO, env=env(1), stdout=log, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"error: our run failed; see {out}/train.log")
    tr = read_metrics_jsonl(os.path.join(out, "metrics.jsonl"), "ppo")
    steps_ = sorted(tr)
    return {"reward": [tr[s]["reward"] for s in steps_], "step_seconds": [tr[s]["time/step"] for s in steps_],
            "model": out}


def reuse_ours(run_dir: str) -> dict:
    """--ours_from: a finished run of examples/rlvr/run.py with the same settings (its grpo_s<seed> folder):
    its metrics and exported model instead of training again."""
    from rlhf.observability.metrics import read_metrics_jsonl

    tr = read_metrics_jsonl(os.path.join(run_dir, "metrics.jsonl"), "ppo")
    if not tr or not os.path.exists(os.path.join(run_dir, "config.json")):
        raise SystemExit(f"error: --ours_from: {run_dir} holds no finished run (metrics.jsonl and the exported model)")
    steps_ = sorted(tr)
    return {"reward": [tr[s]["reward"] for s in steps_],
            "step_seconds": [tr[s].get("time/step_wall", tr[s]["time/step"]) for s in steps_], "model": run_dir,
            "reused": run_dir}


def prompts_in_our_order(train: str, out: str, seed: int, steps: int, per_step: int = 8) -> str:
    """``train``'s records in the order our run draws them (``--max_samples`` of them mixed and shuffled with
    ``--seed``, rlhf.data.mixing, then the step sampler's permutation, rlhf.data.sampler), written to
    ``out/train_in_our_order.jsonl`` for TRL, which reads its file in order (``shuffle_dataset=False``): both systems
    then train on the same prompts at every step, so their training rewards compare step by step."""
    from rlhf.data import BatchConfig, DistributedBatchSampler
    from rlhf.data.mixing import mix

    lines = [ln for ln in open(train) if ln.strip()]
    pairs = mix([len(lines)], None, per_step * steps, seed)  # one source: (0, record index)
    sampler = DistributedBatchSampler(len(pairs), BatchConfig(per_step, per_step), seed=seed)
    order = [pairs[k][1] for step in range(steps) for mb in sampler.batch_at(0, step) for k in mb]
    path = os.path.join(out, "train_in_our_order.jsonl")
    with open(path, "w") as f:
        f.writelines(lines[i] for i in order)
    return path


def run_trl(model: str, data: dict, out: str, seed: int, steps: int, bf16: bool, lr: str) -> dict:
    res = os.path.join(out, "trl_result.json")
    train = prompts_in_our_order(data["train"], out, seed, steps)
    cmd = [TRL_PY, os.path.join(REPO, "bench", "_trl_grpo.py"), "--model", model, "--train", train,
           "--steps", str(steps), "--seed", str(seed), "--lr", lr, "--save", os.path.join(out, "model"), "--out", res]
    with open(os.path.join(out, "train.log"), "w") as log:
        if subprocess.run(cmd + (["--bf16"] if bf16 else []), cwd=REPO, env=env(2), stdout=log,
                          stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"error: the TRL run failed; see {out}/train.log")
    r = json.load(open(res))
    return {"reward": [x["reward"] for x in r["logs"]], "step_seconds": r["step_seconds"],
            "model": os.path.join(out, "model")}


def held_out(model: str, heldout: str) -> dict:
    out = subprocess.run([sys.executable, os.path.join(REPO, "examples", "rlvr", "eval.py"), "--model", model,
                          "--heldout", heldout], cwd=REPO, env=env(2), capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"error: evaluating {model}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def samples_per_s(step_seconds: list[float], samples: int = 64) -> float:
    return samples / statistics.median(step_seconds[1:])


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for system in ("ours", "trl"):
        runs = [r[system]["reward"] for r in results["seeds"].values()]
        n = min(len(c) for c in runs)
        mean = [sum(c[i] for c in runs) / len(runs) for i in range(n)]
        ax.plot(range(1, n + 1), mean, label=f"{system} (mean of {len(runs)} seeds)")
    ax.set_xlabel("step")
    ax.set_ylabel("training reward (exact answers)")
    ax.set_title("GRPO, SmolLM2-135M-Instruct, 8 prompts x 8 replies")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--lr", default=None, help="Adam's constant learning rate, both systems (default: the example's)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--work", default="/tmp/rlvr_vs_trl")
    p.add_argument("--ours_from", default=None,
                   help="the --out of a finished `examples/rlvr/run.py --configs grpo` with the same --steps, "
                        "--lr and precision: its grpo_s<seed> runs stand for ours instead of training again")
    args = p.parse_args(argv)
    from _machine import commit
    from examples.rlvr.run import LR

    lr = args.lr or LR
    if not os.path.exists(TRL_PY):
        raise SystemExit("error: bench/.venv-trl is missing: bash bench/setup_trl.sh")
    from rlhf.demo.arith_task import write

    os.makedirs(args.out, exist_ok=True)
    model = os.path.join(args.work, "smollm2-135m-instruct")
    if not os.path.exists(os.path.join(model, "config.json")):
        subprocess.run([sys.executable, os.path.join(REPO, "tools", "prepare_smollm2.py"), "--out", model], check=True)
    data = write(os.path.join(args.work, "data"), seed=0)
    tag = "bf16" if args.bf16 else "fp32"
    path = os.path.join(args.out, f"rlvr_results_{tag}.json")
    results = {"precision": tag, "steps": args.steps, "lr": lr, "ours_from": args.ours_from, "seeds": {}}
    earlier = json.load(open(path)) if os.path.exists(path) else None
    if earlier and all(earlier.get(k) == results[k] for k in ("precision", "steps", "lr")) and "base" in earlier:
        # seeds run before (another sitting) with the same settings stay: a long comparison can be run seed by seed
        results["seeds"], results["base"] = earlier["seeds"], earlier["base"]
        print(f"keeping seeds {sorted(earlier['seeds'])} of {path}", flush=True)
    else:
        results["base"] = held_out(model, data["heldout"])
    print(f"base model: {results['base']}", flush=True)
    for seed in [int(s) for s in args.seeds.split(",")]:
        row = {}
        for system, fn in (("ours", run_ours), ("trl", run_trl)):
            out = os.path.join(args.work, f"{tag}_{system}_s{seed}")
            os.makedirs(out, exist_ok=True)
            t0 = time.time()
            if system == "ours" and args.ours_from:
                r = reuse_ours(os.path.join(args.ours_from, f"grpo_s{seed}"))
            else:
                r = fn(model, data, out, seed, args.steps, args.bf16, lr)
            r["held_out"] = held_out(r["model"], data["heldout"])
            r["samples_per_s"] = samples_per_s(r["step_seconds"])
            r["seconds"] = time.time() - t0
            row[system] = r
            print(f"seed {seed} {system}: held-out accuracy {results['base']['accuracy']:.3f} -> "
                  f"{r['held_out']['accuracy']:.3f} (pass@4 {r['held_out']['pass@4']:.3f}); training reward "
                  f"{sum(r['reward'][:5]) / 5:.3f} -> {sum(r['reward'][-5:]) / 5:.3f}; "
                  f"{r['samples_per_s']:.2f} samples/s", flush=True)
        row["commit"] = commit()
        results["seeds"][str(seed)] = row
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out, f"rlvr_curves_{tag}.png"))
    ours = statistics.median(r["ours"]["samples_per_s"] for r in results["seeds"].values())
    trl = statistics.median(r["trl"]["samples_per_s"] for r in results["seeds"].values())
    acc = {s: statistics.mean(r[s]["held_out"]["accuracy"] for r in results["seeds"].values()) for s in ("ours", "trl")}
    print(f"held-out accuracy (mean over seeds): ours {acc['ours']:.3f}, TRL {acc['trl']:.3f} (base "
          f"{results['base']['accuracy']:.3f}); samples/s ours/TRL {ours / trl:.2f}x ({tag})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
