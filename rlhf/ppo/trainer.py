"""The PPO loop: build every role once, then one step at a time (``PPOTrainer.train_step``, on one screen),
checkpoints, the final export. The stages live in ``rlhf.ppo.stages``, the roles in ``rlhf.ppo.roles``."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from typing import Any

import torch

from rlhf.ppo.partial_step import build_partial, drift_by_age, generate_partial_step, mask_offpolicy
from rlhf.ppo.prompts import load_prompts
from rlhf.ppo.stages import (RewardSources, Rollout, compute_advantages, generate_filtered, make_experience,
                             sync_weights, update)

log = logging.getLogger("rlhf")


def load_gold_fn(spec: str):
    """``--gold_reward_fn module:function``; the function maps (prompt texts, reply texts) to floats."""
    from rlhf.rewards.sources import load_reward_fn

    return load_reward_fn(spec, "--gold_reward_fn")


class PPOTrainer:
    def __init__(self, setup, prompts: list, tokenizer, ptx_samples: list | None = None):
        """``setup.job``: the configuration (``PPOJobConfig``); each component below takes its part. ``self.args``:
        the job's flat view (``Job.namespace``) for what takes every flag by name (checks, logged config, export)."""
        from rlhf.algo.advantages import get_estimator
        from rlhf.algo.kl import make_kl_controller
        from rlhf.runtime.checkpoint import Checkpointer
        from rlhf.data import BatchConfig, DistributedBatchSampler, pad_token_id
        from rlhf.distributed.health import check_config_consistency
        from rlhf.ppo.args import log_compat
        from rlhf.ppo.roles import build_roles

        self.job = job = setup.job
        self.prompts, self.tokenizer = prompts, tokenizer
        self.gold_fn = load_gold_fn(job.logging.gold_reward_fn) if job.logging.gold_reward_fn else None
        self.pad_id = pad_token_id(tokenizer)
        self.estimator = get_estimator(job.algo.advantage_estimator)
        batch, par, seed = job.batch, job.parallel, job.engine.seed
        self.total_steps = len(prompts) // batch.rollout_batch_size * batch.num_episodes
        updates = setup.samples // batch.train_batch_size * batch.max_epochs * self.total_steps
        torch.manual_seed(seed)
        self.mesh = mesh = _mesh(par, setup, seed)
        log_compat(job.engine, mesh.dp, mesh.device.type == "cuda")  # resolves --zero_stage
        self.args = args = job.namespace()
        check_config_consistency(args)
        if setup.vllm_tp_reason and job.rollout.rollout_backend != "megatron" and mesh.is_rank0:
            log.info("--vllm_tensor_parallel_size not given: %d (%d engine(s)); %s",
                     job.rollout.vllm_tensor_parallel_size, setup.engines, setup.vllm_tp_reason)
        self.roles = build_roles(job, setup, mesh, self.estimator, updates)
        if job.agent.agent_func_path:
            from rlhf.agents.rollout import AgentRollout

            self.roles.agent = AgentRollout(job.agent, tokenizer, mesh, bool(self.roles.actor.spec.num_experts))
        self.rewards = RewardSources(setup.rewards, setup.sources["--reward_pretrain"], prompts, tokenizer, mesh,
                                     judge=self.roles.judge)
        self.kl_ctl = make_kl_controller(job.algo.init_kl_coef, job.algo.kl_target, job.algo.kl_horizon)
        self.sampler = DistributedBatchSampler(len(prompts), BatchConfig(batch.rollout_batch_size,
                                                                         batch.rollout_batch_size), seed=seed)
        self.ckpt = Checkpointer(mesh, job.checkpoint.dir, job.checkpoint.max_ckpt_num)
        for role, eng in self.roles.trainable.items():
            eng.ckpt_prefix = f"{role}."
        self.ema = None
        if job.ema.enable_ema:
            from rlhf.ppo.ema import ActorEMA

            self.ema = ActorEMA(job.ema, job.models.pretrain, job.engine, self.roles.actor, mesh)
        self.ptx = None
        if ptx_samples:
            from rlhf.ppo.ptx import PtxData

            self.ptx = PtxData(job.ptx, job.batch, seed, ptx_samples, self.pad_id, mesh, self.roles.actor)
        self.evaluator = None
        if job.eval.dataset:  # the rule reward and the agent's (reward models score training replies alone)
            from rlhf.ppo.evaluation import Evaluator
            from rlhf.rewards.sources import RewardConfig

            r = job.rewards
            rule = RewardConfig(reward_fn=r.reward_fn, reward_fn_weight=r.reward_fn_weight,
                                remote_rm_url=r.remote_rm_url, remote_rm_weight=r.remote_rm_weight,
                                remote_rm_timeout=r.remote_rm_timeout, agent=r.agent)
            self.evaluator = Evaluator(job.eval, job, tokenizer, rule, mesh)
        self.partial = build_partial(job)
        from rlhf.ppo.dump import ExperienceDump

        self.dump = ExperienceDump(job.logging.dump_experience, mesh) if job.logging.dump_experience else None
        self.step = 0
        state = None
        if job.checkpoint.load_checkpoint:
            self.roles.all_on_device()
            state = self.ckpt.load_if_any(self.checkpointed())
        if state is not None:
            self.step = state["step"]
            self.sampler.load_state_dict(state["extra"]["sampler"])
            self.kl_ctl.load_state_dict(state["extra"]["kl_ctl"])
            if self.ptx is not None:
                self.ptx.sampler.load_state_dict(state["extra"]["ptx_sampler"])
            if self.partial is not None:
                self.partial.load_state_dict(state["extra"]["partial"])
        self.actor_changed = True  # vLLM starts from dummy weights

    # ----------------------------------------------------------------------------------------------- one step
    def train_step(self, timer) -> dict[str, float]:
        """One PPO step: sync -> generate -> make_experience -> compute_advantages -> update."""
        job, roles, mesh = self.job, self.roles, self.mesh
        metrics: dict[str, float] = {}
        if self.actor_changed or roles.rollout.needs_sync:  # a sleeping engine discarded its weights
            metrics.update(sync_weights(roles, timer))
            self.actor_changed = False
        if self.partial is not None:  # --partial_rollout (rlhf.ppo.partial_step)
            rollout, filtered = generate_partial_step(roles, job, self.partial, self.prompts, self.sampler, self.step,
                                                      mesh, timer, self.rewards, self.saves_after(self.step + 1))
        else:
            rollout, filtered = generate_filtered(roles, job, self.prompts, self.sampler, self.rewards, self.step,
                                                  mesh, timer)
        metrics.update(filtered)
        metrics.update(self.gold_metrics(rollout))
        generated = filtered.get("dynamic_filtering/generated_tokens",
                                 filtered.get("partial/generated_tokens", rollout.generated_tokens))
        timer.metrics["tokens_per_s/rollout"] = generated / timer.metrics["time/rollout"]
        exp, raw_rewards, reward_metrics = make_experience(roles, job, rollout, self.rewards, mesh, self.pad_id,
                                                           timer, step=self.step)
        metrics.update(reward_metrics)
        with timer.phase("advantages"):
            metrics.update(compute_advantages(exp, raw_rewards, self.estimator, self.kl_ctl.value, job, mesh))
            metrics.update(self.carried_tokens(exp))
        self.dump is None or self.dump.experience(exp, raw_rewards, self.kl_ctl.value, self.step + 1)
        # Global means (the same on every rank): a non-finite reward or advantage skips this step's updates.
        bad = ", ".join(f"{k}={metrics[k]}" for k in ("reward", "advantages_abs") if not math.isfinite(metrics[k]))
        if bad:
            for eng in roles.trainable.values():
                eng.skip(f"non-finite {bad}")  # counted per trainable role; --max_skipped_steps in a row stop the job
            metrics["skipped_steps"] = float(roles.actor.skipped_steps)
        else:
            metrics.update(update(roles, exp, job, self.estimator, self.kl_ctl.value, self.step, mesh,
                                  self.pad_id, rollout.tokens, timer,
                                  after_actor_step=self.ema.update if self.ema else None, ptx=self.ptx,
                                  dump=self.dump))
            self.actor_changed = True
            self.kl_ctl.update(metrics["kl"], len(rollout.samples))
        metrics.update(self.step_stats(rollout))
        return metrics

    def carried_tokens(self, exp) -> dict[str, float]:
        """Partial rollouts: the log-prob drift of fresh against carried tokens, and slime's masking of carried
        tokens (``--partial_rollout_correction mask_offpolicy``)."""
        job, metrics = self.job, {}
        if self.partial is not None and job.algo.old_logprobs_source == "forward":  # fresh tokens vs carried
            metrics.update(drift_by_age(exp, self.step, self.mesh))
        if self.partial is not None and job.partial.correction_used.startswith("slime's"):
            metrics.update(mask_offpolicy(exp, self.step, self.mesh))
        return metrics

    def gold_metrics(self, rollout: Rollout) -> dict[str, float]:
        """--gold_reward_fn over every sample: measured only, never optimized."""
        if self.gold_fn is None:
            return {}
        gold = self.gold_fn(*self.rewards.texts(rollout, rollout.samples))
        return {"gold_reward": sum(gold) / len(gold)}

    def step_stats(self, rollout: Rollout) -> dict[str, float]:
        n = len(rollout.samples)
        return {"kl_coef": self.kl_ctl.value, "response_length": rollout.generated_tokens / n,
                "finished_frac": sum(s.finished for s in rollout.samples) / n,
                "weight_version": float(self.roles.weight_sync.version),
                **self.roles.memory.pop_stats()}  # what each phase moved (and freed on CUDA)

    # ------------------------------------------------------------------------------------------------- loop
    def checkpointed(self) -> dict:
        """What a checkpoint holds: the trained roles and, with --enable_ema, the average."""
        return {**self.roles.trainable, **({"ema": self.ema.engine} if self.ema else {})}

    def save(self) -> None:
        self.roles.all_on_device()
        if self.ema is not None and self.ema.offload is not None:
            self.ema.offload.onload(params=True, grads=False, optimizer=False)
        extra = {"sampler": self.sampler.state_dict(), "kl_ctl": self.kl_ctl.state_dict()}
        if self.ptx is not None:
            extra["ptx_sampler"] = self.ptx.sampler.state_dict()
        if self.partial is not None:  # the carried samples: a resumed job continues them exactly
            extra["partial"] = self.partial.state_dict()
        self.ckpt.save(self.step, self.checkpointed(), extra)

    def saves_after(self, step: int) -> bool:
        """A checkpoint is written once ``step`` steps are done (--save_steps, and the last step)."""
        save_steps = self.job.checkpoint.save_steps
        return (save_steps > 0 and step % save_steps == 0) or step == self.total_steps

    def fit(self) -> dict[str, Any]:
        from rlhf.distributed.watchdog import set_phase, set_step
        from rlhf.observability.metrics import MetricsLogger, PhaseTimer

        args, job, mesh = self.args, self.job, self.mesh
        if mesh.is_rank0:
            log.info("ppo: %d prompts, %d steps of %d prompts x %d samples; %s; dp=%d tp=%d pp=%d; generation: %s",
                     len(self.prompts), self.total_steps, job.batch.rollout_batch_size, job.batch.n_samples_per_prompt,
                     job.algo.advantage_estimator, mesh.dp, mesh.tp, mesh.pp, self.roles.rollout.name)
        if mesh.is_rank0:
            from rlhf.algo.advantages import ADVANTAGE_ESTIMATORS
            from rlhf.algo.ppo_losses import ActorLossConfig

            est = self.estimator  # the function this run calls, named by its registry entry (not by the flag)
            log.info("advantage estimator: %s (%s%s)", next(k for k, v in ADVANTAGE_ESTIMATORS.items() if v is est),
                     "a critic's values" if est.needs_critic else "no critic",
                     f", groups of {job.batch.n_samples_per_prompt} samples per prompt" if est.needs_groups else "")
            c = ActorLossConfig.from_parts(job.algo, job.correction, self.estimator)
            log.info("actor loss: %s, ratio clipped to [%g, %g]%s, %s%s%s", c.policy_loss_type, 1 - c.eps_clip_low,
                     1 + c.eps_clip_high, f", dual-clip {c.dual_clip:g}" if c.dual_clip else "", c.loss_agg_mode,
                     f", entropy_coef {c.entropy_coef:g}" if c.entropy_coef else "",
                     f", KL ({c.kl_estimator}) in the loss" if c.kl_in_loss else ", KL in the reward")
            log.info("old log-probs: %s (%s)", {"update": "the update's own forward, detached; no actor forward in "
                                                           "make_experience", "forward": "the actor's forward in "
                                                "make_experience", "rollout": "the generator's"}[
                job.algo.old_logprobs_source], job.algo.old_logprobs_reason)
            if job.partial.enabled:
                log.info("%s (--max_staleness %d): tokens of earlier policies are corrected by %s",
                         "partial rollouts" if job.partial.partial_rollout else "one-step-off whole batches",
                         job.partial.max_staleness, job.partial.correction_used)
        logger = MetricsLogger(mesh.is_rank0, self.total_steps, job.logging.tensorboard, prefix="ppo",
                               jsonl_path=os.path.join(job.checkpoint.save_path, "metrics.jsonl"), args=args)
        timer = PhaseTimer()
        history: list[dict[str, float]] = []
        start, t_end = self.step, time.perf_counter()
        if self.step == 0:
            self.evaluate(logger)
        set_phase("train")  # between the timed phases
        while self.step < self.total_steps:
            if 0 <= job.checkpoint.stop_after_steps <= self.step - start:
                log.info("stopping after %d steps (--stop_after_steps)", job.checkpoint.stop_after_steps)
                logger.close()
                return {"history": history, "stopped": True}
            timer.reset()
            set_step(self.step + 1)
            m = self.train_step(timer)
            self.dump is None or self.dump.save()  # --dump_experience: the step's records
            self.step += 1
            m.update(timer.metrics)
            m["time/step"] = sum(v for k, v in timer.metrics.items() if k.startswith("time/"))
            if self.step % job.logging.logging_steps == 0 or self.step == self.total_steps:
                logger.log(self.step, m)
            now = time.perf_counter()  # wall time between step ends, logging included (bench/ppo_vs_trl.py)
            m["time/step_wall"], t_end = now - t_end, now
            history.append(m)
            self.evaluate(logger)  # before the save: a resumed run does not repeat it
            if self.saves_after(self.step):
                self.save()
        logger.close()
        self.export(history)
        return {"history": history, "stopped": False}

    def evaluate(self, logger) -> None:
        """--eval_dataset: held-out reward and pass@k when due (step 0, every --eval_steps, the last step)."""
        from rlhf.observability.metrics import PhaseTimer

        if self.evaluator is None or not self.evaluator.cfg.due(self.step, self.total_steps):
            return
        timer = PhaseTimer()
        if self.actor_changed or self.roles.rollout.needs_sync:  # the generator serves the current actor
            sync_weights(self.roles, timer)
            self.actor_changed = False
        logger.log(self.step, self.evaluator.run(self.roles, self.step, timer), prefix="eval", progress=False)

    def export(self, history: list[dict[str, float]]) -> None:
        from rlhf.runtime.checkpoint import export_hf

        self.roles.all_on_device()
        export_hf(self.args, self.roles.actor, self.mesh, {"ppo_steps": self.step})
        if self.ema is not None:
            self.ema.export(self.args, self.mesh, self.step)
        if self.mesh.is_rank0:
            with open(os.path.join(self.job.checkpoint.save_path, "ppo_result.json"), "w") as f:
                json.dump({"history": history}, f, indent=1)

    def close(self) -> None:
        from rlhf.rollout import shutdown

        if self.roles.agent is not None:  # sessions a stopped job leaves parked, and their endpoint
            self.roles.agent.close()
        shutdown(self.mesh, self.roles.rollout)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rlhf.distributed import DistEnv
    from rlhf.observability.metrics import setup_logging
    from rlhf.models.source import load_tokenizer
    from rlhf.ppo.args import validate

    env = DistEnv.from_environ()
    setup_logging(env.rank)
    setup = validate(args, env.world_size)  # the job, built once; flags, files and model configs: before any model
    job = setup.job
    if job.logging.gold_reward_fn:
        load_gold_fn(job.logging.gold_reward_fn)
    _check_generator(job, setup, env.world_size)
    tokenizer = load_tokenizer(job.models.pretrain)
    prompts, stats = load_prompts(job.namespace(), tokenizer)  # the flat view: prompt_max_len as validate left it
    if len(prompts) < job.batch.rollout_batch_size:
        raise ValueError(f"--rollout_batch_size {job.batch.rollout_batch_size} is larger than the number of prompts "
                         f"({len(prompts)} in --prompt_data)")
    ptx_samples = None
    if job.ptx.pretrain_data:
        from rlhf.ppo.ptx import load_ptx_samples

        ptx_samples = load_ptx_samples(job, tokenizer)
    trainer = PPOTrainer(setup, prompts, tokenizer, ptx_samples)
    try:
        result = trainer.fit()
        result["data"] = stats
    except BaseException:
        from rlhf.distributed.watchdog import watchdog_running

        # A launched rank that fails reports and leaves at once (rlhf.distributed.failures.fail_job). Tearing vLLM
        # and the process groups down first closed its peers' connections before its report: a peer then ended
        # the job as "lost a peer" and the launcher's SIGTERM reached this rank before it said what failed.
        if not watchdog_running():
            trainer.close()
        raise
    trainer.close()
    return result


