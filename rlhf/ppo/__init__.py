"""PPO (and GRPO / REINFORCE++) in one SPMD job: actor, critic, reference and reward model plus vLLM on every rank.

One step (``PPOTrainer.train_step``), each stage timed by phase name (``rlhf.ppo.stages``):

    sync                weight_sync     actor shards -> vLLM (only after the actor changed)   rlhf.rollout.weight_sync
    generate            rollout         --n_samples_per_prompt samples per prompt             rlhf.rollout
    make_experience     actor_fwd, ref_fwd, reward_fwd, critic_fwd; the rewards           rlhf.ppo.experience
    compute_advantages  advantages      KL, GAE / GRPO / REINFORCE++ over the global batch    rlhf.algo.advantages
    update              critic_update, actor_update   --max_epochs passes, --train_batch_size per optimizer step

Layout: ``args`` (flags, checks), ``roles`` (the models and the memory schedule), ``experience`` (records),
``stages``, ``prompts`` (--prompt_data), ``trainer`` (the loop). The losses are in ``rlhf.algo.ppo_losses``.
"""
from rlhf.ppo.prompts import load_prompts
from rlhf.ppo.trainer import PPOTrainer, main, run

__all__ = ["PPOTrainer", "load_prompts", "main", "run"]
