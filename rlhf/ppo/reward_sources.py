"""The step's reward sources (``RewardSources``): reward-model scores, the rule function (``--reward_fn``), the
agents' environment rewards and the remote reward (``--remote_rm_url``), combined as ``rlhf.rewards.sources`` describes;
``rollout`` arguments are ``rlhf.ppo.stages.Rollout``."""
from __future__ import annotations

import torch

from rlhf.distributed.collectives import dp_all_gather
from rlhf.rollout.types import Sample


class RewardSources:
    """The step's reward: reward-model scores and the rule function (``--reward_fn``), combined as
    ``rlhf.rewards.sources`` describes; the rule function reads the prompt texts and the decoded replies."""

    def __init__(self, cfg, sources: list, prompts: list, tokenizer, mesh, judge=None):
        """``judge``: the LLM judge (``rlhf.rewards.judge.Judge``) when ``cfg`` has one."""
        from rlhf.rewards.sources import load_reward_fn

        self.cfg, self.prompts, self.tokenizer, self.mesh = cfg, prompts, tokenizer, mesh
        self.fn = load_reward_fn(cfg.reward_fn) if cfg.reward_fn else None
        self.norms = cfg.norms(sources)
        if (judge is None) != (cfg.judge is None):
            raise AssertionError(f"the reward config's judge ({cfg.judge}) and the judge given ({judge}) disagree")
        self.judge = judge

    def texts(self, rollout, samples: list[Sample]) -> tuple[list[str], list[str]]:
        """(prompt texts as the model saw them, decoded replies) of ``samples``."""
        texts = [self.prompts[rollout.prompt_idx[s.prompt_index]].prompt for s in samples]
        return texts, self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)

    def score(self, model_scores: dict[str, torch.Tensor], rollout
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """This rank's (optimized, raw) rewards (B,) from the reward models' scores (by role name), and each
        source's global mean as reward/rm<i>, reward/fn (when there is more than one, or normalization)."""
        from rlhf.rewards.sources import call_remote_rm_full, call_reward_fn_full, combine_rewards, source_metrics

        scores = dict(zip(self.cfg.rm_names, model_scores.values()))
        labels = [self.prompts[rollout.prompt_idx[s.prompt_index]].label for s in rollout.local]
        metrics = {}
        self.filter_scores = None
        if self.fn is not None:
            fn_scores, fn_logs = call_reward_fn_full(self.fn, *self.texts(rollout, rollout.local), labels=labels)
            scores["fn"] = fn_scores.to(self.mesh.device)
            metrics.update(extra_log_metrics(fn_logs, len(rollout.local), self.mesh))
        unscored = all(s.agent is not None and s.agent.reward is None for s in rollout.samples)
        if self.cfg.agent and not (unscored and (scores or self.cfg.remote_rm_url)):
            # the trajectories' environment rewards (rlhf.agents.rollout); an executor that gives none (OpenRLHF's
            # one-turn ones: its reward is left to the reward model or the rule) leaves them to the other sources
            scores["agent"] = agent_rewards(rollout.local).to(self.mesh.device)
            self.filter_scores = torch.tensor([s.agent.score for s in rollout.local])
            metrics.update(agent_extra_logs(rollout.samples))
        if self.cfg.remote_rm_url:  # this rank's share, as OpenRLHF's remote_rm_fn sends it
            texts, replies = self.texts(rollout, rollout.local)
            remote = call_remote_rm_full(self.cfg.remote_rm_url, [t + r for t, r in zip(texts, replies)], texts,
                                         labels, timeout=self.cfg.remote_rm_timeout)
            scores["remote"] = remote.rewards.to(self.mesh.device)
            self.filter_scores = remote.scores  # what dynamic filtering reads, when the reward gives it
            metrics.update(extra_log_metrics(remote.extra_logs, len(texts), self.mesh))
        if self.judge is not None:
            scores["judge"], judge_logs = self.judged(rollout, labels)
            metrics.update(judge_logs)
        if not scores:  # pure on-policy distillation (--task_reward_coef 0 with a teacher): no reward source
            rewards = raw = torch.zeros(len(rollout.local), device=self.mesh.device)
        else:
            weights = self.cfg.source_weights
            if "agent" not in scores:
                weights = {k: w for k, w in weights.items() if k != "agent"}
            rewards, raw = combine_rewards(scores, weights, self.norms)
        if self.filter_scores is None:
            self.filter_scores = rewards
        if len(scores) > 1 or self.norms:
            metrics.update(source_metrics({k: dp_all_gather(v, self.mesh) for k, v in scores.items()}))
        if self.norms:
            metrics["reward_normalized"] = dp_all_gather(rewards, self.mesh).mean().item()
        return rewards, raw, metrics

    def judged(self, rollout, labels: list) -> tuple[torch.Tensor, dict[str, float]]:
        """The LLM judge's rewards of this rank's samples (B,), its failure counts over the step and its seconds
        (``judge/seconds``, rank 0's, inside ``time/reward_fn``). A judge in the job generates data-parallel over
        every sample of the step (each rank gets every answer); a URL judge is asked for this rank's share."""
        import time

        from rlhf.rewards.judge import judge_metrics

        t0 = time.perf_counter()
        if self.judge.collective:
            every = rollout.samples
            lo = self.mesh.dp_rank * len(rollout.local)
            all_labels = [self.prompts[rollout.prompt_idx[s.prompt_index]].label for s in every]
            v = self.judge.score(*self.texts(rollout, every), all_labels)
            rewards, failures = v.rewards[lo:lo + len(rollout.local)], v.failures[lo:lo + len(rollout.local)]
        else:
            v = self.judge.score(*self.texts(rollout, rollout.local), labels)
            rewards, failures = v.rewards, v.failures
        return (torch.tensor(rewards, dtype=torch.float32, device=self.mesh.device),
                {**judge_metrics(failures, self.mesh), "judge/seconds": time.perf_counter() - t0})


def agent_rewards(samples: list[Sample]) -> torch.Tensor:
    """Each trajectory's environment reward (the sum of its step rewards; 0 for a failed one)."""
    if any(s.agent is None or s.agent.reward is None for s in samples):
        raise ValueError("--agent_func_path: its AgentExecutor returned no reward (a single-turn executor); give its "
                         "step results 'rewards' or score the replies with --reward_fn / --remote_rm_url instead")
    return torch.tensor([s.agent.reward for s in samples], dtype=torch.float32)


def agent_extra_logs(samples: list[Sample]) -> dict[str, float]:
    """``reward_extra/<name>``: the mean over the step's trajectories (every rank holds them all) of each
    environment's last ``extra_logs``, over the trajectories that logged the name."""
    names = sorted({k for s in samples for k in s.agent.extra_logs})
    out = {}
    for k in names:
        vals = [s.agent.extra_logs[k] for s in samples if k in s.agent.extra_logs]
        out[f"reward_extra/{k}"] = sum(vals) / len(vals)
    return out


def extra_log_metrics(extra_logs: dict, n: int, mesh) -> dict[str, float]:
    """``reward_extra/<name>``: a reward's extra logs (one number, or one per query) as their mean over the global
    batch. Every rank's reward answers with the same names (one reward function): one all-gather."""
    if not extra_logs:
        return {}
    names = sorted(extra_logs)
    local = torch.zeros(1, 2 * len(names), dtype=torch.float64)
    for i, k in enumerate(names):
        v = torch.as_tensor(extra_logs[k].tolist() if isinstance(extra_logs[k], torch.Tensor) else extra_logs[k],
                            dtype=torch.float64).flatten()
        w = float(n) if v.numel() == 1 else float(v.numel())  # a batch mean counts for the batch's queries
        local[0, 2 * i], local[0, 2 * i + 1] = v.mean() * w, w
    tot = dp_all_gather(local.to(mesh.device), mesh).sum(dim=0).cpu()
    return {f"reward_extra/{k}": (tot[2 * i] / tot[2 * i + 1]).item() for i, k in enumerate(names)}
