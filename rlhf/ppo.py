"""PPO (and GRPO / REINFORCE++) in one SPMD job: actor, critic, reference and reward model plus vLLM on every rank.

One step, each phase timed by name:

    weight_sync   actor shards -> vLLM (only after the actor changed)     rlhf.rollout.weight_sync
    rollout       vLLM generates n_samples_per_prompt per prompt          rlhf.rollout.vllm_engine
    actor_fwd / ref_fwd / reward_fwd / critic_fwd                         rlhf.experience.forward_role
    advantages    KL penalty, GAE / GRPO / REINFORCE++ over the global batch   rlhf.algo.advantages
    critic_update, actor_update   --max_epochs passes, --train_batch_size per optimizer step
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("rlhf")


def load_prompts(args: argparse.Namespace, tokenizer) -> tuple[list, dict]:
    """Prompts from --prompt_data; the data layer's errors are re-worded with the PPO flag names."""
    from rlhf.data import DataConfig, build_prompt_dataset

    try:
        cfg = DataConfig.from_args(args, dataset=args.prompt_data, dataset_probs=args.prompt_data_probs,
                                   output_key=None, max_len=args.prompt_max_len + args.generate_max_len)
        prompts, stats = build_prompt_dataset(cfg, tokenizer)
    except ValueError as e:
        raise ValueError(str(e).replace("--dataset_probs", "--prompt_data_probs")
                         .replace("--dataset", "--prompt_data")) from None
    if not prompts:
        raise ValueError(f"--prompt_data {args.prompt_data}: no prompts")
    if stats.num_truncated:
        log.warning("%d prompts longer than --prompt_max_len %d were truncated (kept their last tokens)",
                    stats.num_truncated, args.prompt_max_len)
    return prompts, {"num_prompts": len(prompts), "num_truncated": stats.num_truncated}


def load_gold_fn(spec: str):
    """``--gold_reward_fn module:function``; the function maps (prompt texts, reply texts) to floats."""
    from rlhf.rewards import load_reward_fn

    return load_reward_fn(spec, "--gold_reward_fn")


def vllm_model_dir(args: argparse.Namespace, source: dict, mesh) -> str:
    """vLLM needs an HF config + tokenizer folder; it starts from dummy weights and gets the actor's by sync."""
    if source["kind"] == "hf":
        return args.pretrain
    from rlhf.models.hf_io import copy_tokenizer_files

    out = os.path.join(args.save_path, "vllm_config")
    if mesh.is_rank0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(source["hf_config"], f, indent=2)
        copy_tokenizer_files(args.pretrain, out)
    dist.barrier()
    return out


