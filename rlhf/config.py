"""Command-line flags with the names users know from OpenRLHF / AIAK-RLHF, validated before any heavy work.

Every check that can fail on user input runs in ``validate_*`` before the process group or any model exists,
and raises ``ValueError`` naming the flag and its value.
"""
from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- flag groups
# Each flag is declared once, in one of these groups; every entry point composes the groups it needs
# (tests/cli freezes the result). Defaults that differ per workflow are parameters.

def add_output_args(g, *, what: str = "model") -> None:
    """Where results go, checkpointing, logging (every training entry point)."""
    g.add_argument("--save_path", required=True, help=f"the final {what} is exported here in HF format")
    g.add_argument("--ckpt_path", default=None, help="resumable checkpoints (default: <save_path>/checkpoints)")
    g.add_argument("--save_steps", type=int, default=-1, help="checkpoint every N steps (-1: only at the end)")
    g.add_argument("--max_ckpt_num", type=int, default=3)
    g.add_argument("--load_checkpoint", action="store_true",
                   help="resume from the latest checkpoint (start fresh, logged, where there is none yet)")
    g.add_argument("--stop_after_steps", type=int, default=-1,
                   help="stop (as if killed) after this many steps of this run; for resume tests")
    g.add_argument("--logging_steps", type=int, default=1)
    g.add_argument("--tensorboard", "--use_tensorboard", dest="tensorboard", default=None,
                   help="TensorBoard log dir")
    add_wandb_args(g)


def add_wandb_args(g) -> None:
    """Weights & Biases, with OpenRLHF's flag names (rank 0 logs the same scalars as TensorBoard)."""
    g.add_argument("--use_wandb", nargs="?", const="True", default=None,
                   help="log to Weights & Biases; optionally the API key (else WANDB_API_KEY or `wandb login`; "
                        "without any key, or with WANDB_MODE=offline, it logs offline under <save_path>/wandb)")
    g.add_argument("--wandb_org", default=None, help="the W&B entity (team or user)")
    g.add_argument("--wandb_group", default=None)
    g.add_argument("--wandb_project", default="rlhf-megatron")
    g.add_argument("--wandb_run_name", default=None, help="default: the --save_path folder's name")


def add_batch_args(g, *, micro_bs: int = 8, epochs: int = 1) -> None:
    g.add_argument("--train_batch_size", type=int, default=128, help="samples per optimizer step (global)")
    g.add_argument("--micro_train_batch_size", type=int, default=micro_bs,
                   help="samples per forward/backward per rank")
    g.add_argument("--max_epochs", type=int, default=epochs, help="passes over the data (PPO: over each rollout)")


def add_optim_args(g) -> None:
    """Adam and its schedule, shared by every trained role (``optim_config``); learning rates are per entry."""
    g.add_argument("--lr_warmup_ratio", type=float, default=0.03)
    g.add_argument("--lr_scheduler", default="cosine_with_min_lr")
    g.add_argument("--l2", type=float, default=0.0, help="weight decay")
    g.add_argument("--adam_betas", type=float, nargs=2, default=(0.9, 0.95))
    g.add_argument("--max_norm", type=float, default=1.0, help="gradient clipping")
    g.add_argument("--max_skipped_steps", type=int, default=3,
                   help="updates with a non-finite loss or grad norm are skipped (and counted); this many in a row "
                        "stop the job with an error")
    g.add_argument("--aux_loss_coef", type=float, default=0.0,
                   help="MoE models: coefficient of megatron's per-layer load-balancing loss (0: off)")


def add_engine_args(g) -> None:
    """How the megatron models run: precision, layers, memory, the model-parallel layout, the seed."""
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
    add_parallel_args(g)


def add_precision_seed_args(g) -> None:
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--seed", type=int, default=42)


def add_parallel_args(g, *, pp: bool = True, tp_help: str | None = None, cp: bool = True) -> None:
    g.add_argument("--tensor_model_parallel_size", "--tp", type=int, default=1, help=tp_help)
    if pp:
        g.add_argument("--pipeline_model_parallel_size", "--pp", type=int, default=1)
    if cp:
        g.add_argument("--context_parallel_size", "--cp", "--ring_attn_size", type=int, default=1,
                       help="split each sequence over this many ranks (megatron's load-balanced layout), carved out "
                            "of data parallelism; OpenRLHF's --ring_attn_size (docs/context_parallel.md)")
    g.add_argument("--expert_model_parallel_size", "--ep", type=int, default=1,
                   help="MoE models: spread each layer's experts over this many data-parallel ranks")
    g.add_argument("--dist_timeout_s", type=float, default=None,
                   help="a rank that waits this long for a peer (a collective, or a silent heartbeat) ends the job "
                        "with one line naming the rank and phase; default 300 on CUDA, 180 on CPU "
                        "(docs/reliability.md)")


