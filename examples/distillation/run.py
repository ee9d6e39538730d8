"""On-policy distillation on a real model: a teacher trained with the project's GRPO example distills into the
untrained SmolLM2-135M-Instruct on the same arithmetic prompts (docs/distillation.md); held-out accuracy at every
evaluation of each run, beside the GRPO run's own curve.

    python examples/distillation/run.py --out outputs/distill [--seeds 1,2,3] [--teacher_steps 30] [--steps 10]

1. The teacher: ``examples/rlvr/run.py``'s GRPO run (its ``ppo_flags``: 8 prompts x 8 replies per step, the
   exact-answer verifier, seed 1, ``--teacher_steps`` steps), evaluated every ``--eval_every`` steps; its export
   (``<out>/teacher/``) is the teacher. Skipped when ``<out>/teacher/model.safetensors`` exists or ``--teacher``
   names a folder.
2. The students: the untrained model, the same prompts and batch, pure on-policy distillation
   (``--teacher_pretrain <teacher> --task_reward_coef 0``: the verifier's reward is logged and scores the held-out
   set but weighs nothing in the update), one run per seed, evaluated every ``--eval_every`` steps.

Writes under --out: data/, teacher/, distill_s<seed>/ (metrics.jsonl, logs), summary.json (held-out accuracy per
evaluated step of every run; the first step at which each run reaches 70%, 80% and 90% of the teacher's final
held-out accuracy, the GRPO run's included) and distill_curves.png. ``--report_only`` rewrites summary.json and the
plot from the runs already under --out. Figures: examples/distillation/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def heldout_curve(run_dir: str) -> dict[int, float]:
    """step -> held-out accuracy (the evaluator's mean exact-answer reward)."""
    from rlhf.observability.metrics import read_metrics_jsonl

    ev = read_metrics_jsonl(os.path.join(run_dir, "metrics.jsonl"), "eval")
    return {int(s): ev[s]["reward"] for s in sorted(ev)}


def first_reaching(curve: dict[int, float], target: float) -> int | None:
    return next((s for s in sorted(curve) if curve[s] >= target), None)


FRACTIONS = (0.7, 0.8, 0.9)
"""of the teacher's final held-out accuracy: the first step at which each run reaches each"""


def report(out: str, curves: dict[str, dict[int, float]], summary: dict) -> None:
    """summary.json (every curve, and per run the first step reaching each fraction) and distill_curves.png."""
    grpo = curves.get("GRPO (the teacher's run)")
    if grpo:
        teacher_acc = grpo[max(grpo)]
        summary.update(teacher_acc=teacher_acc, target=0.9 * teacher_acc,
                       grpo_step_at_target=first_reaching(grpo, 0.9 * teacher_acc),
                       first_step_at_fraction={name: {str(f): first_reaching(c, f * teacher_acc) for f in FRACTIONS}
                                               for name, c in curves.items()})
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({**summary, "curves": curves}, f, indent=1)
    plot(curves, os.path.join(out, "distill_curves.png"))


def launch(flags: list[str], run_dir: str, nproc: int) -> None:
    from examples.rlvr.run import ppo_command, run

    os.makedirs(run_dir, exist_ok=True)
    run(ppo_command(flags, nproc), os.path.join(run_dir, "train.log"))


def plot(curves: dict[str, dict[int, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, c in curves.items():
        ax.plot(list(c), list(c.values()), marker="o", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (exact answers)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    from examples.rlvr.run import LR, ppo_flags, smollm2_or

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/distill")
    p.add_argument("--seeds", default="1,2,3", help="one distillation run per seed")
    p.add_argument("--teacher_steps", type=int, default=30, help="GRPO steps of the teacher's run")
    p.add_argument("--steps", type=int, default=10, help="distillation steps of each student")
    p.add_argument("--eval_every", type=int, default=2, help="held-out evaluation every this many steps")
    p.add_argument("--teacher", default=None, help="an already trained teacher (HF folder): skips step 1")
    p.add_argument("--model", default=None, help="the student (default: SmolLM2-135M-Instruct, prepared once)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--lr", default=LR, help="Adam's constant learning rate (both runs)")
    p.add_argument("--report_only", action="store_true", help="summary.json and the plot from the runs under --out")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    if args.report_only:
        curves = {"GRPO (the teacher's run)": heldout_curve(args.teacher or os.path.join(out, "teacher"))}
        for seed in [int(s) for s in args.seeds.split(",") if s]:
            if os.path.exists(os.path.join(out, f"distill_s{seed}", "metrics.jsonl")):
                curves[f"distill_s{seed}"] = heldout_curve(os.path.join(out, f"distill_s{seed}"))
        previous = json.load(open(os.path.join(out, "summary.json"))) if os.path.exists(
            os.path.join(out, "summary.json")) else {}
        report(out, curves, {k: v for k, v in previous.items() if k not in ("curves", "first_step_at_fraction")})
        return 0
    model = smollm2_or(args.model, out)
    from rlhf.demo.arith_task import write

    data = write(os.path.join(out, "data"), seed=0)
    evals = ["--eval_steps", str(args.eval_every)]
    curves, t0 = {}, time.time()
    teacher = args.teacher or os.path.join(out, "teacher")
    if args.teacher is None and not os.path.exists(os.path.join(teacher, "model.safetensors")):
        print(f"== teacher: GRPO, {args.teacher_steps} steps", flush=True)
        launch(ppo_flags(model, data, teacher, 1, args.teacher_steps, evals, args.lr), teacher, args.nproc)
    if os.path.exists(os.path.join(teacher, "metrics.jsonl")):
        curves["GRPO (the teacher's run)"] = heldout_curve(teacher)
    summary: dict = {"teacher": teacher, "seconds_teacher": time.time() - t0, "runs": {}}
    target = None
    if curves:
        grpo = curves["GRPO (the teacher's run)"]
        target = 0.9 * grpo[max(grpo)]
        summary.update(teacher_acc=grpo[max(grpo)], target=target, grpo_step_at_target=first_reaching(grpo, target))
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        name = f"distill_s{seed}"
        run_dir = os.path.join(out, name)
        print(f"== {name}: pure on-policy distillation, {args.steps} steps", flush=True)
        t1 = time.time()
        launch(ppo_flags(model, data, run_dir, seed, args.steps,
                         evals + ["--teacher_pretrain", teacher, "--task_reward_coef", "0"], args.lr),
               run_dir, args.nproc)
        curves[name] = c = heldout_curve(run_dir)
        summary["runs"][name] = {"heldout": c, "seconds": time.time() - t1,
                                 "step_at_target": first_reaching(c, target) if target is not None else None}
        print(f"   {name}: held-out accuracy " + ", ".join(f"step {s}: {a:.3f}" for s, a in c.items()), flush=True)
        report(out, curves, summary)
    report(out, curves, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
