"""One TRL GRPO run for bench/rlvr_vs_trl.py; runs in bench/.venv-trl (TRL 1.12.0's ``GRPOTrainer``).

    bench/.venv-trl/bin/python bench/_trl_grpo.py --model M --train train.jsonl --steps 30 --out result.json

tests/gpu/gpu_grpo.py runs it on a GPU (``--device cuda --bf16 --micro 16 --plain_prompts``, with and without
``--liger``: TRL's ``use_liger_kernel``, Liger's fused linear GRPO loss and its patched Llama) and on the CPU.

The settings of ours in rlvr_vs_trl.py: 8 prompts x 8 generations per step (one process on every core, its usual
CPU run: per-device batch 64, one gradient-accumulation step), up to 24 new tokens at temperature 1, the chat
template, the same exact-answer reward (``rlhf.rewards.verifiers.math_reward``, imported from the repository), no KL
(TRL's default beta 0), TRL's default loss (``dapo``: the token mean over the batch) and group-scaled rewards,
Adam(0.9, 0.999) at a constant --lr, one update per generation batch, fp32 (--bf16: TRL's bf16 setting), no
gradient checkpointing (TRL defaults to it; ours does not recompute), transformers' ``generate`` (TRL's default
without vLLM). Writes, per step, the wall time between step ends, TRL's logged reward, and the final model.
"""
import argparse
import json
import os
import sys

from _trl_timing import step_timer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True, help="jsonl of {prompt, answer} (rlhf/demo/arith_task.py)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--prompts_per_step", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--micro", type=int, default=None, help="rows per micro-batch (default: the whole batch at once)")
    p.add_argument("--plain_prompts", action="store_true", help="the prompt text as is, no chat template")
    p.add_argument("--liger", action="store_true", help="TRL's use_liger_kernel")
    p.add_argument("--save", default=None, help="save the final model here")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, REPO)
    from rlhf.rewards.verifiers import math_reward  # the same verifier as ours (pure Python + math-verify)

    transformers.logging.set_verbosity_error()
    rows = [json.loads(ln) for ln in open(args.train) if ln.strip()]
    n = args.prompts_per_step * args.steps
    if len(rows) < n:
        raise SystemExit(f"need {n} prompts, have {len(rows)}")
    def prompt(text: str):
        return text if args.plain_prompts else [{"role": "user", "content": text}]

    train = Dataset.from_list([{"prompt": prompt(r["prompt"]), "answer": r["answer"]} for r in rows[:n]])

    def exact_answer(completions, answer, **kw):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return math_reward([""] * len(texts), texts, answer)

    batch = args.prompts_per_step * args.generations
    micro = args.micro or batch
    if batch % micro:
        raise SystemExit(f"--micro {micro} must divide the {batch} samples a step")
    cfg = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl_out"),
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        num_generations=args.generations, use_liger_kernel=args.liger,
        max_completion_length=args.max_new_tokens, temperature=1.0, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, max_steps=args.steps, num_train_epochs=1, seed=args.seed, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=args.device == "cpu", bf16=args.bf16, fp16=False, disable_tqdm=True,
        dataloader_num_workers=0, gradient_checkpointing=False, shuffle_dataset=False)
    times: list[float] = []
    logged: list[dict] = []

    timer = step_timer(times, logged, "reward", record=lambda logs, step: {
        "step": step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}})
    trainer = GRPOTrainer(model=args.model, reward_funcs=[exact_answer], args=cfg, train_dataset=train,
                          callbacks=[timer])
    trainer.train()
    if args.save:
        trainer.model.save_pretrained(args.save)
        trainer.processing_class.save_pretrained(args.save)
    with open(args.out, "w") as f:
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
        json.dump({"step_seconds": times, "logs": logged, "samples_per_step": batch, "peak_gib": peak}, f, indent=1)


if __name__ == "__main__":
    main()