def add_text_args(g, *, input_key: bool = False) -> None:
    """How records become text: templates, limits, bad rows (``rlhf.data.DataConfig``)."""
    if input_key:
        g.add_argument("--input_key", default="input", help="the prompt field")
    g.add_argument("--input_template", default=None)
    g.add_argument("--apply_chat_template", action="store_true")
    g.add_argument("--max_samples", type=int, default=100_000_000)
    g.add_argument("--skip_bad_samples", action="store_true",
                   help="skip (and count) samples with a missing key or empty field instead of failing")
    g.add_argument("--dataset_format", choices=["auto", "plain", "webgpt", "hh", "chat"], default="auto",
                   help="the seed datasets' layouts (rlhf/data/presets.py): webgpt comparisons, hh-rlhf dialogues; "
                        "auto: by dataset name, then by record keys; plain: the key flags as given")


def add_sampling_args(g, *, max_new_tokens: str = "--generate_max_len") -> None:
    """Generation (PPO's rollout, rejection sampling)."""
    g.add_argument(max_new_tokens, type=int, default=1024, help="new tokens per response at most")
    g.add_argument("--prompt_max_len", type=int, default=1024, help="longer prompts keep their last tokens")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top_p", type=float, default=1.0)


def add_rollout_backend_args(g) -> None:
    g.add_argument("--vllm_kv_cache_mb", type=int, default=None,
                   help="vLLM KV cache per rank in MB (vLLM's kv_cache_memory_bytes). Default: 256 on CPU; on CUDA "
                        "--vllm_gpu_memory_utilization decides, and this flag, when given, replaces it")
    g.add_argument("--rollout_backend", default="auto", help="auto (vLLM if installed) | vllm | megatron (fallback)")


def add_key_args(p: argparse.ArgumentParser, *, pairs: bool) -> None:
    """The record fields the data layer reads (``rlhf.data.DataConfig`` needs all five). ``pairs`` (RM, DPO):
    prompt / chosen / rejected are shown, input / output hidden; otherwise (SFT, KTO) the reverse."""
    shown = {"prompt_key": "the prompt", "chosen_key": "the preferred response",
             "rejected_key": "the other response"} if pairs else {"input_key": "the prompt",
                                                                  "output_key": "the response"}
    defaults = {"prompt_key": "prompt", "chosen_key": "chosen", "rejected_key": "rejected", "input_key": "input",
                "output_key": None} if pairs else {"prompt_key": None, "chosen_key": "chosen",
                                                   "rejected_key": "rejected", "input_key": "input",
                                                   "output_key": "output"}
    for name, default in defaults.items():
        p.add_argument(f"--{name}", default=default, help=shown.get(name, argparse.SUPPRESS))


def add_common_args(p: argparse.ArgumentParser, *, lr: float, epochs: int, micro_bs: int = 8) -> None:
    """The flags of the supervised entry points (SFT, RM, DPO, KTO)."""
    g = p.add_argument_group("model and output")
    g.add_argument("--pretrain", required=True, help="HF folder or converted megatron checkpoint")
    add_output_args(g)
    g.add_argument("--eval_steps", type=int, default=-1, help="evaluate every N steps (-1: at the end)")
    g = p.add_argument_group("batching and optimisation")
    add_batch_args(g, micro_bs=micro_bs, epochs=epochs)
    g.add_argument("--max_len", type=int, default=512)
    g.add_argument("--learning_rate", type=float, default=lr)
    add_optim_args(g)
    add_engine_args(g)
    g = p.add_argument_group("data")
    g.add_argument("--dataset", required=True, help="comma-separated files/folders")
    g.add_argument("--dataset_probs", default=None, help="comma-separated mixing probabilities")
    g.add_argument("--eval_dataset", default=None, help="held-out data (default: none)")
    g.add_argument("--eval_split", type=float, default=0.0, help="hold out this fraction of --dataset for eval")
    add_text_args(g)
    from rlhf.models.lora import add_lora_args

    add_lora_args(p)


