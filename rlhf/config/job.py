"""Command-line flags with the names users know from OpenRLHF / AIAK-RLHF, validated before any heavy work.

Every check that can fail on user input runs in ``validate_*`` before the process group or any model exists,
and raises ``ValueError`` naming the flag and its value.
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field

from rlhf.data.vision import VisionPart
from rlhf.models.lora import LoraPart
from rlhf.config.part import Job, Part, flag
from rlhf.config.parts import (BatchPart, CheckpointPart, EnginePart, GeneratorPart, KeysPart, LoggingPart, ModelPart,
                               OptimPart, ParallelPart, SamplingPart, TextPart)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- flag groups
# Each flag is declared once, by the part that holds it (``rlhf.config.parts``, and the parts of the supervised jobs
# below); every entry point composes the parts it needs (tests/cli freezes the result, tests/test_config_parts.py
# checks that each flag belongs to one part). Defaults that differ per workflow are parameters.

def add_output_args(g, *, what: str = "model") -> None:
    """Where results go, checkpointing, logging (every training entry point)."""
    CheckpointPart.add_args(g, what=what)
    LoggingPart.add_args(g)


def add_text_args(g, *, input_key: bool = False) -> None:
    """How records become text (``TextPart``), after the prompt field when ``input_key``."""
    if input_key:
        g.add_argument("--input_key", default=KeysPart.input_key, help="the prompt field")  # DataConfig's
    TextPart.add_args(g)


def add_sampling_args(g, *, max_new_tokens: str = "--generate_max_len") -> None:
    """Generation (PPO's rollout, rejection sampling): ``SamplingPart``'s flags, the first named ``max_new_tokens``."""
    SamplingPart.add_args(g, generate_max_len={"names": (max_new_tokens,)})


add_rollout_backend_args = GeneratorPart.add_args


add_parallel_args = ParallelPart.add_args


@dataclass
class DataPart(Part):
    """The supervised workflows' data: files, mixing, the held-out set and when it is evaluated."""

    dataset: str = flag(required=True, help="comma-separated files/folders", default=None)
    """(--dataset) comma-separated files/folders"""
    dataset_probs: str | None = flag(help="comma-separated mixing probabilities", default=None)
    """(--dataset_probs) comma-separated mixing probabilities"""
    eval_dataset: str | None = flag(help="held-out data (default: none)", default=None)
    """(--eval_dataset) held-out data"""
    eval_split: float = flag(type=float, help="hold out this fraction of --dataset for eval", default=0.0)
    """(--eval_split) hold out this fraction of --dataset"""
    eval_steps: int = flag(type=int, help="evaluate every N steps (-1: at the end)", default=-1)
    """(--eval_steps) evaluate every N steps (-1: at the end)"""


    def check(self) -> None:
        check_paths_exist("--dataset", self.dataset)
        check_paths_exist("--eval_dataset", self.eval_dataset)
        if not 0.0 <= self.eval_split < 1.0:
            raise ValueError(f"--eval_split must be in [0, 1), got {self.eval_split}")


@dataclass
class SupervisedBatch(BatchPart):
    """``BatchPart`` and the sequence length of the supervised workflows."""

    max_len: int = flag(type=int, default=512)
    """(--max_len) tokens per sample at most"""

    def check(self) -> None:
        super().check()
        if self.max_len < 8:
            raise ValueError(f"--max_len must be >= 8, got {self.max_len}")


@dataclass
class SupervisedOptim(OptimPart):
    """``OptimPart`` with the one trained model's learning rate."""

    learning_rate: float = flag(type=float, default=1e-5)
    """(--learning_rate)"""

    @classmethod
    def add_args(cls, g, *, lr: float = 1e-5) -> None:
        super().add_args(g, learning_rate={"default": lr})


@dataclass
class SupervisedJob(Job):
    """The configuration of SFT, RM, DPO and KTO: the shared parts, and the task's own (``TASK_PARTS`` of its
    module: the record keys, the reference, the loss's options), built once by ``rlhf.supervised.loop.prepare``. The
    launchers' flags (``rlhf.config.migration.LauncherPart``) are applied by ``cli_main`` before, and are no part of it."""

    model: ModelPart
    checkpoint: CheckpointPart
    logging: LoggingPart
    batch: SupervisedBatch
    optim: SupervisedOptim
    engine: EnginePart
    parallel: ParallelPart
    data: DataPart
    text: TextPart
    vision: VisionPart
    lora: LoraPart
    task: dict = field(default_factory=dict)
    """the task's own parts by name"""


def add_common_args(p: argparse.ArgumentParser, *, lr: float, epochs: int, micro_bs: int = 8) -> None:
    """The flags of the supervised entry points (SFT, RM, DPO, KTO): the parts of ``SupervisedJob``."""
    g = p.add_argument_group("model and output")
    ModelPart.add_args(g)
    add_output_args(g)
    g = p.add_argument_group("batching and optimisation")
    SupervisedBatch.add_args(g, micro_bs=micro_bs, epochs=epochs)
    SupervisedOptim.add_args(g, lr=lr)
    EnginePart.add_args(g)
    ParallelPart.add_args(g)
    g = p.add_argument_group("data")
    DataPart.add_args(g)
    TextPart.add_args(g)
    VisionPart.add_args(g)
    LoraPart.add_args(p)


def validate_common(job: SupervisedJob, world_size: int) -> int:
    """The checks that need several parts or the model's config (each part checked its own values when it was
    built); returns the DP size."""
    from rlhf.distributed.mesh import validate_layout

    par, batch, model = job.parallel, job.batch, job.model
    dp = validate_layout(world_size, par.tp, par.pp, cp=par.cp)
    from rlhf.models.gpt import resolve_transformer_impl

    resolve_transformer_impl(job.engine.transformer_impl, lora=bool(job.lora.lora_rank), cp=par.cp)
    if batch.train_batch_size % (batch.micro_train_batch_size * dp) != 0:
        raise ValueError(f"--train_batch_size {batch.train_batch_size} is not divisible by "
                         f"--micro_train_batch_size {batch.micro_train_batch_size} x data-parallel size {dp}")
    from rlhf.models.source import describe_source
    from rlhf.models.spec import check_parallel_fit

    try:
        src = describe_source(model.pretrain)
    except ValueError as e:
        raise ValueError(f"--pretrain {model.pretrain}: {e}") from None
    spec = src["spec"]
    from rlhf.models.source import check_tokenizer_folder

    check_tokenizer_folder(model.pretrain, "--pretrain")
    check_parallel_fit(spec, par.tp, par.pp, src["padded_vocab"])
    from rlhf.models.context_parallel import check_cp_flags

    check_cp_flags(par.cp, spec, "--pretrain")
    if spec.vision is not None:
        from rlhf.models.vlm import check_vlm_layout

        if "sft" not in job.task:
            raise ValueError(f"--pretrain {model.pretrain} is a vision-language model ({spec.model_type}): SFT and "
                             "PPO/GRPO (launch/sft.py, launch/ppo.py) take one; reward models, DPO and KTO do not yet")
        check_vlm_layout(spec, tp=par.tp, pp=par.pp, cp=par.cp, packing=job.engine.packing_samples,
                         lora=bool(job.lora.lora_rank), what=f"--pretrain {model.pretrain}")
    if job.engine.packing_samples:  # what the packed attention path refuses at the first forward
        if spec.sliding_window is not None and batch.max_len > spec.sliding_window and par.cp == 1:
            raise ValueError(f"--packing_samples: --pretrain {model.pretrain} has sliding_window="
                             f"{spec.sliding_window}, shorter than --max_len {batch.max_len}; packed sequences do not "
                             "support that")
        if spec.attention_dropout > 0:
            raise ValueError(f"--packing_samples: --pretrain {model.pretrain} has attention_dropout="
                             f"{spec.attention_dropout}, which packed sequences do not support while training")
    return dp


def optim_config(args: argparse.Namespace, lr: float, total_steps: int):
    """The optimizer of a trained role from the shared optimisation flags of a parsed command line
    (``OptimPart.config``, after ``resolve_zero_stage``)."""
    from dataclasses import fields

    part = OptimPart(**{f.name: getattr(args, f.name, f.default) for f in fields(OptimPart)})
    return part.config(lr, total_steps, zero_stage(args) >= 1)


def data_configs(job: SupervisedJob):
    """``(train, eval)`` data configs of a supervised job: --dataset's, and --eval_dataset's (uncapped, unmixed) or
    None. A data config spans several parts (data, keys, text, --max_len): it is read from the job's flat view."""
    from rlhf.data import DataConfig

    from rlhf.data.vision import vision_data
    from rlhf.models.source import describe_source

    ns, data = job.namespace(), job.data
    vision = vision_data(describe_source(job.model.pretrain)["spec"], job.model.pretrain, job.vision)
    evals = (DataConfig.from_args(ns, dataset=data.eval_dataset, dataset_probs=None, max_samples=None, vision=vision)
             if data.eval_dataset else None)
    return DataConfig.from_args(ns, vision=vision), evals


def hold_out(items: list, fraction: float) -> tuple[list, list]:
    """``(kept, held)``: the last ``fraction`` of ``items`` held out (--eval_split)."""
    n = int(len(items) * fraction)
    return items[:len(items) - n], items[len(items) - n:]


def check_paths_exist(flag: str, value: str | None) -> None:
    """Each entry of a comma-separated data flag (``path``, ``path@split``, or a Hub name in the local HF cache)
    must exist."""
    from rlhf.data.sources import hub_cache_dir, local_path, parse_dataset_flag

    for spec in parse_dataset_flag(value) if value else []:
        if not os.path.exists(local_path(spec)):
            hub = (f" (nor a Hub dataset in the local HF cache {hub_cache_dir()}; nothing is downloaded)"
                   if spec.path.count("/") == 1 and not spec.path.startswith((".", "/")) else "")
            raise ValueError(f"{flag}: not found: {spec}{hub}")


def resolve_zero_stage(args, dp: int, cuda: bool) -> int:
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


def log_compat_mappings(args, dp: int, cuda: bool) -> None:
    """Resolves ``--zero_stage`` for this data-parallel size and device, then one line per compatibility flag,
    saying what it maps to here. ``args``: the ``EnginePart`` (or a parsed command line)."""
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
    with exit code 2 on bad input (``ValueError``). ``--config FILE`` and the resolved flags written beside the run:
    ``rlhf.config.config_file``."""
    import sys

    p = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    from rlhf.config.migration import add_launcher_args, apply_launcher_args

    add_launcher_args(p)
    from rlhf.config import config_file

    config_file.add_config_arg(p)
    from rlhf.distributed.env import DistEnv
    from rlhf.observability.metrics import setup_logging
    from rlhf.config.openrlhf import entry_name, translate

    setup_logging(DistEnv.from_environ().rank)  # the translation's lines (rank 0's; its warnings on every rank)
    entry = entry_name(add_args.__module__)
    try:  # the --config file's flags before the given ones, then OpenRLHF's dotted flags (rlhf/config/openrlhf.py)
        argv = config_file.expand(list(sys.argv[1:] if argv is None else argv), p, entry)
        argv = translate(argv, entry, set(p._option_string_actions))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = p.parse_args(argv)
    from rlhf.compat.onednn import bound_onednn_caches
    from rlhf.agents import TooManyAgentFailures
    from rlhf.runtime.role import TrainingDiverged

    bound_onednn_caches()  # before the first oneDNN call, which reads the capacities
    from rlhf.distributed import failures, watchdog

    # Once the job's process group is up (``watchdog_running``), a rank that fails leaves at once through
    # ``os._exit`` with one line naming its rank and phase: a clean interpreter exit could wait on peers that
    # are gone (rlhf/distributed/watchdog.py).
    try:
        config_file.check_spelled(args)
        apply_launcher_args(args)
        if getattr(args, "dist_timeout_s", None) is not None:
            watchdog.resolve_timeout_s(args.dist_timeout_s, "cpu")  # > 0, before anything is loaded
        written = config_file.write_resolved(args, p, entry)  # where the run's folder already exists (a relaunch)
        run(args)
        if written is None:
            config_file.write_resolved(args, p, entry)  # beside what the run made
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
