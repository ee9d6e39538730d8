"""Partial rollouts against the synchronous trainer on a workload whose tail matters (issue 44 item 6).

    .venv/bin/python bench/partial_rollout.py [--seeds 1,2,3] [--steps 20] [--max_len 64] [--out bench/results]

GRPO on SmolLM2-135M-Instruct with the RLVR example's settings (examples/rlvr/run.py: 8 prompts x 8
replies, exact-answer reward, Adam at a constant rate, 2 ranks, colocated vLLM), except a length budget of
``--max_len`` tokens: most answers end within 10-20 tokens, a fraction rambles to the budget, and the
synchronous step waits for them. Runs, per seed: synchronous, ``--partial_rollout --max_staleness 1`` and
``--max_staleness 2`` (``--partial_rollout_oversample`` 0.5). Per run: samples/s (64 over the median wall time of a
step, the first step excluded), generation seconds per step (median), trained reply length, training reward per
step and per wall-clock second, held-out accuracy before -> after (the trainer's own evaluation, 64 questions x 4
at temperature 0.6). Writes partial_rollout.json and partial_rollout.png under --out; runs already in
partial_rollout.json with the same ``--steps`` and ``--max_len`` are kept (run one config or seed per sitting).
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

CONFIGS = {
    "sync": [],
    "partial_k1": ["--partial_rollout", "--max_staleness", "1", "--partial_rollout_oversample", "0.5"],
    "partial_k2": ["--partial_rollout", "--max_staleness", "2", "--partial_rollout_oversample", "0.5"],
}


def summarize(run_dir: str) -> dict:
    from rlhf.observability.metrics import read_metrics_jsonl

    tr = read_metrics_jsonl(os.path.join(run_dir, "metrics.jsonl"), "ppo")
    ev = read_metrics_jsonl(os.path.join(run_dir, "metrics.jsonl"), "eval")
    steps = sorted(tr)
    wall = [tr[s].get("time/step_wall", tr[s]["time/step"]) for s in steps]
    gen = [tr[s]["time/rollout"] for s in steps]
    return {"reward": [tr[s]["reward"] for s in steps], "step_wall": wall,
            "samples_per_s": 64 / statistics.median(wall[1:]), "gen_s_per_step": statistics.median(gen[1:]),
            "response_length": statistics.mean(tr[s]["response_length"] for s in steps),
            "acc_before": ev[min(ev)]["reward"], "acc_after": ev[max(ev)]["reward"],
            "aborted": sum(tr[s].get("partial/aborted_samples", 0) for s in steps),
            "dropped": sum(tr[s].get("partial/dropped_samples", 0) for s in steps),
            "at_budget": 1 - statistics.mean(tr[s]["finished_frac"] for s in steps),
            "due_groups": sum(tr[s].get("partial/due_groups", 0) for s in steps),
            "max_token_age": max(tr[s].get("partial/max_token_age", 0) for s in steps),
            "is_weight": statistics.mean(tr[s].get("actor/rollout_is_weight", 1.0) for s in steps),
            "masked_frac": statistics.mean(tr[s].get("actor/rollout_corr_masked_frac", 0.0) for s in steps),
            # the trained groups whose 8 replies all scored the same: their GRPO advantages are all 0
            "equal_reward_groups": [tr[s].get("reward_equal_groups_frac") for s in steps]}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for config in CONFIGS:
        runs = [r for k, r in results.items() if k.rsplit("_s", 1)[0] == config]
        if not runs:
            continue
        n = min(len(r["reward"]) for r in runs)
        mean = [statistics.mean(r["reward"][i] for r in runs) for i in range(n)]
        t = [statistics.mean(sum(r["step_wall"][:i + 1]) for r in runs) for i in range(n)]
        a.plot(range(1, n + 1), mean, label=f"{config} ({len(runs)} seeds)")
        b.plot(t, mean, label=config)
    a.set_xlabel("step")
    b.set_xlabel("wall-clock seconds")
    for ax in (a, b):
        ax.set_ylabel("training reward per sample")
        ax.legend(fontsize=8)
    fig.suptitle("GRPO, SmolLM2-135M-Instruct: synchronous vs partial rollouts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max_len", type=int, default=64)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--work", default="/tmp/partial_rollout")
    p.add_argument("--name", default="partial_rollout",
                   help="the results' file name under --out (<name>.json, <name>.png)")
    args = p.parse_args(argv)
    from examples.rlvr.run import ppo_command, ppo_flags, run, smollm2_or

    from _machine import commit, cpu_model

    from rlhf.demo.arith_task import write

    os.makedirs(args.out, exist_ok=True)
    model = smollm2_or(None, args.work)
    data = write(os.path.join(args.work, "data"), seed=0)
    out_json = os.path.join(args.out, f"{args.name}.json")
    # Runs already recorded with the same step count and budget are kept (one config or seed per sitting).
    old = json.load(open(out_json)) if os.path.exists(out_json) else {}
    results: dict = {k: r for k, r in old.get("runs", {}).items()
                     if len(r["reward"]) == args.steps and r.get("max_len", args.max_len) == args.max_len}
    here = {"commit": commit(), "machine": cpu_model()}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for config in args.configs.split(","):
            name = f"{config}_s{seed}"
            run_dir = os.path.join(args.work, name)
            os.makedirs(run_dir, exist_ok=True)
            t0 = time.time()
            cmd = ppo_command(ppo_flags(model, data, run_dir, seed, args.steps,
                                        ["--generate_max_len", str(args.max_len), "--prompt_max_len", "64"]
                                        + CONFIGS[config]))
            run(cmd, os.path.join(run_dir, "train.log"))
            r = summarize(run_dir)
            r.update(seconds=time.time() - t0, max_len=args.max_len, date=time.strftime("%Y-%m-%d"), **here)
            results[name] = r
            print(f"{name}: {r['samples_per_s']:.2f} samples/s, generation {r['gen_s_per_step']:.1f} s/step, "
                  f"reply {r['response_length']:.1f} tokens, held-out {r['acc_before']:.3f} -> {r['acc_after']:.3f}, "
                  f"aborted {r['aborted']:.0f}, dropped {r['dropped']:.0f}, at budget {r['at_budget']:.3f}, "
                  f"due {r['due_groups']:.0f}, oldest {r['max_token_age']:.0f}, equal-reward groups "
                  f"{r['equal_reward_groups']}", flush=True)
            with open(out_json, "w") as f:
                json.dump({"machine": here["machine"], "date": time.strftime("%Y-%m-%d"), **old, "runs": results}, f,
                          indent=1)
    plot(results, os.path.join(args.out, f"{args.name}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