def validate_common(args: argparse.Namespace, world_size: int) -> int:
    """Checks on flags alone; returns the DP size."""
    from rlhf.distributed.mesh import validate_layout

    cp = getattr(args, "context_parallel_size", 1)
    dp = validate_layout(world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, cp=cp)
    from rlhf.models.gpt import resolve_transformer_impl

    resolve_transformer_impl(args.transformer_impl, lora=bool(getattr(args, "lora_rank", 0)), cp=cp)
    if args.micro_train_batch_size < 1:
        raise ValueError(f"--micro_train_batch_size must be >= 1, got {args.micro_train_batch_size}")
    if args.train_batch_size % (args.micro_train_batch_size * dp) != 0:
        raise ValueError(f"--train_batch_size {args.train_batch_size} is not divisible by "
                         f"--micro_train_batch_size {args.micro_train_batch_size} x data-parallel size {dp}")
    if args.max_epochs < 1:
        raise ValueError(f"--max_epochs must be >= 1, got {args.max_epochs}")
    if args.max_len < 8:
        raise ValueError(f"--max_len must be >= 8, got {args.max_len}")
    if args.zero_stage not in (None, 0, 1, 2, 3):
        raise ValueError(f"--zero_stage must be 0..3, got {args.zero_stage}")
    check_paths_exist("--dataset", args.dataset)
    check_paths_exist("--eval_dataset", args.eval_dataset)
    if not 0.0 <= args.eval_split < 1.0:
        raise ValueError(f"--eval_split must be in [0, 1), got {args.eval_split}")
    check_resumable(args)
    from rlhf.models.lora import lora_config_from_args

    lora_config_from_args(args)  # --lora_rank/--lora_alpha/--target_modules/--lora_dropout
    from rlhf.models.source import describe_source
    from rlhf.models.spec import check_parallel_fit

    try:
        src = describe_source(args.pretrain)
    except ValueError as e:
        raise ValueError(f"--pretrain {args.pretrain}: {e}") from None
    spec = src["spec"]
    from rlhf.models.source import check_tokenizer_folder

    check_tokenizer_folder(args.pretrain, "--pretrain")
    check_parallel_fit(spec, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, src["padded_vocab"])
    from rlhf.models.context_parallel import check_cp_flags

    check_cp_flags(cp, spec, "--pretrain")
    if args.packing_samples:  # what the packed attention path refuses at the first forward (models/packed_attention)
        if spec.sliding_window is not None and args.max_len > spec.sliding_window and cp == 1:
            raise ValueError(f"--packing_samples: --pretrain {args.pretrain} has sliding_window={spec.sliding_window}"
                             f", shorter than --max_len {args.max_len}; packed sequences do not support that")
        if spec.attention_dropout > 0:
            raise ValueError(f"--packing_samples: --pretrain {args.pretrain} has attention_dropout="
                             f"{spec.attention_dropout}, which packed sequences do not support while training")
    return dp


def optim_config(args: argparse.Namespace, lr: float, total_steps: int):
    """The optimizer of a trained role from the shared optimisation flags (``--l2``, ``--adam_betas``,
    ``--max_norm``, ``--lr_warmup_ratio``, ``--lr_scheduler``, ``--max_skipped_steps``, ``--zero_stage``,
    ``--aux_loss_coef``)."""
    from rlhf.engine import OptimConfig

    return OptimConfig(lr=lr, weight_decay=args.l2, adam_betas=tuple(args.adam_betas), clip_grad=args.max_norm,
                       max_skipped_steps=args.max_skipped_steps, warmup_ratio=args.lr_warmup_ratio,
                       scheduler=args.lr_scheduler, total_steps=total_steps,
                       use_distributed_optimizer=zero_stage(args) >= 1,
                       aux_loss_coef=getattr(args, "aux_loss_coef", 0.0))


def check_paths_exist(flag: str, value: str | None) -> None:
    """Each entry of a comma-separated data flag (``path``, ``path@split``, or a Hub name in the local HF cache)
    must exist."""
    from rlhf.data.sources import hub_cache_dir, local_path, parse_dataset_flag

    for spec in parse_dataset_flag(value) if value else []:
        if not os.path.exists(local_path(spec)):
            hub = (f" (nor a Hub dataset in the local HF cache {hub_cache_dir()}; nothing is downloaded)"
                   if spec.path.count("/") == 1 and not spec.path.startswith((".", "/")) else "")
            raise ValueError(f"{flag}: not found: {spec}{hub}")


