"""An LLM judge teaches a real model its rubric: SmolLM2-135M-Instruct, asked short arithmetic questions
(rlhf/demo/arith_task.py), learns with GRPO to answer with the number alone, its only reward a judge model's
verdict (``--judge_pretrain``); a rule only measures, before and after, on held-out questions.

    python examples/judge/run.py --out outputs/judge [--configs judge,judge_verifier] [--seeds 1,2,3] [--steps 15]

1. **The judge**: SmolLM2-135M-Instruct fine-tuned (``launch/sft.py``, one epoch) on ``TEMPLATE`` (the reply, plain
   text) -> " Yes" / " No": the base model's own replies to the training questions (mostly a sentence or a ramble
   around the number), bare numbers, and numbers wrapped in words, each labelled by ``bare`` (the rubric as a rule).
   Its accuracy on replies to the held-out questions is printed. (A judge of correctness against the reference
   answer, trained the same way for one epoch, stayed at chance: its loss never left ln 2.)
2. **The runs**: the RLVR example's settings (examples/rlvr/run.py: 8 prompts x 8 replies of up to 24 tokens, one
   update per batch, no KL, constant 1e-5, group_norm) with ``--judge_pretrain`` (``--judge_parser
   choice:Yes=1,No=0``, one greedy token per answer, no chat template): ``judge``, the judge's verdict alone (instead
   of ``--reward_fn``); ``judge_verifier``, the judge's verdict plus the verifier's reward, weight 1 each.
3. **The measure**: transformers' own generate on the 64 held-out questions, 4 replies each at temperature 0.6, of
   the base model and of each run's final model: the share of replies that are a number alone (``bare``) and the
   share that are right (the verifier, ``rlhf.rewards.verifiers.math_reward``).

``--tiny`` runs the same pipeline's PPO on a tiny random Llama with the rule judge of the tests
(tests/ppo/_judge.py; reward: the reply has an upper-case letter or a digit), 3 seeds in about 20 s each.

Writes under --out: data/, judge/ (the fine-tuned judge), <run>/ (metrics.jsonl, TensorBoard, train.log, the final
model) and summary.json. Prints one line per run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from examples.rlvr.eval import sample_replies  # noqa: E402
from examples.rlvr.run import LR, ppo_command, ppo_flags, run, smollm2_or  # noqa: E402

TEMPLATE = "Reply: {response}\nA number alone:"
"""the judge's rubric, as plain text (no chat template: about 30 tokens a request); the judge answers " Yes" or
" No", one token each"""

JUDGE_FLAGS = ["--judge_parser", "choice:Yes=1,No=0", "--judge_max_new_tokens", "1", "--no-judge_chat_template"]
WORDY = ("The answer is {n}.", "{n}. I hope this helps!", "Sure! The result is {n}", "It is {n}, of course.")


def bare(reply: str) -> bool:
    """The rubric as a rule: the reply is a number alone (a final full stop allowed)."""
    return re.fullmatch(r"\s*-?\d+(?:\.\d+)?\.?\s*", reply) is not None


def drop_flags(flags: list[str], names: dict[str, int]) -> list[str]:
    """``flags`` without each named flag and its ``names[flag]`` values."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] in names:
            i += 1 + names[flags[i]]
            continue
        out.append(flags[i])
        i += 1
    return out


def judge_records(rows: list[dict], replies: list[str], seed: int) -> list[dict]:
    """Per question: its sampled reply, a bare number (the answer or a wrong one) and a number in words; each
    labelled by ``bare``."""
    rng = random.Random(seed)
    out = []
    for row, reply in zip(rows, replies):
        n = int(row["answer"]) + rng.choice([0, 0, -2, -1, 1, 2])
        for v in (reply, str(n), rng.choice(WORDY).format(n=n)):
            out.append({"input": TEMPLATE.replace("{response}", v), "output": " Yes" if bare(v) else " No"})
    return out


