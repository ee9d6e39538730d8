"""Generation for PPO inside the training processes: vLLM (``external_launcher``) or a megatron fallback,
and the bucketed, versioned weight sync from the actor's megatron shards to the engine.

Nothing here is imported by ``import rlhf``; vLLM is imported only when an engine is built.
"""
from rlhf.rollout.types import RolloutConfig, Sample

__all__ = ["RolloutConfig", "Sample", "build_rollout"]


def build_rollout(mesh, actor, cfg: RolloutConfig, hf_dir: str):
    """vLLM when importable; otherwise the megatron fallback, announced loudly."""
    from rlhf.rollout.vllm_generator import vllm_available

    if cfg.backend == "vllm" or (cfg.backend == "auto" and vllm_available()):
        from rlhf.rollout.vllm_generator import VLLMRollout

        return VLLMRollout(mesh, actor, cfg, hf_dir)
    from rlhf.rollout.megatron_generator import MegatronRollout

    return MegatronRollout(mesh, actor, cfg)


def shutdown(mesh, rollout) -> None:
    """The end of a job that built a generator: megatron's groups first, then the generator (deleting a vLLM
    engine destroys the default process group with it), then the default group if it is still there."""
    import torch.distributed as dist

    if mesh is not None:
        mesh.destroy_groups()
    if rollout is not None:
        rollout.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def build_policy_generator(mesh, pretrain: str, source: dict, cfg: RolloutConfig, *, use_vllm: bool, out_dir: str,
                           bf16: bool = False, transformer_impl: str | None = None):
    """A generator for a fixed policy (rejection sampling, batch inference): vLLM with the policy's weights synced
    from a frozen megatron engine that is freed afterwards (``out_dir``/vllm_config holds the folder vLLM starts
    from when ``pretrain`` is a megatron checkpoint), or the megatron fallback that samples with that engine."""
    import gc
    import os

    from rlhf.runtime.role import ModelRole

    def policy():
        return ModelRole(mesh, pretrain, value_head=False, name="policy", bf16=bf16,
                           transformer_impl=transformer_impl)

    if not use_vllm:
        return build_rollout(mesh, policy(), cfg, "")
    from rlhf.rollout.model_dir import vllm_model_dir
    from rlhf.rollout.weight_sync import WeightSync

    rollout = build_rollout(mesh, None, cfg, vllm_model_dir(pretrain, source, mesh,
                                                            out_dir=os.path.join(out_dir, "vllm_config")))
    engine = policy()
    WeightSync(engine, mesh).sync(rollout)
    del engine  # vLLM holds its own copy now
    gc.collect()
    return rollout


def plan_policy_generator(args, world_size: int) -> tuple[dict, RolloutConfig, bool]:
    """Checks for a fixed-policy generator before any model loads (``--pretrain``, ``--tp``,
    ``--max_new_tokens``, ``--prompt_max_len``, ``--temperature``, ``--top_p``, ``--vllm_kv_cache_mb``,
    ``--rollout_backend``, ``--bf16``, ``--seed``): the policy's ``describe_source``, the generator's config and
    whether it is vLLM."""
    from rlhf.models.source import describe_source
    from rlhf.models.spec import check_parallel_fit
    from rlhf.distributed.device import select_device
    from rlhf.rollout.types import generator_dtype, mb_to_bytes
    from rlhf.rollout.vllm_generator import check_vllm_fit, vllm_available

    if args.temperature <= 0:
        raise ValueError(f"--temperature must be > 0 for sampling, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top_p must be in (0, 1], got {args.top_p}")
    tp = args.tensor_model_parallel_size
    try:
        src = describe_source(args.pretrain)
    except ValueError as e:
        raise ValueError(f"--pretrain {args.pretrain}: {e}") from None
    check_parallel_fit(src["spec"], tp, 1, src["padded_vocab"])
    dtype, why = generator_dtype(args.bf16, on_cuda=select_device(0).type == "cuda")  # as PPO's generator
    rcfg = RolloutConfig(tensor_parallel_size=tp, kv_cache_bytes=mb_to_bytes(args.vllm_kv_cache_mb),
                         max_model_len=args.prompt_max_len + args.max_new_tokens, dtype=dtype, dtype_reason=why,
                         seed=args.seed, backend=args.rollout_backend)
    use_vllm = rcfg.backend == "vllm" or (rcfg.backend == "auto" and vllm_available())
    if use_vllm:
        if not vllm_available():
            raise ValueError("--rollout_backend vllm: vllm is not installed")
        check_vllm_fit(src["spec"], rcfg, world_size)
    return src, rcfg, use_vllm
