"""The parts of a job's configuration that several entry points share (``rlhf.config.part.Part``): the parallel layout,
how the megatron models run, the model source, the supervised data, batching, the optimizer, checkpoints and
logging. Each declares its flags (``add_args``), is built once from the parsed flags at the entry point
(``from_args``) and checks its own values (``check``); checks that need several parts or the model's config stay in
the workflow's ``validate``. ``rlhf.config.job`` composes them into the supervised entry points' flags."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from rlhf.config.part import Part


@dataclass
class ParallelPart(Part):
    """The model-parallel layout megatron builds (data parallelism is what is left of the world size)."""

    tensor_model_parallel_size: int = 1
    """(--tensor_model_parallel_size, --tp)"""
    pipeline_model_parallel_size: int = 1
    """(--pipeline_model_parallel_size, --pp)"""
    context_parallel_size: int = 1
    """(--context_parallel_size, --cp, --ring_attn_size) each sequence split over this many ranks"""
    expert_model_parallel_size: int = 1
    """(--expert_model_parallel_size, --ep) MoE: each layer's experts spread over this many DP ranks"""
    dist_timeout_s: float | None = None
    """(--dist_timeout_s) a rank waiting this long for a peer ends the job; None: the device's default"""

    @classmethod
    def add_args(cls, g, *, pp: bool = True, tp_help: str | None = None, cp: bool = True) -> None:
        g.add_argument("--tensor_model_parallel_size", "--tp", type=int, default=1, help=tp_help)
        if pp:
            g.add_argument("--pipeline_model_parallel_size", "--pp", type=int, default=1)
        if cp:
            g.add_argument("--context_parallel_size", "--cp", "--ring_attn_size", type=int, default=1,
                           help="split each sequence over this many ranks (megatron's load-balanced layout), carved "
                                "out of data parallelism; OpenRLHF's --ring_attn_size (docs/context_parallel.md)")
        g.add_argument("--expert_model_parallel_size", "--ep", type=int, default=1,
                       help="MoE models: spread each layer's experts over this many data-parallel ranks")
        g.add_argument("--dist_timeout_s", type=float, default=None,
                       help="a rank that waits this long for a peer (a collective, or a silent heartbeat) ends the "
                            "job with one line naming the rank and phase; default 300 on CUDA, 180 on CPU "
                            "(docs/reliability.md)")

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size


def add_precision_seed_args(g) -> None:
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--seed", type=int, default=42)


@dataclass
class EnginePart(Part):
    """How the megatron models run: precision, seed, layers, memory, the optimizer's sharding."""

    bf16: bool = False
    """(--bf16)"""
    seed: int = 42
    """(--seed)"""
    gradient_checkpointing: bool = False
    """(--gradient_checkpointing) recompute activations in the backward"""
    transformer_impl: str | None = None
    """(--transformer_impl) local | transformer_engine; None: TE where it imports on CUDA"""
    zero_stage: int | None = None
    """(--zero_stage) >= 1: megatron's distributed optimizer; None until ``rlhf.config.job.resolve_zero_stage``"""
    flash_attn: bool = False
    """(--flash_attn) compatibility only"""
    packing_samples: bool = False
    """(--packing_samples) padding-free THD micro-batches"""
    use_liger_kernel: bool | None = None
    """(--use_liger_kernel) fused SwiGLU, RoPE and SFT head+loss (rlhf.models.fused); None: on for CUDA without
    Transformer Engine where liger-kernel imports"""

    @classmethod
    def add_args(cls, g) -> None:
        add_precision_seed_args(g)
        g.add_argument("--gradient_checkpointing", action="store_true")
        g.add_argument("--transformer_impl", choices=["local", "transformer_engine"], default=None,
                       help="megatron layer implementation (megatron's flag); default: transformer_engine where it "
                            "imports on CUDA, else local. Checkpoints are the same under either")
        g.add_argument("--zero_stage", type=int, default=None,
                       help=">=1 maps to megatron's distributed optimizer (ZeRO-1: optimizer states sharded over DP); "
                            "default 1 on CUDA when the data-parallel size is > 1, else 0")
        g.add_argument("--flash_attn", action="store_true",
                       help="compatibility: flash/TE attention is used when installed on a GPU")
        g.add_argument("--packing_samples", action="store_true",
                       help="run each micro-batch as one padding-free row (THD packing, varlen attention)")
        g.add_argument("--use_liger_kernel", action=argparse.BooleanOptionalAction, default=None,
                       help="fused kernels in megatron's local layers: SFT's LM head fused with its loss "
                            "(Liger-Kernel's fused linear cross entropy), Triton SwiGLU and RoPE (Liger's RMSNorm: "
                            "RLHF_FUSED_PARTS); default: on for CUDA without Transformer Engine where liger-kernel "
                            "imports. On CPU the torch twins run")

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

    pretrain: str = ""
    """(--pretrain) HF folder or converted megatron checkpoint"""

    @classmethod
    def add_args(cls, g, *, help: str = "HF folder or converted megatron checkpoint") -> None:
        g.add_argument("--pretrain", required=True, help=help)


