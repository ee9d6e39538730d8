"""The parts of PPO's configuration that only PPO has (``rlhf.config.part.Part``): the models, the prompts, batching,
generation, the optimizers of the actor and the critic, offload, the generator's engines, logging. The other
parts of ``PPOJobConfig`` live next to the code that reads them (``rlhf.config.parts`` for those shared with the
supervised workflows, ``algo_args.AlgoPart``, ``ptx.PtxPart``, ``ema.EmaPart``, ``evaluation.EvalConfig``,
``rlhf.rewards.sources.RewardConfig``, ``rlhf.agents.flags.AgentPart``, ``rlhf.algo.rollout_correction``)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from rlhf.models.lora import LoraPart
from rlhf.rollout.types import RolloutConfig
from rlhf.config.part import Part, config_default, flag
from rlhf.config.parts import BatchPart, GeneratorPart, LoggingPart, ModelPart, OptimPart, SamplingPart


@dataclass
class PPOModels(ModelPart):
    """The actor's source (``--pretrain``, also the reference's) and the critic's."""

    critic_pretrain: str | None = flag(help="critic init (default: the first --reward_pretrain)", default=None)
    """(--critic_pretrain) default: the first --reward_pretrain"""

    @classmethod
    def add_args(cls, g, **_) -> None:
        super().add_args(g, help="actor (and reference) model: HF folder or megatron checkpoint")


@dataclass
class PPOLora(LoraPart):
    """``LoraPart`` (the actor's adapters; --lora_export: the final actor export) and the critic's rank."""

    critic_lora_rank: int = flag(type=int, help="LoRA rank of the critic (0: full fine-tuning); shares "
                                                "--lora_alpha/--target_modules/--lora_dropout; its score head always "
                                                "trains", default=0)
    """(--critic_lora_rank) LoRA rank of the critic (0: full fine-tuning); the other LoRA flags are shared"""
    lora_sync: str = flag(choices=["merged", "adapter"], help="what vLLM gets after each update of a LoRA actor: "
                                                          "merged weights, or the adapters alone (vLLM's LoRA path; "
                                                          "the base is synced once)", default="merged")
    """(--lora_sync) merged | adapter (``rlhf.rollout.lora_sync``)"""

    def check(self) -> None:
        super().check()
        self.critic_config(42)
        if self.lora_sync == "adapter" and not self.lora_rank:
            raise ValueError("--lora_sync adapter needs a LoRA actor (--lora_rank > 0)")

    def critic_config(self, seed: int):
        return self.config(seed, self.critic_lora_rank, "--critic_lora_rank")


@dataclass
class PromptDataPart(Part):
    """The training prompts (with ``TextPart``: how records become text)."""

    prompt_data: str = flag(required=True, help="comma-separated jsonl/json/parquet files or HF disk folders",
                            default=None)
    """(--prompt_data) comma-separated jsonl/json/parquet files or HF disk folders"""
    prompt_data_probs: str | None = flag(help="mixing probabilities, one per --prompt_data entry", default=None)
    """(--prompt_data_probs) mixing probabilities"""
    input_key: str = flag(help="the prompt field", default="input")
    """(--input_key) the prompt field"""
    label_key: str | None = flag(help="optional field passed through with each prompt", default=None)
    """(--label_key) optional field passed through with each prompt"""


    def check(self) -> None:
        from rlhf.config.job import check_paths_exist

        check_paths_exist("--prompt_data", self.prompt_data)