def check_resumable(args: argparse.Namespace) -> None:
    """``--load_checkpoint`` resumes from the checkpoints under ``--ckpt_path``, or starts fresh where there is
    none yet (``Checkpointer.load_if_any``); a ``--ckpt_path`` that is a file is an error."""
    ckpt = args.ckpt_path or os.path.join(args.save_path, "checkpoints")
    if args.load_checkpoint and os.path.exists(ckpt) and not os.path.isdir(ckpt):
        raise ValueError(f"--load_checkpoint: --ckpt_path {ckpt} is a file, not a folder")


def resolve_zero_stage(args: argparse.Namespace, dp: int, cuda: bool) -> int:
    """``--zero_stage`` when given, else 1 (megatron's distributed optimizer) on CUDA when ``dp`` > 1, and 0
    otherwise. Sharding Adam's states over DP saves (DP - 1) / DP of them on every rank and costs a
    reduce-scatter + all-gather in place of the gradient all-reduce: cheap on NCCL, not on gloo. Measured on a
    2-core CPU (bench/ppo_vs_trl.py, SmolLM2-135M fp32, DP2): each of the actor and critic updates took 3 s longer
    (12.6 / 11.0 s against 9.6 / 7.9 s), and gloo's reduce-scatter + all-gather of 515 MB took 0.97 s against its
    all-reduce's 0.30 s. So a CPU job keeps 0 unless asked. Sets ``args.zero_stage``; call it before any
    ``optim_config``."""
    if args.zero_stage is None:
        args.zero_stage = 1 if dp > 1 and cuda else 0
    return args.zero_stage


def zero_stage(args: argparse.Namespace) -> int:
    assert args.zero_stage is not None, "resolve_zero_stage(args, mesh.dp, cuda) comes first"
    return args.zero_stage


def log_compat_mappings(args: argparse.Namespace, dp: int, cuda: bool) -> None:
    """Resolves ``--zero_stage`` for this data-parallel size and device, then one line per compatibility flag,
    saying what it maps to here."""
    given = args.zero_stage is not None
    if resolve_zero_stage(args, dp, cuda) >= 1:
        log.info("--zero_stage %d%s -> megatron distributed optimizer (optimizer states sharded over DP; ZeRO-1)%s",
                 args.zero_stage, "" if given else f" (the default on CUDA at data-parallel size {dp}; 0 turns it "
                                                   "off)",
                 "; ZeRO-2/3 parameter/gradient sharding is not implemented" if args.zero_stage > 1
                 else "")
    elif not given and dp > 1:
        log.info("--zero_stage not given: 0 on CPU (gloo's reduce-scatter + all-gather cost more than the "
                 "all-reduce they replace; --zero_stage 1 shards Adam's states over DP anyway)")
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
    from rlhf.migration import add_launcher_args, apply_launcher_args

    add_launcher_args(p)
    from rlhf.openrlhf_cli import translate

    try:  # OpenRLHF's dotted flags of today (rlhf/openrlhf_cli.py) -> ours, before argparse
        argv = translate(list(sys.argv[1:] if argv is None else argv), add_args.__module__.split(".")[1],
                         set(p._option_string_actions))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = p.parse_args(argv)
    from rlhf.compat.onednn import bound_onednn_caches
    from rlhf.agents import TooManyAgentFailures
    from rlhf.engine import TrainingDiverged

    bound_onednn_caches()  # before the first oneDNN call, which reads the capacities
    from rlhf.distributed import failures, watchdog

    # Once the job's process group is up (``watchdog_running``), a rank that fails leaves at once through
    # ``os._exit`` with one line naming its rank and phase: a clean interpreter exit could wait on peers that
    # are gone (rlhf/distributed/watchdog.py).
    try:
        apply_launcher_args(args)
        if getattr(args, "dist_timeout_s", None) is not None:
            watchdog.resolve_timeout_s(args.dist_timeout_s, "cpu")  # > 0, before anything is loaded
        run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return failures.end_rank(2)
    except (TrainingDiverged, TooManyAgentFailures) as e:  # one line, not a traceback: the run diverged (nothing
        # non-finite was saved), or its environments failed; every rank decides alike
        print(f"error: {e}", file=sys.stderr)
        return failures.end_rank(3)
    except Exception as e:
        if watchdog.watchdog_running():
            failures.fail_job(e)
        raise
    watchdog.finish_watchdog()
    return 0