def make_judge(model: str, data: dict, out: str, nproc: int) -> tuple[str, dict]:
    """Fine-tune the judge (step 1); returns its folder and its held-out accuracy."""
    judge = os.path.join(out, "judge")
    rows = {k: [json.loads(ln) for ln in open(data[k]) if ln.strip()] for k in ("train", "heldout")}
    rows["heldout"] = rows["heldout"] * 4  # 4 sampled replies per held-out question
    recs = {}
    for k, seed in (("train", 11), ("heldout", 12)):
        path = os.path.join(out, "data", f"replies_{k}.json")
        if not os.path.exists(path):
            json.dump(sample_replies(model, rows[k], k=1, temperature=1.0, seed=seed, batch=32), open(path, "w"))
        recs[k] = judge_records(rows[k], json.load(open(path)), seed)
        with open(os.path.join(out, "data", f"judge_{k}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs[k])
    if not os.path.exists(os.path.join(judge, "config.json")):
        from rlhf.distributed.env import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), os.path.join(REPO, "launch", "sft.py"), "--pretrain", model,
               "--dataset", os.path.join(out, "data", "judge_train.jsonl"), "--input_key", "input",
               "--output_key", "output", "--max_len", "64", "--max_epochs", "1",
               "--train_batch_size", "32", "--micro_train_batch_size", "8", "--learning_rate", "5e-5",
               "--lr_scheduler", "cosine_with_min_lr", "--lr_warmup_ratio", "0.05", "--seed", "0",
               "--save_path", judge, "--save_steps", "-1"]
        run(cmd, os.path.join(out, "judge_sft.log"))
    return judge, judge_accuracy(judge, recs["heldout"])


