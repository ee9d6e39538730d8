"""Evaluation during PPO training on held-out prompts (``--eval_dataset``), as OpenRLHF's ``compute_eval_metrics``:
``--eval_n_samples_per_prompt`` replies per prompt at ``--eval_temperature``, scored by the run's rule reward
(``--reward_fn`` / ``--remote_rm_url``, with ``--label_key``) or, with ``--agent_func_path``, as trajectories of
the agent scored by its environments (and the rule reward, as in training), at step 0 and every ``--eval_steps`` steps (and after
the last). Logged with the prefix ``eval`` (progress line, TensorBoard, metrics.jsonl):

* ``eval/reward``: the mean reward over every reply (OpenRLHF's pass1);
* ``eval/pass@k``: the mean over prompts of the best of its k replies (for a 0/1 verifier: the share of prompts
  with a right answer among k);
* ``eval/response_length``, ``eval/truncated_rate``; with an agent, ``eval/agent/*`` (turns, failures, ...).

Every rank generates and scores the whole held-out set (the generator hands every rank every reply), so the
numbers are the same everywhere without a collective.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from rlhf.config.part import Part, flag
from rlhf.ppo.prompts import load_prompts


@dataclass(frozen=True)
class EvalConfig(Part):
    """The held-out evaluation's part of the PPO job (off without --eval_dataset)."""

    DESTS = {"dataset": "eval_dataset", "steps": "eval_steps", "n_samples_per_prompt": "eval_n_samples_per_prompt",
             "temperature": "eval_temperature", "max_samples": "eval_max_samples"}
    dataset: str | None = flag("--eval_dataset", "--eval.dataset", help="held-out prompts, scored by the rule reward "
                                                                        "(--reward_fn / --remote_rm_url, "
                                                                        "--label_key) at step 0, every --eval_steps "
                                                                        "and at the end: eval/reward and eval/pass@k",
                               default=None)
    """--eval_dataset (None: no evaluation)"""
    steps: int = flag("--eval_steps", "--eval.steps", type=int, help="evaluate every N steps (-1: at the start and "
                                                                     "the end only)", default=-1)
    """--eval_steps: every this many steps (and at step 0 and after the last); -1: at step 0 and the end only"""
    n_samples_per_prompt: int = flag("--eval_n_samples_per_prompt", "--eval.n_samples_per_prompt", type=int,
                                     help="replies per held-out prompt (the k of pass@k)", default=4)
    """--eval_n_samples_per_prompt (k of pass@k)"""
    temperature: float = flag("--eval_temperature", "--eval.temperature", type=float, default=0.6)
    """--eval_temperature (OpenRLHF's default)"""
    max_samples: int | None = flag("--eval_max_samples", type=int, help="the first N held-out prompts (default: all)",
                                   default=None)
    """--eval_max_samples: the first this many held-out prompts"""


    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        if not self.dataset:
            return
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"--eval_n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        if not self.temperature > 0:
            raise ValueError(f"--eval_temperature must be > 0, got {self.temperature}")
        if self.steps == 0 or self.steps < -1:
            raise ValueError(f"--eval_steps must be >= 1 (or -1: at the start and the end only), got {self.steps}")
        from rlhf.config.job import check_paths_exist

        check_paths_exist("--eval_dataset", self.dataset)

    def due(self, step: int, total: int) -> bool:
        """Evaluate after ``step`` steps (0: before the first)?"""
        return step == 0 or step == total or (self.steps > 0 and step % self.steps == 0)


def pass_at_k(rewards: torch.Tensor, k: int) -> tuple[float, float]:
    """(mean reward, mean over prompts of the best of k): ``rewards`` (P * k,) prompt-major."""
    r = rewards.float().view(-1, k)
    return r.mean().item(), r.max(dim=1).values.mean().item()


class Evaluator:
    """The held-out prompts and their reward sources; ``run(step)`` generates, scores and returns the metrics."""

    def __init__(self, cfg: EvalConfig, job, tokenizer, reward_cfg, mesh):
        """``job``: the ``PPOJobConfig``; the held-out prompts are read as --prompt_data's are (its flat view with
        --eval_dataset in their place), the replies as long as --generate_max_len."""
        from rlhf.ppo.stages import RewardSources

        self.cfg, self.mesh = cfg, mesh
        self.max_tokens, self.seed = job.generation.generate_max_len, job.engine.seed
        eval_args = argparse.Namespace(**{**vars(job.namespace()), "prompt_data": cfg.dataset,
                                          "prompt_data_probs": None,
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
            from rlhf.rollout.types import generation_prompt

            seed, agent_metrics = self.seed * 100_003 + 7_777_777 + step, {}
            if roles.agent is not None:  # every rank gets every trajectory, as the generator's replies
                samples, agent_metrics = roles.agent.run(
                    roles.rollout, self.prompts, list(range(len(self.prompts))), n=k, temperature=self.cfg.temperature,
                    top_p=1.0, max_tokens=self.max_tokens, seed=seed, version=roles.weight_sync.version)
            else:
                samples = roles.rollout.generate([generation_prompt(p) for p in self.prompts], n=k,
                                                 temperature=self.cfg.temperature, top_p=1.0,
                                                 max_tokens=self.max_tokens, seed=seed)
            roles.rollout.sleep()
            # every rank scores every reply (the same numbers everywhere, no collective)
            rollout = Rollout(prompt_idx=list(range(len(self.prompts))), samples=samples, local=samples)
            rewards, raw, _ = self.rewards.score({}, rollout)
        mean, best = pass_at_k(raw.cpu(), k)
        n = len(samples)
        return {"reward": mean, f"pass@{k}": best, "response_length": sum(len(s.response_ids) for s in samples) / n,
                "truncated_rate": sum(not s.finished for s in samples) / n, "prompts": float(len(self.prompts)),
                "seconds": timer.metrics.get("time/eval", 0.0), **agent_metrics}
