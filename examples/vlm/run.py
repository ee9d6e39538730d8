"""Vision-language RL on a CPU: a tiny Qwen2.5-VL (random weights, rlhf.models.tiny.make_tiny_vlm) learns the
shapes task (rlhf.demo.vision_task: count the shapes in a 112 x 112 image, or name their colour) by SFT from
scratch to a middling accuracy, then GRPO with the exact-answer reward; held-out accuracy before and after each,
for each seed. examples/vlm/README.md has the figures.

    python examples/vlm/run.py --out outputs/vlm [--seeds 1,2,3] [--sft_epochs 10] [--grpo_steps 300]
    python examples/vlm/run.py --out outputs/vlm_456 --seeds 4,5,6 --control   # and the negative control

Per seed: the data (its own images), the model, ``launch/sft.py`` on 512 image/question/answer records (10 epochs:
a middling accuracy; 20 overfit to about the model's limit, 8 stay near chance), ``launch/ppo.py`` (GRPO: 8 prompts
x 8 replies of up to 4 tokens a step, reward 1 for the exact answer, Adam at a constant 2e-4, vLLM with the images)
from the SFT model on 2400 other images, with the held-out set (256 questions on images never trained on, 4 replies
each at temperature 1) evaluated before the first step and after the last. Writes under --out: s<seed>/ (data, model, sft,
grpo and their logs), summary.json and vlm_curves.png.
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


def sft_command(model: str, data: str, out: str, seed: int, epochs: int, nproc: int) -> list[str]:
    from rlhf.distributed.env import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), os.path.join(REPO, "launch", "sft.py"),
            "--pretrain", model, "--dataset", data, "--input_key", "prompt", "--output_key", "response",
            "--apply_chat_template", "--max_len", "64", "--train_batch_size", "16", "--micro_train_batch_size", "8",
            "--max_epochs", str(epochs), "--learning_rate", "1e-3", "--lr_warmup_ratio", "0.05",
            "--lr_scheduler", "cosine", "--seed", str(seed), "--save_path", out, "--logging_steps", "8"]


def grpo_flags(model: str, data: dict, out: str, seed: int, steps: int, lr: float = 2e-4) -> list[str]:
    return ["--pretrain", model, "--prompt_data", data["train"], "--input_key", "prompt", "--label_key", "answer",
            "--apply_chat_template", "--reward_fn", "rlhf.demo.vision_task:shape_reward",
            "--advantage_estimator", "group_norm", "--init_kl_coef", "0",
            "--rollout_batch_size", "8", "--n_samples_per_prompt", "8", "--train_batch_size", "64",
            "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "16", "--max_epochs", "1",
            "--generate_max_len", "4", "--prompt_max_len", "64", "--temperature", "1.0",
            "--actor_learning_rate", str(lr), "--lr_scheduler", "constant", "--lr_warmup_ratio", "0",
            "--max_samples", str(8 * steps), "--num_episodes", "1", "--seed", str(seed),
            "--eval_dataset", data["heldout"], "--eval_n_samples_per_prompt", "4", "--eval_temperature", "1.0",
            "--vllm_kv_cache_mb", "64", "--save_path", out, "--save_steps", "-1"]


def shuffle_labels(path: str, seed: int) -> str:
    """A copy of the GRPO prompts whose answers are permuted within each question kind; returns its path."""
    import random

    rows = [json.loads(line) for line in open(path)]
    rng = random.Random(seed)
    for kind in sorted({r["kind"] for r in rows}):
        idx = [i for i, r in enumerate(rows) if r["kind"] == kind]
        answers = [rows[i]["answer"] for i in idx]
        rng.shuffle(answers)
        for i, a in zip(idx, answers):
            rows[i]["answer"] = a
    out = path.replace(".jsonl", "_shuffled.jsonl")
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return out

def summarize(out: str) -> dict:
    from rlhf.observability.metrics import read_metrics_jsonl

    ev = read_metrics_jsonl(os.path.join(out, "metrics.jsonl"), "eval")
    tr = read_metrics_jsonl(os.path.join(out, "metrics.jsonl"), "ppo")
    first, last = ev[min(ev)], ev[max(ev)]
    steps = sorted(tr)
    return {"acc_before": first["reward"], "acc_after": last["reward"], "pass4_before": first["pass@4"],
            "pass4_after": last["pass@4"], "reward": [tr[s]["reward"] for s in steps],
            "drift_max": max(tr[s]["rollout_logprob_drift_max"] for s in steps),
            "sec_per_step": statistics.median(tr[s].get("time/step_wall", tr[s]["time/step"]) for s in steps)}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    w = 20  # 8 prompts a step: the per-step reward is noisy; the mean of the last w steps
    for name, r in sorted(results.items()):
        x = r["reward"]
        mean = [sum(x[max(0, i - w + 1):i + 1]) / len(x[max(0, i - w + 1):i + 1]) for i in range(len(x))]
        ax.plot(range(1, len(x) + 1), mean, label=f"{name} (held-out {r['acc_before']:.2f} -> {r['acc_after']:.2f})")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"training reward (exact answer), mean of {w} steps")
    ax.set_title("GRPO on the shapes task, tiny Qwen2.5-VL after SFT from scratch")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    from examples.rlvr.run import ppo_command, run

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/vlm")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--sft_epochs", type=int, default=10)
    p.add_argument("--grpo_steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--n_sft", type=int, default=512, help="SFT records (image, question, answer)")
    p.add_argument("--n_train", type=int, default=2400, help="GRPO prompts (images never shown to SFT)")
    p.add_argument("--n_heldout", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-4, help="GRPO's actor learning rate")
    p.add_argument("--shuffled_labels", action="store_true",
                   help="the negative control: GRPO's prompts keep their images but take the answers of other "
                        "prompts (a permutation of the count answers among counts, colours among colours), so the "
                        "reward says nothing about the image")
    p.add_argument("--control", action="store_true",
                   help="per seed, GRPO with the true answers and then the negative control (--shuffled_labels) "
                        "from the same SFT model: grpo/ and grpo_control/, summary entries s<seed> and "
                        "s<seed>_control")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    from rlhf.demo.vision_task import corpus, write
    from rlhf.models.tiny import make_tiny_vlm

    path = os.path.join(out, "summary.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        name = f"s{seed}"
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        print(f"== {name}", flush=True)
        t0 = time.time()
        data = write(os.path.join(d, "data"), seed=seed, n_train=args.n_train, n_heldout=args.n_heldout,
                     n_sft=args.n_sft)
        model = os.path.join(d, "model")
        if not os.path.exists(os.path.join(model, "config.json")):
            make_tiny_vlm(model, seed=seed, texts=corpus(), vocab_size=300)
        run(sft_command(model, data["sft"], os.path.join(d, "sft"), seed, args.sft_epochs, args.nproc),
            os.path.join(d, "sft.log"))
        t_sft = time.time() - t0
        for sub, shuffled in [("grpo", args.shuffled_labels)] + ([("grpo_control", True)] if args.control else []):
            t1 = time.time()
            d_data = dict(data, train=shuffle_labels(data["train"], seed)) if shuffled else data
            run(ppo_command(grpo_flags(os.path.join(d, "sft"), d_data, os.path.join(d, sub), seed, args.grpo_steps,
                                       args.lr), args.nproc), os.path.join(d, f"{sub}.log"))
            r = summarize(os.path.join(d, sub))
            r.update(seconds_sft=t_sft, seconds=t_sft + time.time() - t1, shuffled_labels=shuffled)
            results[name if sub == "grpo" else f"{name}_control"] = r
            print(f"   {name}{' control' if shuffled else ''}: held-out accuracy after SFT {r['acc_before']:.3f} -> "
                  f"after GRPO {r['acc_after']:.3f} (pass@4 {r['pass4_before']:.3f} -> {r['pass4_after']:.3f}); "
                  f"{r['sec_per_step']:.2f} s/step; vLLM-trainer drift {r['drift_max']:.1e}", flush=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    plot(results, os.path.join(out, "vlm_curves.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