@dataclass
class CheckpointPart(Part):
    """Where results go and the resumable checkpoints."""

    save_path: str = ""
    """(--save_path) the final export, in HF format"""
    ckpt_path: str | None = None
    """(--ckpt_path) resumable checkpoints; None: <save_path>/checkpoints (``dir``)"""
    save_steps: int = -1
    """(--save_steps) checkpoint every N steps (-1: only at the end)"""
    max_ckpt_num: int = 3
    """(--max_ckpt_num) checkpoints kept"""
    load_checkpoint: bool = False
    """(--load_checkpoint) resume from the latest checkpoint, if any"""
    stop_after_steps: int = -1
    """(--stop_after_steps) stop as if killed after this many steps of this run (resume tests)"""

    @classmethod
    def add_args(cls, g, *, what: str = "model") -> None:
        g.add_argument("--save_path", required=True, help=f"the final {what} is exported here in HF format")
        g.add_argument("--ckpt_path", default=None, help="resumable checkpoints (default: <save_path>/checkpoints)")
        g.add_argument("--save_steps", type=int, default=-1, help="checkpoint every N steps (-1: only at the end)")
        g.add_argument("--max_ckpt_num", type=int, default=3)
        g.add_argument("--load_checkpoint", action="store_true",
                       help="resume from the latest checkpoint (start fresh, logged, where there is none yet)")
        g.add_argument("--stop_after_steps", type=int, default=-1,
                       help="stop (as if killed) after this many steps of this run; for resume tests")

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

    logging_steps: int = 1
    """(--logging_steps)"""
    tensorboard: str | None = None
    """(--tensorboard, --use_tensorboard) TensorBoard log dir"""
    use_wandb: str | None = None
    """(--use_wandb) log to W&B; optionally the API key"""
    wandb_org: str | None = None
    """(--wandb_org)"""
    wandb_group: str | None = None
    """(--wandb_group)"""
    wandb_project: str = "rlhf-megatron"
    """(--wandb_project)"""
    wandb_run_name: str | None = None
    """(--wandb_run_name) default: the --save_path folder's name"""

    @classmethod
    def add_args(cls, g) -> None:
        g.add_argument("--logging_steps", type=int, default=1)
        g.add_argument("--tensorboard", "--use_tensorboard", dest="tensorboard", default=None,
                       help="TensorBoard log dir")
        g.add_argument("--use_wandb", nargs="?", const="True", default=None,
                       help="log to Weights & Biases; optionally the API key (else WANDB_API_KEY or `wandb login`; "
                            "without any key, or with WANDB_MODE=offline, it logs offline under <save_path>/wandb)")
        g.add_argument("--wandb_org", default=None, help="the W&B entity (team or user)")
        g.add_argument("--wandb_group", default=None)
        g.add_argument("--wandb_project", default="rlhf-megatron")
        g.add_argument("--wandb_run_name", default=None, help="default: the --save_path folder's name")


