"""PPO's models on every rank: actor, critic, reference, reward models, the generator and the memory schedule
that time-shares them (``rlhf.runtime.offload``). Built in the order that matters on CUDA: vLLM first (its start-up
claims a fraction of the memory free then), then the megatron engines."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("rlhf")


@dataclass
class PPORoles:
    actor: Any
    """the trained policy (``ModelRole``)"""
    critic: Any | None
    """the trained value model, when the estimator needs one"""
    ref: Any | None
    """the frozen reference policy, when --init_kl_coef > 0"""
    reward_models: dict[str, Any]
    """frozen reward models by role name: "reward", "reward1", ... (in --reward_pretrain order)"""
    rollout: Any
    """the generator: vLLM in these processes, or the megatron fallback that samples with the actor"""
    weight_sync: Any
    """actor shards -> the generator (``rlhf.rollout.weight_sync.WeightSync``)"""
    memory: Any
    """``MemoryScheduler``: what is resident in each phase"""
    managers: dict[str, Any]
    """one ``OffloadManager`` per role"""
    agent: Any = None
    """--agent_func_path: the multi-turn rollout (``rlhf.agents.rollout.AgentRollout``) driving ``rollout``"""
    teacher: Any = None
    """the frozen teacher of on-policy distillation (--teacher_pretrain; ``rlhf.ppo.distill``)"""
    judge: Any = None
    """the LLM judge (``rlhf.rewards.judge``): --judge_pretrain's over its frozen engine (``judge.role``), resident in
    make_experience, where it generates its answers; or --judge_url's client"""

    @property
    def engines(self) -> dict[str, Any]:
        """Every megatron engine by role name."""
        return {k: v for k, v in (("actor", self.actor), ("critic", self.critic), ("ref", self.ref),
                                  ("teacher", self.teacher), ("judge", getattr(self.judge, "role", None)),
                                  *self.reward_models.items()) if v is not None}

    @property
    def trainable(self) -> dict[str, Any]:
        return {k: v for k, v in (("actor", self.actor), ("critic", self.critic)) if v is not None}

    def all_on_device(self) -> None:
        """Every role's parameters and optimizer states on the device (before a save, a load or the export)."""
        for m in self.managers.values():
            m.onload()
        self.memory.current = None