def judge_accuracy(judge: str, recs: list[dict], batch: int = 32) -> dict:
    """The judge's greedy verdicts (transformers' generate) against the verifier's labels."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(judge, padding_side="left")
    lm = transformers.AutoModelForCausalLM.from_pretrained(judge, dtype=torch.float32).eval()
    right, said_yes = 0, 0
    for i in range(0, len(recs), batch):
        chunk = recs[i:i + batch]
        enc = tok([r["input"] for r in chunk], return_tensors="pt", padding=True)
        with torch.no_grad():
            gen = lm.generate(**enc, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id)
        for r, a in zip(chunk, tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)):
            yes = a.strip() == "Yes"
            said_yes += yes
            right += yes == (r["output"] == " Yes")
    return {"accuracy": right / len(recs), "yes_rate": said_yes / len(recs), "n": len(recs),
            "yes_labels": sum(r["output"] == " Yes" for r in recs) / len(recs)}


def measure(model_dir: str, heldout: str, k: int = 4) -> dict:
    """Held-out replies of ``model_dir`` (examples/rlvr/eval.py's sampling: temperature 0.6, seed 0): the share that
    are a number alone (``bare``) and the share the verifier grades right."""
    from rlhf.rewards.verifiers import math_reward

    rows = [json.loads(ln) for ln in open(heldout) if ln.strip()]
    replies = sample_replies(model_dir, rows, k)
    right = math_reward([""] * len(replies), replies, [r["answer"] for r in rows for _ in range(k)])
    return {"bare": sum(map(bare, replies)) / len(replies), "accuracy": sum(right) / len(right),
            "replies": len(replies), "examples": replies[:4]}


def tiny(out: str, seeds: list[int], steps: int) -> dict:
    """The tiny pipeline: a random Llama, the tests' rule judge, GRPO; the training reward per step."""
    sys.path.insert(0, os.path.join(REPO, "tests", "ppo"))
    from _judge import TEMPLATE as TINY_TEMPLATE
    from _judge import make_rule_judge
    from ppo_common import DIMS, write_prompts

    from rlhf.models.tiny import make_tiny_hf
    from rlhf.observability.metrics import read_metrics_jsonl

    actor = make_tiny_hf(os.path.join(out, "tiny_actor"), "llama", seed=0, **DIMS)
    judge = make_rule_judge(os.path.join(out, "tiny_judge"), actor)
    prompts = write_prompts(os.path.join(out, "tiny_prompts.jsonl"), 16 * steps, seed=1)
    tpl = os.path.join(out, "tiny_template.txt")
    open(tpl, "w").write(TINY_TEMPLATE)
    results = {}
    for seed in seeds:
        run_dir = os.path.join(out, f"tiny_s{seed}")
        flags = ["--pretrain", actor, "--prompt_data", prompts, "--input_key", "prompt", "--judge_pretrain", judge,
                 "--judge_template", tpl, "--judge_parser", "choice:Y=1,N=0", "--judge_max_new_tokens", "1",
                 "--advantage_estimator", "group_norm", "--init_kl_coef", "0", "--rollout_batch_size", "16",
                 "--n_samples_per_prompt", "4", "--train_batch_size", "64", "--micro_train_batch_size", "16",
                 "--micro_rollout_batch_size", "16", "--generate_max_len", "4", "--prompt_max_len", "32",
                 "--actor_learning_rate", "3e-3", "--lr_scheduler", "constant", "--lr_warmup_ratio", "0",
                 "--max_samples", str(16 * steps), "--seed", str(seed), "--rollout_backend", "megatron",
                 "--save_path", run_dir, "--save_steps", "-1"]
        t0 = time.time()
        run(ppo_command(flags, 1), os.path.join(run_dir + ".log"))
        tr = read_metrics_jsonl(os.path.join(run_dir, "metrics.jsonl"), "ppo")
        rewards = [tr[s]["reward"] for s in sorted(tr)]
        results[f"tiny_s{seed}"] = {"reward": rewards, "seconds": time.time() - t0}
        print(f"   tiny_s{seed}: judge reward, first 3 -> last 3 steps {sum(rewards[:3]) / 3:.3f} -> "
              f"{sum(rewards[-3:]) / 3:.3f}; {time.time() - t0:.0f} s", flush=True)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/judge")
    p.add_argument("--configs", default="judge,judge_verifier",
                   help="judge: the judge's verdict alone; judge_verifier: plus the verifier's reward (weight 1 each)")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="the tiny pipeline only (random Llama, the rule judge)")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    summary_path = os.path.join(out, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    if args.tiny:
        summary.update(tiny(out, seeds, args.steps))
        json.dump(summary, open(summary_path, "w"), indent=1)
        return 0
    from rlhf.demo.arith_task import write

    model = smollm2_or(None, out)
    data = write(os.path.join(out, "data"), seed=0)
    t0 = time.time()
    judge, acc = make_judge(model, data, out, args.nproc)
    summary["judge"] = {**acc, "seconds": time.time() - t0}
    print(f"== judge: held-out accuracy {acc['accuracy']:.3f} on {acc['n']} replies (it says Yes to "
          f"{acc['yes_rate']:.2f}, the rule to {acc['yes_labels']:.2f}); {time.time() - t0:.0f} s", flush=True)
    if "base" not in summary:
        summary["base"] = measure(model, data["heldout"])
    base = summary["base"]
    print(f"== base model: held-out replies a number alone {base['bare']:.3f}, right {base['accuracy']:.3f}",
          flush=True)
    tpl = os.path.join(out, "judge_template.txt")
    open(tpl, "w").write(TEMPLATE)
    configs = [c for c in args.configs.split(",") if c]
    if any(c not in ("judge", "judge_verifier") for c in configs):
        raise SystemExit(f"error: --configs takes judge,judge_verifier, got {args.configs!r}")
    for config, seed in [(c, s) for c in configs for s in seeds]:
        name = f"{config}_s{seed}"
        run_dir = os.path.join(out, name)
        os.makedirs(run_dir, exist_ok=True)
        print(f"== {name}", flush=True)
        t0 = time.time()
        drop = {"--eval_dataset": 1, "--eval_n_samples_per_prompt": 1, "--eval_temperature": 1}
        if config == "judge":
            drop["--reward_fn"] = 1
        flags = drop_flags(ppo_flags(model, data, run_dir, seed, args.steps, [], LR), drop)
        flags += ["--judge_pretrain", judge, "--judge_template", tpl, *JUDGE_FLAGS]
        run(ppo_command(flags, args.nproc), os.path.join(run_dir, "train.log"))
        from rlhf.observability.metrics import read_metrics_jsonl

        tr = read_metrics_jsonl(os.path.join(run_dir, "metrics.jsonl"), "ppo")
        steps = sorted(tr)
        ev = measure(run_dir, data["heldout"])
        r = {"reward": [tr[s]["reward"] for s in steps], "after": ev, "seconds": time.time() - t0, "steps": args.steps,
             "judge_reward": [tr[s].get("reward/judge", tr[s]["reward"]) for s in steps],
             "sec_per_step": sorted(tr[s]["time/step"] for s in steps)[len(steps) // 2]}
        summary[name] = r
        print(f"   {name}: held-out replies a number alone {base['bare']:.3f} -> {ev['bare']:.3f}, right "
              f"{base['accuracy']:.3f} -> {ev['accuracy']:.3f}; judge reward first 5 -> last 5 steps "
              f"{sum(r['judge_reward'][:5]) / 5:.3f} -> {sum(r['judge_reward'][-5:]) / 5:.3f}; "
              f"{r['sec_per_step']:.1f} s/step, "
              f"{r['seconds']:.0f} s", flush=True)
        json.dump(summary, open(summary_path, "w"), indent=1)
    json.dump(summary, open(summary_path, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