@dataclass
class BatchPart(Part):
    """Samples per optimizer step and per forward/backward."""

    train_batch_size: int = 128
    """(--train_batch_size) samples per optimizer step (global)"""
    micro_train_batch_size: int = 8
    """(--micro_train_batch_size) samples per forward/backward per rank"""
    max_epochs: int = 1
    """(--max_epochs) passes over the data (PPO: over each rollout)"""

    @classmethod
    def add_args(cls, g, *, micro_bs: int = 8, epochs: int = 1) -> None:
        g.add_argument("--train_batch_size", type=int, default=128, help="samples per optimizer step (global)")
        g.add_argument("--micro_train_batch_size", type=int, default=micro_bs,
                       help="samples per forward/backward per rank")
        g.add_argument("--max_epochs", type=int, default=epochs,
                       help="passes over the data (PPO: over each rollout)")

    def check(self) -> None:
        for name in ("micro_train_batch_size", "max_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class OptimPart(Part):
    """Adam and its schedule, shared by every trained role; learning rates are per entry point."""

    lr_warmup_ratio: float = 0.03
    """(--lr_warmup_ratio)"""
    lr_scheduler: str = "cosine_with_min_lr"
    """(--lr_scheduler)"""
    l2: float = 0.0
    """(--l2) weight decay"""
    adam_betas: tuple = (0.9, 0.95)
    """(--adam_betas)"""
    max_norm: float = 1.0
    """(--max_norm) gradient clipping"""
    max_skipped_steps: int = 3
    """(--max_skipped_steps) non-finite updates in a row that stop the job"""
    aux_loss_coef: float = 0.0
    """(--aux_loss_coef) MoE load-balancing loss coefficient"""

    @classmethod
    def add_args(cls, g) -> None:
        g.add_argument("--lr_warmup_ratio", type=float, default=0.03)
        g.add_argument("--lr_scheduler", default="cosine_with_min_lr")
        g.add_argument("--l2", type=float, default=0.0, help="weight decay")
        g.add_argument("--adam_betas", type=float, nargs=2, default=(0.9, 0.95))
        g.add_argument("--max_norm", type=float, default=1.0, help="gradient clipping")
        g.add_argument("--max_skipped_steps", type=int, default=3,
                       help="updates with a non-finite loss or grad norm are skipped (and counted); this many in a "
                            "row stop the job with an error")
        g.add_argument("--aux_loss_coef", type=float, default=0.0,
                       help="MoE models: coefficient of megatron's per-layer load-balancing loss (0: off)")

    def config(self, lr: float, total_steps: int, distributed: bool):
        """The ``OptimConfig`` of a trained role; ``distributed``: megatron's distributed optimizer (ZeRO-1)."""
        from rlhf.runtime.role import OptimConfig

        return OptimConfig(lr=lr, weight_decay=self.l2, adam_betas=tuple(self.adam_betas), clip_grad=self.max_norm,
                           max_skipped_steps=self.max_skipped_steps, warmup_ratio=self.lr_warmup_ratio,
                           scheduler=self.lr_scheduler, total_steps=total_steps, use_distributed_optimizer=distributed,
                           aux_loss_coef=self.aux_loss_coef)


@dataclass
class TextPart(Part):
    """How records become text: templates, limits, bad rows (``rlhf.data.DataConfig``)."""

    input_template: str | None = None
    """(--input_template)"""
    apply_chat_template: bool = False
    """(--apply_chat_template)"""
    max_samples: int = 100_000_000
    """(--max_samples)"""
    skip_bad_samples: bool = False
    """(--skip_bad_samples) skip (and count) samples with a missing key or empty field"""
    dataset_format: str = "auto"
    """(--dataset_format) auto | plain | webgpt | hh | chat"""

    @classmethod
    def add_args(cls, g) -> None:
        g.add_argument("--input_template", default=None)
        g.add_argument("--apply_chat_template", action="store_true")
        g.add_argument("--max_samples", type=int, default=100_000_000)
        g.add_argument("--skip_bad_samples", action="store_true",
                       help="skip (and count) samples with a missing key or empty field instead of failing")
        g.add_argument("--dataset_format", choices=["auto", "plain", "webgpt", "hh", "chat"], default="auto",
                       help="the seed datasets' layouts (rlhf/data/presets.py): webgpt comparisons, hh-rlhf "
                            "dialogues; auto: by dataset name, then by record keys; plain: the key flags as given")


@dataclass
class KeysPart(Part):
    """The record fields the data layer reads (``rlhf.data.DataConfig`` needs all five)."""

    prompt_key: str | None = None
    chosen_key: str | None = "chosen"
    rejected_key: str | None = "rejected"
    input_key: str | None = "input"
    output_key: str | None = "output"

    @classmethod
    def add_args(cls, g, *, pairs: bool = False) -> None:
        """``pairs`` (RM, DPO): prompt / chosen / rejected are shown, input / output hidden; otherwise (SFT, KTO)
        the reverse."""
        shown = {"prompt_key": "the prompt", "chosen_key": "the preferred response",
                 "rejected_key": "the other response"} if pairs else {"input_key": "the prompt",
                                                                      "output_key": "the response"}
        defaults = {"prompt_key": "prompt", "chosen_key": "chosen", "rejected_key": "rejected", "input_key": "input",
                    "output_key": None} if pairs else {"prompt_key": None, "chosen_key": "chosen",
                                                       "rejected_key": "rejected", "input_key": "input",
                                                       "output_key": "output"}
        for name, default in defaults.items():
            g.add_argument(f"--{name}", default=default, help=shown.get(name, argparse.SUPPRESS))