def rollout_config(job, spec=None, world_size: int | None = None, on_cuda: bool = False):
    """The generator's settings from the job's parts (``job``: the ``PPOJobConfig``; its rollout, engine, batch,
    generation and agent parts are read); with the actor's ``spec`` and the world size, the CPU KV cache is sized
    to the rollout batch (unless ``--vllm_kv_cache_mb`` is given). Its dtype: ``rollout.types.generator_dtype``."""
    from rlhf.agents.flags import generator_max_model_len
    from rlhf.rollout import RolloutConfig
    from rlhf.rollout.types import generator_dtype, kv_cache_bytes_for_batch, mb_to_bytes

    r = job.rollout
    dtype, why = generator_dtype(job.engine.bf16, on_cuda)
    max_len = generator_max_model_len(job.generation, job.agent)
    cpu_kv = None
    if spec is not None and world_size and r.vllm_kv_cache_mb is None:
        engines = max(world_size // r.vllm_tensor_parallel_size, 1)
        seqs = -(-job.batch.samples // engines)
        cpu_kv = kv_cache_bytes_for_batch(spec, r.vllm_tensor_parallel_size, seqs, max_len,
                                          2 if dtype == "bfloat16" else 4)
    return RolloutConfig(tensor_parallel_size=r.vllm_tensor_parallel_size, num_engines=r.vllm_num_engines,
                         gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                         kv_cache_bytes=mb_to_bytes(r.vllm_kv_cache_mb), cpu_kv_cache_bytes=cpu_kv,
                         max_model_len=max_len, dtype=dtype, dtype_reason=why, seed=job.engine.seed,
                         enforce_eager=r.vllm_enforce_eager, backend=r.rollout_backend,
                         weight_sync_bucket_mb=r.weight_sync_bucket_mb,
                         enable_prefix_caching=r.vllm_enable_prefix_caching,
                         return_routed_experts=job.router_replay.moe_router_replay == "rollout",
                         lora_adapter_rank=job.lora.lora_rank if job.lora.lora_sync == "adapter" else 0,
                         lora_adapter_keep=_adapter_versions_kept(job.partial),
                         vision=_vision_rollout(job, spec))


def _adapter_versions_kept(partial) -> int:
    """--lora_sync adapter: the adapter versions a rank keeps, those a trained token may come from."""
    if partial.partial_rollout:
        return partial.max_staleness + 1
    return 2 if partial.async_one_step_off else 1


def _vision_rollout(job, spec) -> dict | None:
    """The generator's image settings for a vision-language actor (the trainer's own image processor's)."""
    if spec is None or spec.vision is None:
        return None
    from rlhf.data.vision import vision_data

    vd = vision_data(spec, job.models.pretrain, job.vision)
    lo, hi = vd.pixels
    proc = vd.processor
    return {"image_token_id": vd.image_token_id, "max_images": vd.max_images, "min_pixels": lo, "max_pixels": hi,
            "image_mean": list(proc.image_mean), "image_std": list(proc.image_std),
            "rescale_factor": float(proc.rescale_factor)}


def build_roles(job, setup, mesh, estimator, total_updates: int) -> PPORoles:
    """Every role of the job (``PPOJobConfig``) on this rank, then the memory schedule; ``total_updates`` sizes the
    LR schedules."""
    from rlhf.runtime.role import ModelRole
    from rlhf.rollout import build_rollout
    from rlhf.rollout.model_dir import vllm_model_dir
    from rlhf.rollout.vllm_generator import vllm_available
    from rlhf.rollout.weight_sync import WeightSync

    rcfg = rollout_config(job, setup.sources["--pretrain"]["spec"], mesh.world_size, mesh.device.type == "cuda")
    if rcfg.cpu_kv_cache_bytes and mesh.device.type != "cuda" and mesh.is_rank0:
        log.info("vLLM KV cache: %d MB per rank, sized to the rollout batch (--vllm_kv_cache_mb overrides)",
                 rcfg.cpu_kv_cache_bytes >> 20)
    # vLLM starts before any model is on the device (on CUDA its start-up claims --vllm_gpu_memory_utilization
    # of the memory that is free then), and goes to sleep at once; the first weight sync wakes it.
    rollout = None
    if rcfg.backend == "vllm" or (rcfg.backend == "auto" and vllm_available()):
        model_dir = vllm_model_dir(job.models.pretrain, setup.sources["--pretrain"], mesh,
                                   out_dir=os.path.join(job.checkpoint.save_path, "vllm_config"))
        rollout = build_rollout(mesh, None, rcfg, model_dir)
        rollout.sleep()
    eng, optim, lora, pretrain = job.engine, job.optim, job.lora, job.models.pretrain
    sharded = eng.zero_stage >= 1  # resolved by log_compat before the roles are built
    common = dict(bf16=eng.bf16, recompute=eng.gradient_checkpointing)
    impl = dict(transformer_impl=eng.transformer_impl)
    # MoE actors always carry megatron's RouterReplay (the routing-flip metric records with it). The reference
    # routes itself, replay or not: the KL is taken against the reference as it is, not forced onto the student's
    # experts (verl's compute_ref_log_prob runs with routing replay disabled, verl/workers/engine_workers.py at
    # 1dda039b; slime's reference forward falls through, slime/backends/megatron_utils/actor.py at 624b824a)
    actor = ModelRole(mesh, pretrain, optim=optim.actor_config(total_updates, sharded), value_head=False,
                        name="actor", lora=lora.config(eng.seed), routing_replay=True,
                        freeze_vision=job.vision.freeze_vision_tower, **common, **impl)
    ref = (ModelRole(mesh, pretrain, value_head=False, name="ref", bf16=eng.bf16, **impl)
           if job.algo.init_kl_coef > 0 else None)
    reward_models = {f"reward{i or ''}": ModelRole(mesh, path, value_head=True, name=f"reward{i or ''}",
                                                     bf16=eng.bf16, **impl)
                     for i, path in enumerate(setup.rewards.paths)}
    critic = (ModelRole(mesh, job.models.critic_pretrain or setup.rewards.paths[0], value_head=True, name="critic",
                          optim=optim.critic_config(total_updates, sharded), lora=lora.critic_config(eng.seed),
                          **common, **impl)
              if estimator.needs_critic else None)
    teacher = (ModelRole(mesh, job.distill.teacher_pretrain, value_head=False, name="teacher", bf16=eng.bf16,
                           **impl) if job.distill.teacher_pretrain else None)
    if teacher is not None:  # its log-probs over the ids the student can sample (rlhf.ppo.distill.check_teacher)
        teacher.score_vocab = (setup.sources.get("--teacher_pretrain") or {}).get("score_vocab")
    from rlhf.rewards.judge import make_judge

    judge = make_judge(job.judge, ModelRole(mesh, job.judge.judge_pretrain, value_head=False, name="judge",
                                            bf16=eng.bf16, **impl) if job.judge.judge_pretrain else None, mesh)
    roles = PPORoles(actor=actor, critic=critic, ref=ref, reward_models=reward_models, rollout=rollout,
                     weight_sync=None, memory=None, managers={}, teacher=teacher, judge=judge)
    _add_memory_schedule(roles, job.offload, mesh, job.distill.teacher_offload)
    if roles.rollout is None:  # the megatron fallback generates with the actor itself
        roles.rollout = build_rollout(mesh, actor, rcfg, "")
    torch.manual_seed(eng.seed)
    roles.weight_sync = WeightSync(actor, mesh, rcfg.weight_sync_bucket_mb << 20)
    return roles


def _add_memory_schedule(roles: PPORoles, args, mesh, teacher_offload: bool = False) -> None:
    """``args``: the job's ``OffloadPart``; ``teacher_offload``: --teacher_offload."""
    from rlhf.runtime.offload import MemoryScheduler, OffloadManager, cpu_offload_moves

    roles.managers = {k: OffloadManager(v, name=k) for k, v in roles.engines.items()}
    moves = mesh.device.type != "cpu" or cpu_offload_moves()
    roles.memory = MemoryScheduler(roles.managers, colocate_all=args.colocate_all,
                                   ref_reward_offload=args.ref_reward_offload, adam_offload=args.adam_offload,
                                   teacher_offload=teacher_offload, move=moves)
    if not moves and mesh.is_rank0 and (args.colocate_all or args.ref_reward_offload or args.adam_offload):
        log.info("offload: the device is the CPU, so parameters and optimizer states stay where they are (a host "
                 "copy cannot lower peak memory; RLHF_OFFLOAD_ON_CPU=1 copies anyway); gradients are still freed "
                 "outside their own update")
