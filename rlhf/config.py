"""Command-line flags with the names users know from OpenRLHF / AIAK-RLHF, validated before any heavy work.

Every check that can fail on user input runs in ``validate_*`` before the process group or any model exists,
and raises ``ValueError`` naming the flag and its value.
"""
from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger(__name__)


def add_common_args(p: argparse.ArgumentParser, *, lr: float, epochs: int, micro_bs: int = 8) -> None:
    g = p.add_argument_group("model and output")
    g.add_argument("--pretrain", required=True, help="HF folder or converted megatron checkpoint")
    g.add_argument("--save_path", required=True, help="final HF export goes here")
    g.add_argument("--ckpt_path", default=None, help="resumable checkpoints (default: <save_path>/checkpoints)")
    g.add_argument("--save_steps", type=int, default=-1, help="checkpoint every N steps (-1: only at the end)")
    g.add_argument("--max_ckpt_num", type=int, default=3)
    g.add_argument("--load_checkpoint", action="store_true", help="resume from the latest checkpoint")
    g.add_argument("--stop_after_steps", type=int, default=-1,
                   help="stop (as if killed) after this many steps of this run; for resume tests")
    g.add_argument("--logging_steps", type=int, default=1)
    g.add_argument("--eval_steps", type=int, default=-1, help="evaluate every N steps (-1: at the end)")
    g.add_argument("--tensorboard", default=None, help="TensorBoard log dir (alias: --use_tensorboard)")
    g.add_argument("--use_tensorboard", dest="tensorboard", default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("batching and optimisation")
    g.add_argument("--train_batch_size", type=int, default=128, help="global batch size (samples per step)")
    g.add_argument("--micro_train_batch_size", type=int, default=micro_bs)
    g.add_argument("--max_epochs", type=int, default=epochs)
    g.add_argument("--max_len", type=int, default=512)
    g.add_argument("--max_samples", type=int, default=100_000_000)
    g.add_argument("--learning_rate", type=float, default=lr)
    g.add_argument("--lr_warmup_ratio", type=float, default=0.03)
    g.add_argument("--lr_scheduler", default="cosine_with_min_lr")
    g.add_argument("--l2", type=float, default=0.0, help="weight decay")
    g.add_argument("--adam_betas", type=float, nargs=2, default=(0.9, 0.95))
    g.add_argument("--max_norm", type=float, default=1.0, help="gradient clipping")
    g.add_argument("--max_skipped_steps", type=int, default=3,
                   help="updates with a non-finite loss or grad norm are skipped (and counted); this many in a row "
                        "stop the job with an error")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--gradient_checkpointing", action="store_true")
    g.add_argument("--transformer_impl", choices=["local", "transformer_engine"], default=None,
                   help="megatron layer implementation (megatron's flag); default: transformer_engine where it "
                        "imports on CUDA, else local. Checkpoints are the same under either")
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--zero_stage", type=int, default=0,
                   help="compatibility: >=1 maps to megatron's distributed optimizer (ZeRO-1)")
    g.add_argument("--flash_attn", action="store_true",
                   help="compatibility: flash/TE attention is used when installed on a GPU")
    g.add_argument("--packing_samples", action="store_true",
                   help="run each micro-batch as one padding-free row (THD packing, varlen attention)")
    g.add_argument("--tensor_model_parallel_size", "--tp", type=int, default=1)
    g.add_argument("--pipeline_model_parallel_size", "--pp", type=int, default=1)
    g = p.add_argument_group("data")
    g.add_argument("--dataset", required=True, help="comma-separated files/folders")
    g.add_argument("--dataset_probs", default=None, help="comma-separated mixing probabilities")
    g.add_argument("--eval_dataset", default=None, help="held-out data (default: none)")
    g.add_argument("--eval_split", type=float, default=0.0, help="hold out this fraction of --dataset for eval")
    g.add_argument("--apply_chat_template", action="store_true")
    g.add_argument("--input_template", default=None)
    g.add_argument("--skip_bad_samples", action="store_true",
                   help="skip (and count) samples with a missing key or empty field instead of failing")
    from rlhf.models.lora import add_lora_args

    add_lora_args(p)