@dataclass
class PPOBatch(BatchPart):
    """``BatchPart`` (the updates) and the rollout's sizes."""

    micro_rollout_batch_size: int = flag(type=int, help="samples per experience forward per rank", default=8)
    """(--micro_rollout_batch_size) samples per experience forward per rank"""
    use_dynamic_batch: bool = flag("--use_dynamic_batch", "--train.dynamic_batch_enable", action="store_true",
                                   help="form the forward and update micro-batches by token count "
                                        "(--max_tokens_per_gpu, packed) instead of by --micro_*_batch_size",
                                   default=False)
    """(--use_dynamic_batch) micro-batches by token count"""
    max_tokens_per_gpu: int = flag("--max_tokens_per_gpu", "--train.max_tokens_per_gpu", type=int,
                                   help="--use_dynamic_batch: prompt + response tokens per micro-batch at most",
                                   default=16192)
    """(--max_tokens_per_gpu) --use_dynamic_batch: tokens per micro-batch at most"""
    rollout_batch_size: int = flag(type=int, help="prompts per rollout (global)", default=512)
    """(--rollout_batch_size) prompts per rollout (global)"""
    n_samples_per_prompt: int = flag(type=int, default=1)
    """(--n_samples_per_prompt)"""
    num_episodes: int = flag(type=int, help="passes over the prompt data", default=1)
    """(--num_episodes) passes over the prompt data"""

    @property
    def samples(self) -> int:
        """samples per step, global"""
        return self.rollout_batch_size * self.n_samples_per_prompt

    def check(self) -> None:
        for name in ("micro_train_batch_size", "train_batch_size", "micro_rollout_batch_size", "rollout_batch_size",
                     "n_samples_per_prompt", "max_epochs", "num_episodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class GenerationPart(SamplingPart):
    """How each reply is sampled (``validate`` lowers --prompt_max_len under --max_len)."""

    ignore_eos: bool = flag(action="store_true", help="generate exactly --generate_max_len tokens per response "
                                                      "(benchmarks)", default=False)
    """(--ignore_eos) exactly --generate_max_len tokens per response (benchmarks)"""

    def check(self) -> None:
        for name in ("generate_max_len", "prompt_max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0 for sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p must be in (0, 1], got {self.top_p}")


@dataclass
class PPOOptim(OptimPart):
    """The actor's and the critic's optimizers: the shared flags, the learning rates and the critic's own
    replacements (``rlhf.ppo.critic_optim``)."""

    actor_learning_rate: float = flag(type=float, default=1e-6)
    """(--actor_learning_rate)"""
    critic_learning_rate: float = flag(type=float, default=9e-6)
    """(--critic_learning_rate)"""
    critic_adam_betas: tuple | None = flag(type=float, nargs=2, default=None, metavar=("BETA1", "BETA2"),
                                           help="the critic's Adam betas (default: --adam_betas)")
    """(--critic_adam_betas) default: --adam_betas"""
    critic_l2: float | None = flag(type=float, default=None, help="the critic's weight decay (default: --l2)")
    """(--critic_l2) default: --l2"""
    critic_lr_scheduler: str | None = flag(default=None, help="the critic's schedule (default: --lr_scheduler)")
    """(--critic_lr_scheduler) default: --lr_scheduler"""
    critic_lr_warmup_ratio: float | None = flag(type=float, default=None,
                                                help="the critic's warmup ratio (default: --lr_warmup_ratio)")
    """(--critic_lr_warmup_ratio) default: --lr_warmup_ratio"""
    critic_max_norm: float | None = flag(type=float, default=None,
                                         help="the critic's gradient clipping (default: --max_norm)")
    """(--critic_max_norm) default: --max_norm"""

    def check(self) -> None:
        from rlhf.ppo.critic_optim import check_critic_optim

        check_critic_optim(self)

    def actor_config(self, total_steps: int, distributed: bool):
        return self.config(self.actor_learning_rate, total_steps, distributed)

    def critic_config(self, total_steps: int, distributed: bool):
        """The shared flags, each replaced by its ``--critic_*`` flag where given."""
        from dataclasses import replace

        from rlhf.ppo.critic_optim import CRITIC_OPTIM_FLAGS

        own = {common: getattr(self, f) for f, common in CRITIC_OPTIM_FLAGS.items() if getattr(self, f) is not None}
        return replace(self, **own).config(self.critic_learning_rate, total_steps, distributed)


@dataclass
class OffloadPart(Part):
    """What lives on the host between uses (``rlhf.runtime.offload.MemoryScheduler``)."""

    colocate_all: bool = flag("--colocate_all", "--colocate_all_models", action=argparse.BooleanOptionalAction,
                              help="all four roles and vLLM share every rank (the only layout of this trainer)",
                              default=True)
    """(--colocate_all, --colocate_all_models) every role and vLLM on every rank (the only layout)"""
    ref_reward_offload: bool = flag(action="store_true", help="keep ref/reward weights on host between uses",
                                    default=False)
    """(--ref_reward_offload) ref/reward weights on host between uses"""
    adam_offload: bool = flag(action="store_true", help="keep optimizer states on host outside updates", default=False)
    """(--adam_offload) optimizer states on host outside updates"""


    def check(self) -> None:
        if not self.colocate_all:
            raise ValueError("--no-colocate_all: this trainer runs every role in one SPMD job on every rank; "
                             "separate placement (Ray-style) is not supported")


@dataclass
class RolloutPart(GeneratorPart):
    """The generator's engines and the weight sync (``rlhf.ppo.roles.rollout_config`` makes the
    ``RolloutConfig`` of them)."""

    vllm_num_engines: int | None = flag(type=int, help="must equal world size / vLLM TP",
                                        default=config_default(RolloutConfig, "num_engines"))
    """(--vllm_num_engines) must equal world size / vLLM TP"""
    vllm_tensor_parallel_size: int | None = flag(type=int, help="TP of each vLLM engine; default: chosen per model "
                                                                "and device, and logged (CPU: the largest the heads "
                                                                "allow within a node; CUDA: the smallest whose "
                                                                "weights leave room for the KV cache)", default=None)
    """(--vllm_tensor_parallel_size) None until ``validate`` chooses it"""
    vllm_gpu_memory_utilization: float = flag(type=float, default=0.95)
    """(--vllm_gpu_memory_utilization)"""
    vllm_enforce_eager: bool = flag(action=argparse.BooleanOptionalAction,
                                    default=config_default(RolloutConfig, "enforce_eager"))
    """(--vllm_enforce_eager)"""
    vllm_enable_prefix_caching: bool = flag(action="store_true", help="vLLM's automatic prefix caching: the replies "
                                                                      "of one prompt, and prompts sharing a start, "
                                                                      "reuse its KV blocks; the cache is reset after "
                                                                      "every weight sync",
                                            default=config_default(RolloutConfig, "enable_prefix_caching"))
    """(--vllm_enable_prefix_caching)"""
    weight_sync_bucket_mb: int = flag(type=int, default=config_default(RolloutConfig, "weight_sync_bucket_mb"))
    """(--weight_sync_bucket_mb)"""

    def check(self) -> None:
        if self.vllm_tensor_parallel_size is not None and self.vllm_tensor_parallel_size < 1:
            raise ValueError(f"--vllm_tensor_parallel_size must be >= 1, got {self.vllm_tensor_parallel_size}")


@dataclass
class PPOLogging(LoggingPart):
    """``LoggingPart`` and the rule that measures (never optimizes) the replies."""

    gold_reward_fn: str | None = flag(help="module:function scoring (prompts, replies) with a rule; logged as "
                                           "gold_reward, never optimized (e.g. rlhf.demo.sort_task:gold_rewards)",
                                      default=None)
    """(--gold_reward_fn) module:function scoring (prompts, replies); logged as gold_reward"""
    dump_experience: str | None = flag(metavar="DIR", help="write each step's experience (log-probs, rewards, KL, "
                                                           "advantages, ...) and each training micro-batch's loss "
                                                           "inputs and terms to DIR/step<N>_rank<R>.pt, to check a "
                                                           "run against another implementation's formulas",
                                       default=None)
    """(--dump_experience) a folder: each step's experience and each training micro-batch's loss inputs and terms,
    per rank (``rlhf.ppo.dump``)"""

    def check(self) -> None:
        if self.logging_steps < 1:
            raise ValueError(f"--logging_steps must be >= 1, got {self.logging_steps}")
