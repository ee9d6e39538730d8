"""The parts of a job's configuration that several entry points share (``rlhf.config.part.Part``): the parallel layout,
how the megatron models run, the model source, the supervised data, batching, the optimizer, checkpoints and
logging. Each declares its flags (``add_args``), is built once from the parsed flags at the entry point
(``from_args``) and checks its own values (``check``); checks that need several parts or the model's config stay in
the workflow's ``validate``. ``rlhf.config.job`` composes them into the supervised entry points' flags."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from rlhf.config.part import Part, config_default, config_field, flag
from rlhf.data.config import DataConfig
from rlhf.rollout.types import RolloutConfig
from rlhf.runtime.role import OptimConfig


@dataclass
class ParallelPart(Part):
    """The model-parallel layout megatron builds (data parallelism is what is left of the world size)."""

    tensor_model_parallel_size: int = flag("--tensor_model_parallel_size", "--tp", type=int, default=1)
    """(--tensor_model_parallel_size, --tp)"""
    pipeline_model_parallel_size: int = flag("--pipeline_model_parallel_size", "--pp", type=int, default=1)
    """(--pipeline_model_parallel_size, --pp)"""
    context_parallel_size: int = flag("--context_parallel_size", "--cp", "--ring_attn_size", type=int,
                                      help="split each sequence over this many ranks (megatron's load-balanced "
                                           "layout), carved out of data parallelism; OpenRLHF's --ring_attn_size "
                                           "(docs/context_parallel.md)", default=1)
    """(--context_parallel_size, --cp, --ring_attn_size) each sequence split over this many ranks"""
    expert_model_parallel_size: int = flag("--expert_model_parallel_size", "--ep", type=int,
                                           help="MoE models: spread each layer's experts over this many "
                                                "data-parallel ranks", default=1)
    """(--expert_model_parallel_size, --ep) MoE: each layer's experts spread over this many DP ranks"""
    dist_timeout_s: float | None = flag(type=float, help="a rank that waits this long for a peer (a collective, or a "
                                                         "silent heartbeat) ends the job with one line naming the "
                                                         "rank and phase; default 300 on CUDA, 180 on CPU "
                                                         "(docs/reliability.md)", default=None)
    """(--dist_timeout_s) a rank waiting this long for a peer ends the job; None: the device's default"""

    @classmethod
    def add_args(cls, g, *, pp: bool = True, tp_help: str | None = None, cp: bool = True) -> None:
        skip = (() if pp else ("pipeline_model_parallel_size",)) + (() if cp else ("context_parallel_size",))
        super().add_args(g, skip=skip, tensor_model_parallel_size={"help": tp_help})

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size


@dataclass
class EnginePart(Part):
    """How the megatron models run: precision, seed, layers, memory, the optimizer's sharding."""

    bf16: bool = flag(action="store_true", default=False)
    """(--bf16)"""
    seed: int = flag(type=int, default=42)
    """(--seed)"""
    gradient_checkpointing: bool = flag(action="store_true", default=False)
    """(--gradient_checkpointing) recompute activations in the backward"""
    transformer_impl: str | None = flag(choices=["local", "transformer_engine"],
                                        help="megatron layer implementation (megatron's flag); default: "
                                             "transformer_engine where it imports on CUDA, else local. Checkpoints "
                                             "are the same under either", default=None)
    """(--transformer_impl) local | transformer_engine; None: TE where it imports on CUDA"""
    zero_stage: int | None = flag(type=int, help=">=1 maps to megatron's distributed optimizer (ZeRO-1: optimizer "
                                                 "states sharded over DP); default 1 on CUDA when the data-parallel "
                                                 "size is > 1, else 0", default=None)
    """(--zero_stage) >= 1: megatron's distributed optimizer; None until ``rlhf.config.job.resolve_zero_stage``"""
    flash_attn: bool = flag(action="store_true", help="compatibility: flash/TE attention is used when installed on a "
                                                      "GPU", default=False)
    """(--flash_attn) compatibility only"""
    packing_samples: bool = flag(action="store_true", help="run each micro-batch as one padding-free row (THD "
                                                           "packing, varlen attention)", default=False)
    """(--packing_samples) padding-free THD micro-batches"""
    use_liger_kernel: bool | None = flag(action=argparse.BooleanOptionalAction,
                                         help="fused kernels in megatron's local layers: SFT's LM head fused with "
                                              "its loss (Liger-Kernel's fused linear cross entropy), Triton SwiGLU "
                                              "and RoPE (Liger's RMSNorm: RLHF_FUSED_PARTS); default: on for CUDA "
                                              "without Transformer Engine where liger-kernel imports. On CPU the "
                                              "torch twins run", default=None)
    """(--use_liger_kernel) fused SwiGLU, RoPE and SFT head+loss (rlhf.models.fused); None: on for CUDA without
    Transformer Engine where liger-kernel imports"""

    def check(self) -> None:
        from rlhf.models import fused

        fused.request(self.use_liger_kernel)
        if self.zero_stage not in (None, 0, 1, 2, 3):
            raise ValueError(f"--zero_stage must be 0..3, got {self.zero_stage}")
        if self.transformer_impl == "transformer_engine":  # what this machine allows, before any file is read
            from rlhf.models.gpt import resolve_transformer_impl

            resolve_transformer_impl(self.transformer_impl)  # the checks against LoRA and CP are the job's