def validate_common(args: argparse.Namespace, world_size: int) -> int:
    """Checks on flags alone; returns the DP size."""
    from rlhf.distributed.mesh import validate_layout

    dp = validate_layout(world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    from rlhf.models.gpt import resolve_transformer_impl

    resolve_transformer_impl(args.transformer_impl, lora=bool(getattr(args, "lora_rank", 0)))  # before any model
    if args.micro_train_batch_size < 1:
        raise ValueError(f"--micro_train_batch_size must be >= 1, got {args.micro_train_batch_size}")
    if args.train_batch_size % (args.micro_train_batch_size * dp) != 0:
        raise ValueError(f"--train_batch_size {args.train_batch_size} is not divisible by "
                         f"--micro_train_batch_size {args.micro_train_batch_size} x data-parallel size {dp}")
    if args.max_epochs < 1:
        raise ValueError(f"--max_epochs must be >= 1, got {args.max_epochs}")
    if args.max_len < 8:
        raise ValueError(f"--max_len must be >= 8, got {args.max_len}")
    if args.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero_stage must be 0..3, got {args.zero_stage}")
    check_paths_exist("--dataset", args.dataset)
    check_paths_exist("--eval_dataset", args.eval_dataset)
    if not 0.0 <= args.eval_split < 1.0:
        raise ValueError(f"--eval_split must be in [0, 1), got {args.eval_split}")
    check_resumable(args)
    from rlhf.models.lora import lora_config_from_args

    lora_config_from_args(args)  # --lora_rank/--lora_alpha/--target_modules/--lora_dropout
    from rlhf.engine import describe_source
    from rlhf.models.spec import check_parallel_fit

    try:
        src = describe_source(args.pretrain)
    except ValueError as e:
        raise ValueError(f"--pretrain {args.pretrain}: {e}") from None
    spec = src["spec"]
    check_parallel_fit(spec, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, src["padded_vocab"])
    if args.packing_samples:  # what the packed attention path refuses at the first forward (models/packed_attention)
        if spec.sliding_window is not None and args.max_len > spec.sliding_window:
            raise ValueError(f"--packing_samples: --pretrain {args.pretrain} has sliding_window={spec.sliding_window}"
                             f", shorter than --max_len {args.max_len}; packed sequences do not support that")
        if spec.attention_dropout > 0:
            raise ValueError(f"--packing_samples: --pretrain {args.pretrain} has attention_dropout="
                             f"{spec.attention_dropout}, which packed sequences do not support while training")
    return dp


def check_paths_exist(flag: str, value: str | None) -> None:
    """Each entry of a comma-separated data flag (``path`` or ``folder@split``) must exist."""
    for path in value.split(",") if value else []:
        if not os.path.exists(path.split("@")[0]):
            raise ValueError(f"{flag}: not found: {path}")


def check_resumable(args: argparse.Namespace) -> None:
    """``--load_checkpoint`` needs a published ``latest`` checkpoint under ``--ckpt_path``."""
    if args.load_checkpoint:
        ckpt = args.ckpt_path or os.path.join(args.save_path, "checkpoints")
        if not os.path.exists(os.path.join(ckpt, "latest")):
            raise ValueError(f"--load_checkpoint: no 'latest' checkpoint under --ckpt_path {ckpt}")


def log_compat_mappings(args: argparse.Namespace) -> None:
    """One line per compatibility flag, saying what it maps to here."""
    if args.zero_stage >= 1:
        log.info("--zero_stage %d -> megatron distributed optimizer (optimizer states sharded over DP; ZeRO-1)%s",
                 args.zero_stage, "; ZeRO-2/3 parameter/gradient sharding is not implemented" if args.zero_stage > 1
                 else "")
    if args.flash_attn:
        from rlhf.models.gpt import te_available

        log.info("--flash_attn -> %s", "transformer-engine attention" if te_available() else
                 "no flash/TE kernel on this machine: megatron's local attention (the flag changes nothing)")


def cli_main(add_args, run, argv=None) -> int:
    """The body of a ``launch/*.py`` entry point: its flags (``add_args``), ``run(args)``, and an ``error:`` line
    with exit code 2 on bad input (``ValueError``)."""
    import sys

    p = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    args = p.parse_args(argv)
    from rlhf.engine import TrainingDiverged

    try:
        run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:  # one line, not a traceback: the run diverged, nothing non-finite was saved
        print(f"error: {e}", file=sys.stderr)
        return 3
    return 0
