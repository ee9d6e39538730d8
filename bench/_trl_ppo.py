"""One TRL PPO run for bench/ppo_vs_trl.py; runs in bench/.venv-trl (TRL 1.12.0, ``trl.experimental.ppo``).

    bench/.venv-trl/bin/python bench/_trl_ppo.py --actor A --rm R --prompts P.jsonl --steps 6 --out result.json

Settings mirror ours in ppo_vs_trl.py: one process on every core (TRL's usual CPU run), 32 prompts per step,
exactly --response_length new tokens (no stop token), 1 PPO epoch, 2 mini-batches (one optimizer step each),
fp32 (--bf16: TRL's bf16 setting), no gradient checkpointing (TRL defaults to it; we do not recompute), constant learning rate, the
same seed. Writes, per step, the wall time between step ends and TRL's
logged metrics (``objective/scores`` is the mean reward-model score of the step's responses).
"""
import argparse
import json
import os
import resource
import time

from _trl_timing import step_timer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--actor", required=True)
    p.add_argument("--rm", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--steps", type=int, required=True, help="PPO steps (the first is the warm-up)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--response_length", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--kl_coef", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="TRL's own bf16 setting (PPOConfig(bf16=True): accelerate's "
                   "bf16 mixed precision over fp32 weights)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    transformers.logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(args.actor, padding_side="left")
    prompts = [json.loads(ln)["prompt"] for ln in open(args.prompts) if ln.strip()]
    n = args.batch * args.steps
    if len(prompts) < n:
        raise SystemExit(f"need {n} prompts, have {len(prompts)}")
    ids = [tok(t)["input_ids"] for t in prompts[:n]]
    train = Dataset.from_dict({"input_ids": ids})
    f32 = dict(dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(args.actor, **f32)
    ref = AutoModelForCausalLM.from_pretrained(args.actor, **f32)
    reward = AutoModelForSequenceClassification.from_pretrained(args.rm, num_labels=1, **f32)
    value = AutoModelForSequenceClassification.from_pretrained(args.rm, num_labels=1, **f32)
    cfg = PPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl_out"),
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=1, num_mini_batches=2,
        num_ppo_epochs=1, total_episodes=n, local_rollout_forward_batch_size=args.batch,
        response_length=args.response_length, stop_token=None, temperature=1.0, missing_eos_penalty=None,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999,
        weight_decay=0.0, max_grad_norm=1.0, kl_coef=args.kl_coef, kl_estimator="k1", cliprange=0.2,
        cliprange_value=0.2, vf_coef=0.1, gamma=1.0, lam=0.95, whiten_rewards=False, num_sample_generations=0,
        seed=args.seed, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=args.bf16, fp16=False,
        disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=False)

    times: list[float] = []
    logged: list[dict] = []
    phases = _time_trl_phases()  # per-step seconds by phase

    timer = step_timer(times, logged, "objective/scores", on_step_end=phases.end_step)

    trainer = PPOTrainer(args=cfg, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=train, eval_dataset=train.select(range(args.batch)),
                         callbacks=[timer])
    trainer.train()
    out = {"system": "trl", "trl_version": __import__("trl").__version__,
           "transformers_version": transformers.__version__, "torch_threads": torch.get_num_threads(),
           "step_s": times, "scores": [float(x["objective/scores"]) for x in logged],
           "kl": [float(x.get("objective/kl", float("nan"))) for x in logged],
           "phases": phases.per_step,
           "peak_rss_gb_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, args.out)


class _PhaseClock:
    def __init__(self) -> None:
        self.acc = {"generation": 0.0, "experience_fwd": 0.0, "update_fwd": 0.0}
        self.per_step: dict[str, list[float]] = {k: [] for k in [*self.acc, "rest"]}

    def wrap(self, fn, phase):
        def timed(*a, **k):
            import torch

            name = phase or ("update_fwd" if torch.is_grad_enabled() else "experience_fwd")
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.acc[name] += time.perf_counter() - t
        return timed

    def end_step(self, step_s: float) -> None:
        for k, v in self.acc.items():
            self.per_step[k].append(v)
        # the rest of the step: the update's backward and optimizer steps, log-probs from the generation
        # logits, advantages, metrics
        self.per_step["rest"].append(step_s - sum(self.acc.values()))
        self.acc = dict.fromkeys(self.acc, 0.0)


def _time_trl_phases() -> _PhaseClock:
    """Time TRL's step by phase by wrapping the module-level functions its train loop calls: batch_generation
    (rollout), forward / get_reward under no_grad (reference, reward and value forwards) and with grad (the
    policy+value forward of each PPO mini-batch)."""
    import trl.experimental.ppo.ppo_trainer as m

    clock = _PhaseClock()
    m.batch_generation = clock.wrap(m.batch_generation, "generation")
    m.forward = clock.wrap(m.forward, None)
    m.get_reward = clock.wrap(m.get_reward, None)
    return clock


if __name__ == "__main__":
    main()