@dataclass
class ModelPart(Part):
    """The trained model's source."""

    pretrain: str = flag(required=True, help="HF folder or converted megatron checkpoint", default=None)
    """(--pretrain) HF folder or converted megatron checkpoint"""

    @classmethod
    def add_args(cls, g, *, help: str | None = None) -> None:
        super().add_args(g, **({"pretrain": {"help": help}} if help else {}))


@dataclass
class CheckpointPart(Part):
    """Where results go and the resumable checkpoints."""

    save_path: str = flag(required=True, help="the final model is exported here in HF format", default=None)
    """(--save_path) the final export, in HF format"""
    ckpt_path: str | None = flag(help="resumable checkpoints (default: <save_path>/checkpoints)", default=None)
    """(--ckpt_path) resumable checkpoints; None: <save_path>/checkpoints (``dir``)"""
    save_steps: int = flag(type=int, help="checkpoint every N steps (-1: only at the end)", default=-1)
    """(--save_steps) checkpoint every N steps (-1: only at the end)"""
    max_ckpt_num: int = flag(type=int, default=3)
    """(--max_ckpt_num) checkpoints kept"""
    load_checkpoint: bool = flag(action="store_true", help="resume from the latest checkpoint (start fresh, logged, "
                                                           "where there is none yet)", default=False)
    """(--load_checkpoint) resume from the latest checkpoint, if any"""
    stop_after_steps: int = flag(type=int, help="stop (as if killed) after this many steps of this run; for resume "
                                                "tests", default=-1)
    """(--stop_after_steps) stop as if killed after this many steps of this run (resume tests)"""

    @classmethod
    def add_args(cls, g, *, what: str = "model") -> None:
        super().add_args(g, save_path={"help": f"the final {what} is exported here in HF format"})

    @property
    def dir(self) -> str:
        return self.ckpt_path or os.path.join(self.save_path, "checkpoints")

    def check(self) -> None:
        """``--load_checkpoint`` resumes from the checkpoints under ``--ckpt_path``, or starts fresh where there is
        none yet (``Checkpointer.load_if_any``); a ``--ckpt_path`` that is a file is an error."""
        if self.load_checkpoint and os.path.exists(self.dir) and not os.path.isdir(self.dir):
            raise ValueError(f"--load_checkpoint: --ckpt_path {self.dir} is a file, not a folder")