def _mesh(par, setup, seed: int):
    """The job's groups; the experts' TP is 1 where a model's experts carry biases (``expert_tensor_parallel``)."""
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.models.spec_families import expert_tensor_parallel

    etp = expert_tensor_parallel([s.get("spec") for s in setup.sources.values() if isinstance(s, dict)], par.tp)
    return initialize_mesh(par.tp, par.pp, DistEnv.from_environ(), seed=seed, etp=etp,
                           ep=par.expert_model_parallel_size, timeout_s=par.dist_timeout_s, cp=par.cp)


def _check_generator(job, setup, world_size: int) -> None:
    """vLLM is installed when asked for, and the actor fits its tensor-parallel layout."""
    r = job.rollout
    if not setup.engines or r.rollout_backend == "megatron":
        return
    from rlhf.rollout.vllm_generator import check_vllm_fit, vllm_available

    if vllm_available():
        from rlhf.rollout.types import RolloutConfig

        check_vllm_fit(setup.sources["--pretrain"]["spec"],
                       RolloutConfig(tensor_parallel_size=r.vllm_tensor_parallel_size,
                                     num_engines=r.vllm_num_engines), world_size)
    elif r.rollout_backend == "vllm":
        raise ValueError("--rollout_backend vllm: vllm is not installed")


def main(argv=None) -> int:
    from rlhf.config.job import cli_main
    from rlhf.ppo.args import add_args

    return cli_main(add_args, run, argv)
