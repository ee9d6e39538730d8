"""Generation for PPO inside the training processes: vLLM (``external_launcher``) or a megatron fallback,
and the bucketed, versioned weight sync from the actor's megatron shards to the engine.

Nothing here is imported by ``import rlhf``; vLLM is imported only when an engine is built.
"""
from rlhf.rollout.types import RolloutConfig, Sample

__all__ = ["RolloutConfig", "Sample", "build_rollout"]


def build_rollout(mesh, actor, cfg: RolloutConfig, hf_dir: str):
    """vLLM when importable; otherwise the megatron fallback, announced loudly."""
    from rlhf.rollout.vllm_engine import vllm_available

    if cfg.backend == "vllm" or (cfg.backend == "auto" and vllm_available()):
        from rlhf.rollout.vllm_engine import VLLMRollout

        return VLLMRollout(mesh, actor, cfg, hf_dir)
    from rlhf.rollout.megatron_engine import MegatronRollout

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