class PPOTrainer:
    def __init__(self, args: argparse.Namespace, sizes: dict, prompts: list, tokenizer):
        from rlhf.algo.advantages import get_estimator
        from rlhf.algo.kl import make_kl_controller
        from rlhf.checkpoint import Checkpointer
        from rlhf.data import BatchConfig, DistributedBatchSampler, pad_token_id
        from rlhf.distributed import DistEnv, initialize_mesh
        from rlhf.engine import ModelEngine, OptimConfig
        from rlhf.offload import MemoryScheduler, OffloadManager, cpu_offload_moves
        from rlhf.ppo_args import log_compat
        from rlhf.rollout import RolloutConfig, build_rollout
        from rlhf.rollout.types import mb_to_bytes
        from rlhf.rollout.vllm_engine import vllm_available
        from rlhf.rollout.weight_sync import WeightSync

        from rlhf.rewards import load_reward_fn

        self.args, self.sizes, self.prompts, self.tokenizer = args, sizes, prompts, tokenizer
        self.gold_fn = load_gold_fn(args.gold_reward_fn) if args.gold_reward_fn else None
        self.pad_id = pad_token_id(tokenizer)
        self.estimator = get_estimator(args.advantage_estimator)
        self.kl_in_loss = args.advantage_estimator in ("grpo", "dr_grpo")
        steps_per_episode = len(prompts) // args.rollout_batch_size
        self.total_steps = steps_per_episode * args.num_episodes
        updates = sizes["samples"] // args.train_batch_size * args.max_epochs * self.total_steps
        torch.manual_seed(args.seed)
        self.mesh = mesh = initialize_mesh(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                           DistEnv.from_environ(), seed=args.seed)
        from rlhf.distributed.health import check_config_consistency; check_config_consistency(args)  # noqa: E702
        log_compat(args)
        rcfg = RolloutConfig(tensor_parallel_size=args.vllm_tensor_parallel_size, num_engines=args.vllm_num_engines,
                             gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                             kv_cache_bytes=mb_to_bytes(args.vllm_kv_cache_mb),
                             max_model_len=args.prompt_max_len + args.generate_max_len,
                             dtype="bfloat16" if args.bf16 else "float32", seed=args.seed,
                             enforce_eager=args.vllm_enforce_eager, backend=args.rollout_backend,
                             weight_sync_bucket_mb=args.weight_sync_bucket_mb)
        # vLLM starts before any model is on the device (on CUDA its start-up claims --vllm_gpu_memory_utilization
        # of the memory that is free then), and goes to sleep at once; the first weight sync wakes it.
        self.rollout = None
        if rcfg.backend == "vllm" or (rcfg.backend == "auto" and vllm_available()):
            self.rollout = build_rollout(mesh, None, rcfg, vllm_model_dir(args, sizes["sources"]["--pretrain"], mesh))
            self.rollout.sleep()

        def optim(lr: float) -> OptimConfig:
            return OptimConfig(lr=lr, weight_decay=args.l2, adam_betas=tuple(args.adam_betas), clip_grad=args.max_norm,
                               max_skipped_steps=args.max_skipped_steps,
                               warmup_ratio=args.lr_warmup_ratio, scheduler=args.lr_scheduler, total_steps=updates,
                               use_distributed_optimizer=args.zero_stage >= 1)

        common = dict(bf16=args.bf16, recompute=args.gradient_checkpointing)
        impl = dict(transformer_impl=args.transformer_impl)
        from rlhf.models.lora import lora_config_from_args

        self.actor = ModelEngine(mesh, args.pretrain, optim=optim(args.actor_learning_rate), value_head=False,
                                 name="actor", lora=lora_config_from_args(args), **common, **impl)
        self.ref = (ModelEngine(mesh, args.pretrain, value_head=False, name="ref", bf16=args.bf16, **impl)
                    if args.init_kl_coef > 0 else None)
        # Reward models are roles "reward", "reward1", ... (frozen, offloaded like the single one); rlhf/rewards.py.
        self.rewards = sizes["rewards"]
        self.rms = {f"reward{i or ''}": ModelEngine(mesh, path, value_head=True, name=f"reward{i or ''}",
                                                   bf16=args.bf16, **impl) for i, path in enumerate(self.rewards.paths)}
        self.reward_fn = load_reward_fn(args.reward_fn) if args.reward_fn else None
        self.reward_norms = self.rewards.norms(sizes["sources"]["--reward_pretrain"])
        self.critic = (ModelEngine(mesh, args.critic_pretrain or self.rewards.paths[0], value_head=True,
                                   name="critic", optim=optim(args.critic_learning_rate),
                                   lora=lora_config_from_args(args, "critic_lora_rank"), **common, **impl)
                       if self.estimator.needs_critic else None)
        self.roles = {k: v for k, v in (("actor", self.actor), ("critic", self.critic), ("ref", self.ref),
                                        *self.rms.items()) if v is not None}
        self.managers = {k: OffloadManager(v, name=k) for k, v in self.roles.items()}
        moves = mesh.device.type != "cpu" or cpu_offload_moves()
        self.memory = MemoryScheduler(self.managers, colocate_all=args.colocate_all,
                                      ref_reward_offload=args.ref_reward_offload, adam_offload=args.adam_offload,
                                      move=moves)
        if not moves and mesh.is_rank0 and (args.colocate_all or args.ref_reward_offload or args.adam_offload):
            log.info("offload: the device is the CPU, so parameters, gradients and optimizer states stay where "
                     "they are (a host copy cannot lower peak memory); RLHF_OFFLOAD_ON_CPU=1 copies anyway")
        if self.rollout is None:  # the megatron fallback generates with the actor itself
            self.rollout = build_rollout(mesh, self.actor, rcfg, "")
        torch.manual_seed(args.seed)
        self.weight_sync = WeightSync(self.actor, mesh, rcfg.weight_sync_bucket_mb << 20)
        self.kl_ctl = make_kl_controller(args.init_kl_coef, args.kl_target, args.kl_horizon)
        self.sampler = DistributedBatchSampler(len(prompts), BatchConfig(args.rollout_batch_size,
                                                                         args.rollout_batch_size), seed=args.seed)
        self.ckpt = Checkpointer(mesh, args.ckpt_path or os.path.join(args.save_path, "checkpoints"),
                                 args.max_ckpt_num)
        self.trainable = {k: v for k, v in (("actor", self.actor), ("critic", self.critic)) if v is not None}
        for role, eng in self.trainable.items():
            eng.ckpt_prefix = f"{role}."
        self.step = 0
        if args.load_checkpoint:
            self._all_on_device()
            state = self.ckpt.load(self.trainable)
            self.step = state["step"]
            self.sampler.load_state_dict(state["extra"]["sampler"])
            self.kl_ctl.load_state_dict(state["extra"]["kl_ctl"])
        self.actor_changed = True  # vLLM starts from dummy weights

    def _all_on_device(self) -> None:
        for m in self.managers.values():
            m.onload()
        self.memory.current = None

    # ----------------------------------------------------------------------------------------------- one step
    def train_step(self, timer) -> dict[str, float]:
        from rlhf.distributed.device import to_device
        from rlhf.experience import Experience, collate_sequences, forward_role, prepare_microbatches, select_rows

        args, mesh = self.args, self.mesh
        prompt_idx = self.sampler.next_step()[0]
        prompts = [self.prompts[i].prompt_ids.tolist() for i in prompt_idx]
        metrics: dict[str, float] = {}
        if self.actor_changed:
            self.memory.enter("weight_sync")
            with timer.phase("weight_sync"):
                self.rollout.wake_up(["weights"])
                metrics.update(self.weight_sync.sync(self.rollout))
            self.actor_changed = False
        # The fallback generator runs the actor itself, so its parameters stay resident (weight_sync's residency).
        self.memory.enter("weight_sync" if self.rollout.reads_actor_params else "rollout")
        with timer.phase("rollout"):
            self.rollout.wake_up(["kv_cache"])
            samples = self.rollout.generate(prompts, n=args.n_samples_per_prompt, temperature=args.temperature,
                                            top_p=args.top_p, max_tokens=args.generate_max_len,
                                            seed=args.seed * 100_003 + self.step, ignore_eos=args.ignore_eos)
            self.rollout.sleep()
        n_gen = sum(len(s.response_ids) for s in samples)
        if self.gold_fn is not None:  # measured only, never optimized
            texts = [self.prompts[prompt_idx[s.prompt_index]].prompt for s in samples]
            replies = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
            gold = self.gold_fn(texts, replies)
            metrics["gold_reward"] = sum(gold) / len(gold)
        timer.metrics["tokens_per_s/rollout"] = n_gen / timer.metrics["time/rollout"]

        # This DP rank's contiguous share of the prompt-major samples.
        per = len(samples) // mesh.dp
        local = samples[mesh.dp_rank * per:(mesh.dp_rank + 1) * per]
        T = args.generate_max_len
        batch = to_device(collate_sequences(local, self.pad_id, T), mesh.device)  # the experience lives on the device
        trim = mesh.pp == 1
        mrb = args.micro_rollout_batch_size
        mbs = prepare_microbatches([select_rows(batch, range(i, i + mrb), trim) for i in range(0, per, mrb)],
                                   packing=args.packing_samples, pp=mesh.pp, pad_id=self.pad_id)
        tokens = float(sum(len(s.prompt_ids) + len(s.response_ids) for s in samples))
        self.memory.enter("make_experience")
        out = {}
        roles = ("ref", *self.rms, "critic") if args.use_rollout_logprobs else ("actor", "ref", *self.rms, "critic")
        for role in roles:
            eng = self.roles.get(role)
            if eng is not None:
                with timer.phase(f"{role}_fwd", tokens=tokens):
                    out[role] = forward_role(eng, "reward" if role in self.rms else role, mbs,
                                             args.temperature if role in ("actor", "ref") else 1.0)
        vllm_lp = torch.zeros(per, T)
        for b, s in enumerate(local):
            vllm_lp[b, : len(s.logprobs)] = torch.tensor(s.logprobs)
        rewards, raw_rewards = self._combine_rewards(out, local, prompt_idx, metrics)
        vllm_lp = vllm_lp.to(batch["action_mask"].device)
        exp = Experience(local, batch, vllm_lp if args.use_rollout_logprobs else out["actor"], vllm_lp, rewards,
                         ref_logprobs=out.get("ref"),
                         values=out.get("critic"))
        with timer.phase("advantages"):
            metrics.update(self._advantages(exp, raw_rewards))
        # Global means (the same on every rank): a non-finite reward or advantage skips this step's updates.
        bad = ", ".join(f"{k}={metrics[k]}" for k in ("reward", "advantages_abs") if not math.isfinite(metrics[k]))
        if bad:
            for eng in self.trainable.values():
                eng.skip(bad)  # counted per trainable role; --max_skipped_steps in a row stop the job
            metrics["skipped_steps"] = float(self.actor.skipped_steps)
        else:
            metrics.update(self._update(exp, timer, trim, tokens))
            self.kl_ctl.update(metrics["kl"], len(samples))
        metrics["kl_coef"] = self.kl_ctl.value
        metrics["response_length"] = n_gen / len(samples)
        metrics["finished_frac"] = sum(s.finished for s in samples) / len(samples)
        metrics["weight_version"] = float(self.weight_sync.version)
        metrics.update(self.memory.pop_stats())  # what each phase moved (and freed on CUDA)
        return metrics

    def _combine_rewards(self, out: dict, local: list, prompt_idx: list, metrics: dict) -> tuple:
        """This rank's (optimized, raw) rewards (B,): the weighted sum of the reward models' scores and the rule
        function's (rlhf/rewards.py). Logs each source's global mean as reward/rm<i>, reward/fn."""
        from rlhf.experience import dp_all_gather
        from rlhf.rewards import call_reward_fn, combine_rewards, source_metrics

        scores = {name: out[role] for name, role in zip(self.rewards.rm_names, self.rms)}
        if self.reward_fn is not None:
            texts = [self.prompts[prompt_idx[s.prompt_index]].prompt for s in local]
            replies = self.tokenizer.batch_decode([s.response_ids for s in local], skip_special_tokens=True)
            scores["fn"] = call_reward_fn(self.reward_fn, texts, replies).to(self.mesh.device)
        rewards, raw = combine_rewards(scores, self.rewards.source_weights, self.reward_norms)
        if len(scores) > 1 or self.reward_norms:
            metrics.update(source_metrics({k: dp_all_gather(v, self.mesh) for k, v in scores.items()}))
        if self.reward_norms:
            metrics["reward_normalized"] = dp_all_gather(rewards, self.mesh).mean().item()
        return rewards, raw

    def _advantages(self, exp, raw_rewards: torch.Tensor) -> dict[str, float]:
        from rlhf.algo.ppo_losses import kl_estimate, masked_mean, masked_whiten
        from rlhf.experience import dp_all_gather

        args, mesh = self.args, self.mesh
        mask = exp.batch["action_mask"]
        if exp.ref_logprobs is not None:
            exp.kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, args.kl_estimator, mask)
        else:
            exp.kl = torch.zeros_like(exp.old_logprobs)
        g = lambda t: dp_all_gather(t, mesh) if t is not None else None  # noqa: E731
        gmask, gkl = g(mask), g(exp.kl)
        res = self.estimator(rewards=g(exp.rewards), kl=gkl, values=g(exp.values), action_mask=gmask,
                             kl_coef=0.0 if self.kl_in_loss else self.kl_ctl.value, gamma=args.gamma,
                             lambd=args.lambd, n_samples_per_prompt=args.n_samples_per_prompt)
        adv = res["advantages"]
        if args.advantage_estimator == "gae":
            adv = masked_whiten(adv, gmask)
        B = mask.shape[0]
        lo = mesh.dp_rank * B
        exp.advantages, exp.returns = adv[lo:lo + B], res["returns"][lo:lo + B]
        graw = g(raw_rewards)
        out = {"reward": graw.mean().item(), "reward_std": graw.std().item() if graw.numel() > 1 else 0.0,
               "kl": masked_mean(gkl, gmask).item(), "advantages_abs": masked_mean(adv.abs(), gmask).item()}
        if not args.use_rollout_logprobs:  # generator vs trainer log-probs of the same weights
            gdiff = (g(exp.vllm_logprobs) - g(exp.old_logprobs)).abs()
            out["rollout_logprob_drift"] = masked_mean(gdiff, gmask).item()
            out["rollout_logprob_drift_max"] = gdiff.masked_fill(~gmask, 0).max().item()
        return out

    def _update(self, exp, timer, trim: bool, tokens: float) -> dict[str, float]:
        args, mesh = self.args, self.mesh
        B = exp.old_logprobs.shape[0]
        per_update = args.train_batch_size // mesh.dp // args.micro_train_batch_size
        m = args.micro_train_batch_size
        plans = []
        for epoch in range(args.max_epochs):
            gen = torch.Generator().manual_seed(args.seed * 7919 + self.step * 31 + epoch)
            perm = torch.randperm(B, generator=gen).tolist()
            micro = [perm[i:i + m] for i in range(0, B, m)]
            plans += [micro[i:i + per_update] for i in range(0, len(micro), per_update)]
        out: dict[str, float] = {}
        sums: dict[str, float] = {}
        if self.critic is not None:
            self.memory.enter("critic_update")
            with timer.phase("critic_update", tokens=tokens * args.max_epochs):
                for plan in plans:
                    r = self.critic.train_step(self._microbatches(exp, plan, trim), self._critic_loss,
                                               ("value_loss", "vf_clip_frac", "values"), output="logits")
                    for k, v in r.items():
                        sums[f"critic/{k}"] = sums.get(f"critic/{k}", 0.0) + v
        self.memory.enter("actor_update")
        keys = ("policy_loss", "clip_frac", "approx_kl", "ratio", "entropy") + (("kl_loss",) if self.kl_in_loss
                                                                                 else ())
        with timer.phase("actor_update", tokens=tokens * args.max_epochs):
            for plan in plans:
                r = self.actor.train_step(self._microbatches(exp, plan, trim), self._actor_loss, keys,
                                          output="hidden")
                for k, v in r.items():
                    sums[f"actor/{k}"] = sums.get(f"actor/{k}", 0.0) + v
        self.actor_changed = True
        for k, v in sums.items():
            out[k] = v / len(plans)
        out["entropy"] = out.pop("actor/entropy")
        return out

    def _actor_loss(self, batch: dict, hidden: torch.Tensor):
        from rlhf.algo.ppo_losses import kl_loss, masked_sum, policy_loss
        from rlhf.experience import actor_logprobs

        args = self.args
        lp, ent = actor_logprobs(self.actor, batch, hidden, args.temperature, entropy=True)
        mask = batch["action_mask"]
        tis = None
        if args.use_tis:
            tis = torch.exp(batch["old_logprobs"] - batch["vllm_logprobs"]).clamp(max=args.tis_cap)
        loss, n, metrics = policy_loss(lp, batch["old_logprobs"], batch["advantages"], mask, eps_clip=args.eps_clip,
                                       rollout_is_weights=tis)
        metrics["entropy"] = [masked_sum(ent.detach(), mask), n]
        if self.kl_in_loss and "ref_logprobs" in batch:
            kl_sum, _, km = kl_loss(lp, batch["ref_logprobs"], mask, estimator=args.kl_estimator)
            loss = loss + self.kl_ctl.value * kl_sum
            metrics.update(km)
        elif self.kl_in_loss:
            metrics["kl_loss"] = [torch.zeros(()), n]
        return loss, n, metrics

    def _critic_loss(self, batch: dict, values: torch.Tensor):
        from rlhf.algo.ppo_losses import value_loss

        from rlhf.experience import response_values

        v = response_values(values, batch)  # (B, T)
        return value_loss(v, batch["values"], batch["returns"], batch["action_mask"], value_clip=self.args.value_clip)

    def _microbatches(self, exp, plan: list[list[int]], trim: bool) -> list[dict]:
        from rlhf.experience import prepare_microbatches

        return prepare_microbatches([exp.select(ix, trim) for ix in plan], packing=self.args.packing_samples,
                                    pp=self.mesh.pp, pad_id=self.pad_id)

    # ------------------------------------------------------------------------------------------------- loop
    def save(self) -> None:
        self._all_on_device()
        self.ckpt.save(self.step, self.trainable, {"sampler": self.sampler.state_dict(),
                                                   "kl_ctl": self.kl_ctl.state_dict()})

    def fit(self) -> dict[str, Any]:
        from rlhf.metrics import MetricsLogger, PhaseTimer

        args, mesh = self.args, self.mesh
        if mesh.is_rank0:
            log.info("ppo: %d prompts, %d steps of %d prompts x %d samples; %s; dp=%d tp=%d pp=%d; generation: %s",
                     len(self.prompts), self.total_steps, args.rollout_batch_size, args.n_samples_per_prompt,
                     args.advantage_estimator, mesh.dp, mesh.tp, mesh.pp, self.rollout.name)
        logger = MetricsLogger(mesh.is_rank0, self.total_steps, args.tensorboard, prefix="ppo",
                               jsonl_path=os.path.join(args.save_path, "metrics.jsonl"))
        timer = PhaseTimer()
        history: list[dict[str, float]] = []
        start, t_end = self.step, time.perf_counter()
        while self.step < self.total_steps:
            if 0 <= args.stop_after_steps <= self.step - start:
                log.info("stopping after %d steps (--stop_after_steps)", args.stop_after_steps)
                logger.close()
                return {"history": history, "stopped": True}
            timer.reset()
            m = self.train_step(timer)
            self.step += 1
            m.update(timer.metrics)
            m["time/step"] = sum(v for k, v in timer.metrics.items() if k.startswith("time/"))
            if self.step % args.logging_steps == 0 or self.step == self.total_steps:
                logger.log(self.step, m)
            now = time.perf_counter()  # wall time between step ends, logging included (bench/ppo_vs_trl.py)
            m["time/step_wall"], t_end = now - t_end, now
            history.append(m)
            if (args.save_steps > 0 and self.step % args.save_steps == 0) or self.step == self.total_steps:
                self.save()
        logger.close()
        from rlhf.trainer import export_hf

        self._all_on_device()
        export_hf(args, self.actor, mesh, {"ppo_steps": self.step})
        if mesh.is_rank0:
            with open(os.path.join(args.save_path, "ppo_result.json"), "w") as f:
                json.dump({"history": history}, f, indent=1)
        return {"history": history, "stopped": False}

    def close(self) -> None:
        """megatron groups first, then vLLM (whose deletion takes the default group with it), then the rest."""
        from megatron.core import parallel_state as ps

        from rlhf.distributed.mesh import _destroy_megatron_groups

        if ps.model_parallel_is_initialized():
            _destroy_megatron_groups()
        self.rollout.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from rlhf.distributed import DistEnv
    from rlhf.metrics import setup_logging
    from rlhf.ppo_args import validate

    env = DistEnv.from_environ()
    setup_logging(env.rank)
    sizes = validate(args, env.world_size)  # flags, files and model configs: before any model is loaded
    if args.gold_reward_fn:
        load_gold_fn(args.gold_reward_fn)
    if sizes["engines"] and args.rollout_backend != "megatron":
        from rlhf.rollout.vllm_engine import check_vllm_fit, vllm_available

        if vllm_available():
            from rlhf.rollout.types import RolloutConfig

            check_vllm_fit(sizes["sources"]["--pretrain"]["spec"],
                           RolloutConfig(tensor_parallel_size=args.vllm_tensor_parallel_size,
                                         num_engines=args.vllm_num_engines), env.world_size)
        elif args.rollout_backend == "vllm":
            raise ValueError("--rollout_backend vllm: vllm is not installed")
    tokenizer = AutoTokenizer.from_pretrained(args.pretrain)
    prompts, stats = load_prompts(args, tokenizer)
    if len(prompts) < args.rollout_batch_size:
        raise ValueError(f"--rollout_batch_size {args.rollout_batch_size} is larger than the number of prompts "
                         f"({len(prompts)} in --prompt_data)")
    trainer = PPOTrainer(args, sizes, prompts, tokenizer)
    try:
        result = trainer.fit()
        result["data"] = stats
    finally:
        trainer.close()
    return result


def main(argv=None) -> int:
    from rlhf.config import cli_main
    from rlhf.ppo_args import add_args

    return cli_main(add_args, run, argv)
