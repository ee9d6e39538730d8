"""Evaluation during PPO training on held-out prompts (``--eval_dataset``), as OpenRLHF's ``compute_eval_metrics``:
``--eval_n_samples_per_prompt`` replies per prompt at ``--eval_temperature``, scored by the run's rule reward
(``--reward_fn`` / ``--remote_rm_url``, with ``--label_key``), at step 0 and every ``--eval_steps`` steps (and after
the last). Logged with the prefix ``eval`` (progress line, TensorBoard, metrics.jsonl):

* ``eval/reward``: the mean reward over every reply (OpenRLHF's pass1);
* ``eval/pass@k``: the mean over prompts of the best of its k replies (for a 0/1 verifier: the share of prompts
  with a right answer among k);
* ``eval/response_length``, ``eval/truncated_rate``.

Every rank generates and scores the whole held-out set (the generator hands every rank every reply), so the
numbers are the same everywhere without a collective.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from rlhf.ppo.prompts import load_prompts


@dataclass(frozen=True)
class EvalConfig:
    dataset: str
    """--eval_dataset"""
    steps: int = -1
    """--eval_steps: every this many steps (and at step 0 and after the last); -1: at step 0 and the end only"""
    n_samples_per_prompt: int = 4
    """--eval_n_samples_per_prompt (k of pass@k)"""
    temperature: float = 0.6
    """--eval_temperature (OpenRLHF's default)"""
    max_samples: int | None = None
    """--eval_max_samples: the first this many held-out prompts"""

    def __post_init__(self) -> None:
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"--eval_n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        if not self.temperature > 0:
            raise ValueError(f"--eval_temperature must be > 0, got {self.temperature}")
        if self.steps == 0 or self.steps < -1:
            raise ValueError(f"--eval_steps must be >= 1 (or -1: at the start and the end only), got {self.steps}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EvalConfig | None":
        if not args.eval_dataset:
            return None
        return cls(dataset=args.eval_dataset, steps=args.eval_steps, n_samples_per_prompt=args.eval_n_samples_per_prompt,
                   temperature=args.eval_temperature, max_samples=args.eval_max_samples)

    def due(self, step: int, total: int) -> bool:
        """Evaluate after ``step`` steps (0: before the first)?"""
        return step == 0 or step == total or (self.steps > 0 and step % self.steps == 0)


def pass_at_k(rewards: torch.Tensor, k: int) -> tuple[float, float]:
    """(mean reward, mean over prompts of the best of k): ``rewards`` (P * k,) prompt-major."""
    r = rewards.float().view(-1, k)
    return r.mean().item(), r.max(dim=1).values.mean().item()


class Evaluator:
    """The held-out prompts and their reward sources; ``run(step)`` generates, scores and returns the metrics."""

    def __init__(self, cfg: EvalConfig, args: argparse.Namespace, tokenizer, reward_cfg, mesh):
        from rlhf.ppo.stages import RewardSources

        self.cfg, self.args, self.mesh = cfg, args, mesh
        eval_args = argparse.Namespace(**{**vars(args), "prompt_data": cfg.dataset, "prompt_data_probs": None,
                                          "max_samples": cfg.max_samples})  # not --max_samples: that caps training
        try:
            self.prompts, _ = load_prompts(eval_args, tokenizer)
        except ValueError as e:
            raise ValueError(str(e).replace("--prompt_data", "--eval_dataset")) from None
        self.rewards = RewardSources(reward_cfg, [], self.prompts, tokenizer, mesh)

    def run(self, roles, step: int, timer) -> dict[str, float]:
        from rlhf.ppo.stages import Rollout

        k = self.cfg.n_samples_per_prompt
        roles.memory.enter("weight_sync" if roles.rollout.reads_actor_params else "rollout")
        with timer.phase("eval"):
            roles.rollout.wake_up(["kv_cache"])
            samples = roles.rollout.generate([p.prompt_ids.tolist() for p in self.prompts], n=k,
                                             temperature=self.cfg.temperature, top_p=1.0,
                                             max_tokens=self.args.generate_max_len,
                                             seed=self.args.seed * 100_003 + 7_777_777 + step)
            roles.rollout.sleep()
            # every rank scores every reply (the same numbers everywhere, no collective)
            rollout = Rollout(prompt_idx=list(range(len(self.prompts))), samples=samples, local=samples)
            rewards, raw, _ = self.rewards.score({}, rollout)
        mean, best = pass_at_k(raw.cpu(), k)
        n = len(samples)
        return {"reward": mean, f"pass@{k}": best, "response_length": sum(len(s.response_ids) for s in samples) / n,
                "truncated_rate": sum(not s.finished for s in samples) / n, "prompts": float(len(self.prompts)),
                "seconds": timer.metrics.get("time/eval", 0.0)}