@dataclass
class LoggingPart(Part):
    """Logging: the progress line's period, TensorBoard, Weights & Biases (OpenRLHF's flag names)."""

    logging_steps: int = flag(type=int, default=1)
    """(--logging_steps)"""
    tensorboard: str | None = flag("--tensorboard", "--use_tensorboard", help="TensorBoard log dir", default=None)
    """(--tensorboard, --use_tensorboard) TensorBoard log dir"""
    use_wandb: str | None = flag(nargs="?", const="True", help="log to Weights & Biases; optionally the API key "
                                                               "(else WANDB_API_KEY or `wandb login`; without any "
                                                               "key, or with WANDB_MODE=offline, it logs offline "
                                                               "under <save_path>/wandb)", default=None)
    """(--use_wandb) log to W&B; optionally the API key"""
    wandb_org: str | None = flag(help="the W&B entity (team or user)", default=None)
    """(--wandb_org)"""
    wandb_group: str | None = flag(default=None)
    """(--wandb_group)"""
    wandb_project: str = flag(default="rlhf-megatron")
    """(--wandb_project)"""
    wandb_run_name: str | None = flag(help="default: the --save_path folder's name", default=None)
    """(--wandb_run_name) default: the --save_path folder's name"""


@dataclass
class BatchPart(Part):
    """Samples per optimizer step and per forward/backward."""

    train_batch_size: int = flag(type=int, help="samples per optimizer step (global)", default=128)
    """(--train_batch_size) samples per optimizer step (global)"""
    micro_train_batch_size: int = flag(type=int, help="samples per forward/backward per rank", default=8)
    """(--micro_train_batch_size) samples per forward/backward per rank"""
    max_epochs: int = flag(type=int, help="passes over the data (PPO: over each rollout)", default=1)
    """(--max_epochs) passes over the data (PPO: over each rollout)"""

    @classmethod
    def add_args(cls, g, *, micro_bs: int = 8, epochs: int = 1) -> None:
        super().add_args(g, micro_train_batch_size={"default": micro_bs}, max_epochs={"default": epochs})

    def check(self) -> None:
        for name in ("micro_train_batch_size", "max_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class OptimPart(Part):
    """Adam and its schedule, shared by every trained role; learning rates are per entry point."""

    lr_warmup_ratio: float = flag(type=float, default=config_default(OptimConfig, "warmup_ratio"))
    """(--lr_warmup_ratio)"""
    lr_scheduler: str = flag(default="cosine_with_min_lr")
    """(--lr_scheduler)"""
    l2: float = flag(type=float, help="weight decay", default=config_default(OptimConfig, "weight_decay"))
    """(--l2) weight decay"""
    adam_betas: tuple = flag(type=float, nargs=2, default=config_default(OptimConfig, "adam_betas"))
    """(--adam_betas)"""
    max_norm: float = flag(type=float, help="gradient clipping", default=config_default(OptimConfig, "clip_grad"))
    """(--max_norm) gradient clipping"""
    max_skipped_steps: int = flag(type=int, help="updates with a non-finite loss or grad norm are skipped (and "
                                                 "counted); this many in a row stop the job with an error",
                                  default=config_default(OptimConfig, "max_skipped_steps"))
    """(--max_skipped_steps) non-finite updates in a row that stop the job"""
    aux_loss_coef: float = flag(type=float, help="MoE models: coefficient of megatron's per-layer load-balancing "
                                                 "loss (0: off)", default=config_default(OptimConfig, "aux_loss_coef"))
    """(--aux_loss_coef) MoE load-balancing loss coefficient"""
    moe_router_bias_update_rate: float = flag(type=float,
                                              default=config_default(OptimConfig, "expert_bias_update_rate"),
                                              help="MoE models with an expert-bias correction (DeepSeek-V3, GLM-4.5): "
                                                   "megatron's rate of its update after each step, towards balanced "
                                                   "loads (0: frozen, as slime runs RL; megatron's own default is "
                                                   "1e-3, which verl sets)")
    """(--moe_router_bias_update_rate) megatron's ``moe_router_bias_update_rate``; 0 keeps the bias frozen"""

    def config(self, lr: float, total_steps: int, distributed: bool):
        """The ``OptimConfig`` of a trained role; ``distributed``: megatron's distributed optimizer (ZeRO-1)."""
        from rlhf.runtime.role import OptimConfig

        return OptimConfig(lr=lr, weight_decay=self.l2, adam_betas=tuple(self.adam_betas), clip_grad=self.max_norm,
                           max_skipped_steps=self.max_skipped_steps, warmup_ratio=self.lr_warmup_ratio,
                           scheduler=self.lr_scheduler, total_steps=total_steps, use_distributed_optimizer=distributed,
                           aux_loss_coef=self.aux_loss_coef, expert_bias_update_rate=self.moe_router_bias_update_rate)


@dataclass
class TextPart(Part):
    """How records become text: templates, limits, bad rows (``rlhf.data.DataConfig``)."""

    input_template: str | None = flag(default=config_default(DataConfig, "input_template"))
    """(--input_template)"""
    apply_chat_template: bool = flag(action="store_true", default=config_default(DataConfig, "apply_chat_template"))
    """(--apply_chat_template)"""
    max_samples: int = flag(type=int, default=100_000_000)
    """(--max_samples)"""
    skip_bad_samples: bool = flag(action="store_true", help="skip (and count) samples with a missing key or empty "
                                                            "field instead of failing",
                                 default=config_default(DataConfig, "skip_bad_samples"))
    """(--skip_bad_samples) skip (and count) samples with a missing key or empty field"""
    dataset_format: str = flag(choices=["auto", "plain", "webgpt", "hh", "chat"],
                               help="the seed datasets' layouts (rlhf/data/presets.py): webgpt comparisons, hh-rlhf "
                                    "dialogues; auto: by dataset name, then by record keys; plain: the key flags as "
                                    "given", default=config_default(DataConfig, "dataset_format"))
    """(--dataset_format) auto | plain | webgpt | hh | chat"""


@dataclass
class KeysPart(Part):
    """The record fields the data layer reads (``rlhf.data.DataConfig`` needs all five)."""

    prompt_key: str | None = config_field(DataConfig, "prompt_key")
    chosen_key: str | None = config_field(DataConfig, "chosen_key")
    rejected_key: str | None = config_field(DataConfig, "rejected_key")
    input_key: str | None = config_field(DataConfig, "input_key")
    output_key: str | None = config_field(DataConfig, "output_key")

    @classmethod
    def add_args(cls, g, *, pairs: bool = False) -> None:
        """``pairs`` (RM, DPO): prompt / chosen / rejected are shown, input / output hidden; otherwise (SFT, KTO)
        the reverse."""
        shown = {"prompt_key": "the prompt", "chosen_key": "the preferred response",
                 "rejected_key": "the other response"} if pairs else {"input_key": "the prompt",
                                                                      "output_key": "the response"}
        defaults = {f.name: f.default for f in fields(cls)}  # DataConfig's: SFT's and KTO's
        if pairs:  # RM's and DPO's records hold a prompt and two responses
            defaults.update(prompt_key="prompt", output_key=None)
        for name, default in defaults.items():
            g.add_argument(f"--{name}", default=default, help=shown.get(name, argparse.SUPPRESS))


@dataclass
class SamplingPart(Part):
    """How each reply is sampled: PPO's rollout (``rlhf.ppo.parts.GenerationPart``), rejection sampling and batch
    inference (which name the first flag ``--max_new_tokens``)."""

    generate_max_len: int = flag(type=int, default=1024, help="new tokens per response at most")
    """(--generate_max_len) new tokens per response at most"""
    prompt_max_len: int = flag(type=int, default=config_default(DataConfig, "prompt_max_len"),
                               help="longer prompts keep their last tokens")
    """(--prompt_max_len) longer prompts keep their last tokens"""
    temperature: float = flag(type=float, default=1.0)
    """(--temperature)"""
    top_p: float = flag(type=float, default=1.0)
    """(--top_p)"""


@dataclass
class GeneratorPart(Part):
    """Which generator runs and vLLM's KV cache: PPO's rollout (``rlhf.ppo.parts.RolloutPart``), rejection sampling,
    batch inference."""

    vllm_kv_cache_mb: int | None = flag(type=int, default=None,
                                        help="vLLM KV cache per rank in MB (vLLM's kv_cache_memory_bytes). Default: "
                                             "256 on CPU; on CUDA --vllm_gpu_memory_utilization decides, and this "
                                             "flag, when given, replaces it")
    """(--vllm_kv_cache_mb) vLLM KV cache per rank in MB"""
    rollout_backend: str = flag(default=config_default(RolloutConfig, "backend"),
                                help="auto (vLLM if installed) | vllm | megatron (fallback)")
    """(--rollout_backend) auto | vllm | megatron"""
