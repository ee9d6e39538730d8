"""Flags users bring from the seed systems' launchers and Ray placement, accepted where they mean something in
one colocated SPMD job and refused with the replacement command where they do not.

* ``--local-rank=N`` (``python -m torch.distributed.launch``) and ``--local_rank N`` (the DeepSpeed launcher):
  every entry point accepts them; the environment (``LOCAL_RANK``) decides, the flag only fills it when absent.
* ``--num_nodes`` x ``--num_gpus_per_node`` (AIAK-RLHF): checked against the job's world size.
* OpenRLHF's per-role placement (PPO): ``--{actor,critic,ref,reward}_num_nodes`` / ``_num_gpus_per_node`` must
  describe the whole job (every role is on every rank here); ``--colocate_actor_ref``,
  ``--colocate_critic_reward`` are what this trainer always does.
"""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

from rlhf.config.part import Part, flag

log = logging.getLogger(__name__)

ROLES = ("actor", "critic", "ref", "reward")


@dataclass
class LauncherPart(Part):
    """Flags that launchers of the seed systems add; every entry point takes them (``rlhf.config.job.cli_main``) and
    ``apply_launcher_args`` acts on them before anything else."""

    GROUP = "launchers (compatibility)"

    local_rank: int | None = flag("--local-rank", "--local_rank", dest="local_rank", type=int, default=None,
                                  help="added by torch.distributed.launch / deepspeed; LOCAL_RANK in the environment "
                                       "wins")
    """(--local-rank, --local_rank) torch.distributed.launch / deepspeed; LOCAL_RANK wins"""
    num_nodes: int | None = flag(type=int, default=None, help="AIAK-RLHF: nodes of the job (checked)")
    """(--num_nodes) AIAK-RLHF: nodes of the job (checked)"""
    num_gpus_per_node: int | None = flag(type=int, default=None, help="AIAK-RLHF: ranks per node (checked)")
    """(--num_gpus_per_node) AIAK-RLHF: ranks per node (checked)"""


add_launcher_args = LauncherPart.add_args


@dataclass
class PlacementPart(Part):
    """OpenRLHF's Ray placement flags (PPO), hidden: checked, then every role is on every rank."""

    actor_num_nodes: int | None = flag(type=int, help=argparse.SUPPRESS, default=None)
    actor_num_gpus_per_node: int | None = flag(type=int, help=argparse.SUPPRESS, default=None)
    critic_num_nodes: int | None = flag(type=int, help=argparse.SUPPRESS, default=None)
    critic_num_gpus_per_node: int | None = flag(type=int, help=argparse.SUPPRESS, default=None)
    ref_num_nodes: int | None = flag(type=int, help=argparse.SUPPRESS, default=None)
    ref_num_gpus_per_node: int | None = flag(type=int, help=argparse.SUPPRESS, default=None)
    reward_num_nodes: int | None = flag(type=int, help=argparse.SUPPRESS, default=None)
    reward_num_gpus_per_node: int | None = flag(type=int, help=argparse.SUPPRESS, default=None)
    colocate_actor_ref: bool = flag(action="store_true", help=argparse.SUPPRESS, default=False)
    colocate_critic_reward: bool = flag(action="store_true", help=argparse.SUPPRESS, default=False)



add_placement_args = PlacementPart.add_args


def _relaunch(nodes: int, per_node: int) -> str:
    return (f"torchrun --nnodes {nodes} --nproc_per_node {per_node} launch/<entry>.py ... (Slurm: srun -N {nodes} "
            f"--ntasks-per-node {per_node} ...)")


def apply_launcher_args(args: argparse.Namespace, environ: dict | None = None) -> None:
    """Before anything else: the launcher's local rank into the environment when it has none, and the node
    counts against the world size. ValueError naming the flag otherwise."""
    from rlhf.distributed.env import DistEnv

    environ = os.environ if environ is None else environ
    local_rank = getattr(args, "local_rank", None)
    if local_rank is not None:
        if "LOCAL_RANK" not in environ:
            environ["LOCAL_RANK"] = str(local_rank)
        log.debug("--local-rank %d ignored in favour of LOCAL_RANK=%s", local_rank, environ["LOCAL_RANK"])
    world = DistEnv.from_environ(environ).world_size
    nodes, per_node = getattr(args, "num_nodes", None), getattr(args, "num_gpus_per_node", None)
    for flag, v in (("--num_nodes", nodes), ("--num_gpus_per_node", per_node)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    local_world = int(environ.get("LOCAL_WORLD_SIZE", 0)) or None
    if nodes is not None and per_node is not None:
        ok = nodes * per_node == world
    elif nodes is not None:
        ok = world % nodes == 0
    elif per_node is not None:
        ok = per_node == local_world if local_world else world % per_node == 0
    else:
        ok = True
    if not ok:
        n = nodes or max(world // (per_node or world), 1)
        raise ValueError(f"--num_nodes {nodes} --num_gpus_per_node {per_node} do not match this job's {world} ranks"
                         f"{f' ({local_world} per node)' if local_world else ''}: the launcher decides the ranks; "
                         f"start it with {_relaunch(n, per_node or max(world // n, 1))}")
    _check_role_placement(args, world)


def _check_role_placement(args: argparse.Namespace, world: int) -> None:
    given = {r: (getattr(args, f"{r}_num_nodes", None), getattr(args, f"{r}_num_gpus_per_node", None))
             for r in ROLES}
    for role, (nodes, per_node) in given.items():
        if nodes is None and per_node is None:
            continue
        n, g = nodes or 1, per_node or 1
        if n * g != world:
            raise ValueError(f"--{role}_num_nodes {nodes} --{role}_num_gpus_per_node {per_node}: this trainer is one "
                             f"colocated SPMD job in which every role (actor, critic, reference, reward, vLLM) runs on "
                             f"all {world} ranks; there are no Ray placement groups. Drop the placement flags and "
                             f"start the job on the GPUs you want, e.g. {_relaunch(n, g)}")
        log.info("--%s_num_nodes/--%s_num_gpus_per_node: %d rank(s), the whole job (every role is colocated)", role,
                 role, n * g)
    for flag in ("colocate_actor_ref", "colocate_critic_reward"):
        if getattr(args, flag, False):
            log.info("--%s: every role already shares every rank here (--colocate_all)", flag)


# ------------------------------------------------------------------------------------------------ DeepSpeed-Chat
DSCHAT_ENTRY = {1: "sft", 2: "rm", 3: "ppo"}
_DSCHAT_NOT_HERE = {
    "--offload": "ZeRO-Offload of the trained model: use --dtype bf16 and more ranks (PPO: --adam_offload)",
    "--dropout": "dropout is taken from the model's config",
    "--actor_dropout": "dropout is taken from the model's config",
    "--critic_dropout": "dropout is taken from the model's config",
    "--lora_module_name": "LoRA targets are all linear layers (--target_modules in our flags)",
    "--actor_lora_module_name": "LoRA targets are all linear layers (--target_modules in our flags)",
    "--critic_lora_module_name": "LoRA targets are all linear layers (--target_modules in our flags)",
    "--lora_learning_rate": "LoRA adapters train at --learning_rate",
    "--enable_mixed_precision_lora": "not implemented",
    "--compute_fp32_loss": "losses are always computed in fp32 here",
    "--add_eot_token": "the tokenizer's EOS ends every sample here",
    "--end_of_conversation_token": "the tokenizer's EOS ends every sample here",
}
# flags that change nothing here (said once in the log)
_DSCHAT_NOOPS = ("--per_device_eval_batch_size", "--print_loss", "--print_answers", "--only_optimize_lora",
                 "--enable_hybrid_engine", "--release_inference_cache", "--tp_gather_partition_size",
                 "--preprocessing_num_workers", "--num_padding_at_beginning", "--eval_interval", "--eval_iters")


def dschat_parser(step: int) -> argparse.ArgumentParser:
    """DeepSpeed-Chat's flags for ``step`` (its training/step{1,2,3}_*/main.py), with its defaults."""
    p = argparse.ArgumentParser(prog=f"launch/dschat.py --step {step}", allow_abbrev=False)
    a = p.add_argument
    a("--data_path", nargs="*", default=["Dahoas/rm-static"])
    a("--data_split", default="2,4,4")
    a("--data_output_path", default="/tmp/data_files/")
    a("--output_dir", required=True)
    a("--seed", type=int, default=1234)
    a("--local_rank", "--local-rank", type=int, default=-1)
    a("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"])
    a("--gradient_accumulation_steps", type=int, default=1)
    a("--num_train_epochs", type=int, default=1)
    a("--lr_scheduler_type", default="cosine")
    a("--num_warmup_steps", type=int, default=0)
    a("--enable_tensorboard", action="store_true")
    a("--tensorboard_path", default="step_tensorboard")
    for flag in (*_DSCHAT_NOT_HERE, *_DSCHAT_NOOPS):
        a(flag, default=None, nargs="?", const=True)
    if step in (1, 2):
        a("--model_name_or_path", required=True)
        a("--per_device_train_batch_size", type=int, default=16)
        a("--max_seq_len", type=int, default=512)
        a("--learning_rate", type=float, default=1e-3)
        a("--weight_decay", type=float, default=0.0)
        a("--gradient_checkpointing", action="store_true")
        a("--zero_stage", type=int, default=0)
        a("--lora_dim", type=int, default=0)
    else:
        for k in ("--actor_model_name_or_path", "--critic_model_name_or_path"):
            a(k, required=True)
        a("--unsupervised_dataset_name", default=None)
        a("--unsupervised_dataset_config_name", default=None)
        a("--unsup_coef", type=float, default=27.8)
        for k, v in (("--per_device_generation_batch_size", 16), ("--per_device_training_batch_size", 16),
                     ("--generation_batches", 1), ("--ppo_epochs", 1), ("--max_answer_seq_len", 256),
                     ("--max_prompt_seq_len", 256), ("--actor_zero_stage", 0), ("--critic_zero_stage", 0),
                     ("--inference_tp_size", 1), ("--actor_lora_dim", 0), ("--critic_lora_dim", 0)):
            a(k, type=int, default=v)
        for k, v in (("--actor_learning_rate", 9.65e-6), ("--critic_learning_rate", 5e-6),
                     ("--actor_weight_decay", 0.0), ("--critic_weight_decay", 0.0)):
            a(k, type=float, default=v)
        for k in ("--offload_reference_model", "--actor_gradient_checkpointing", "--critic_gradient_checkpointing",
                  "--enable_ema"):
            a(k, action="store_true")
    return p


def _dschat_refuse(ds: argparse.Namespace) -> None:
    for flag, why in _DSCHAT_NOT_HERE.items():
        if getattr(ds, flag[2:]) is not None:
            raise ValueError(f"{flag}: {why} (launch/dschat.py maps DeepSpeed-Chat's flags onto launch/"
                             f"{{sft,rm,ppo}}.py; drop the flag)")
    used = [f for f in _DSCHAT_NOOPS if getattr(ds, f[2:]) is not None]
    if used:
        log.info("DeepSpeed-Chat flags that change nothing here: %s", ", ".join(used))
    if ds.dtype == "fp16":
        raise ValueError("--dtype fp16: fp16 mixed precision is not supported here; use --dtype bf16 (or fp32)")


def split_parts(n: int, split: str, seed: int) -> list[list[int]]:
    """DeepSpeed-Chat's ``--data_split``: the rows shuffled with ``np.random.RandomState(seed)``, then cut into
    consecutive parts in the given proportions (part k feeds step k + 1)."""
    import numpy as np

    weights = [float(x) for x in split.split(",")]
    if len(weights) != 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--data_split must be three non-negative numbers like 2,4,4, got {split!r}")
    idx = np.arange(n)
    np.random.RandomState(seed=seed).shuffle(idx)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / sum(weights) * n)))
    bounds[-1] = n
    return [idx[bounds[k]:bounds[k + 1]].tolist() for k in range(3)]


def prepare_dschat_data(ds: argparse.Namespace, step: int) -> tuple[str, int]:
    """Each ``--data_path`` dataset (a local path or a Hub name in the local HF cache; its layout through
    ``rlhf.data.presets``) split by ``--data_split``; this step's part of each written as prompt/chosen/rejected
    jsonl under ``--data_output_path``. Returns (our --dataset value, rows)."""
    import json
    import tempfile

    from rlhf.data.config import DataConfig
    from rlhf.data.presets import apply
    from rlhf.data.sources import parse_dataset_flag, read_source

    keys = DataConfig(dataset="x", prompt_key="prompt", input_key="prompt", output_key="chosen")
    os.makedirs(ds.data_output_path, exist_ok=True)
    files, total = [], 0
    for i, spec in enumerate(parse_dataset_flag(ds.data_path)):
        rows = [r.data for r in apply("auto", spec.path, read_source(spec), keys) if r.data is not None]
        part = split_parts(len(rows), ds.data_split, ds.seed)[step - 1]
        path = os.path.join(ds.data_output_path, f"step{step}_{i}_{os.path.basename(spec.path.rstrip('/'))}.jsonl")
        # every rank of the job writes this same file: each its own whole copy under a name of its own, then a rename
        fd, tmp = tempfile.mkstemp(dir=ds.data_output_path, prefix=os.path.basename(path) + ".", suffix=".tmp")
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            for j in part:
                f.write(json.dumps({k: rows[j].get(k) for k in ("prompt", "chosen", "rejected")}) + "\n")
        os.replace(tmp, path)
        files.append(path)
        total += len(part)
    if not total:
        raise ValueError(f"--data_split {ds.data_split}: step {step}'s part of --data_path is empty")
    return ",".join(files), total


def dschat_to_ours(step: int, argv: list[str], world_size: int) -> list[str]:
    """Our flags for DeepSpeed-Chat's step ``step`` command line (after preparing its data split)."""
    ds = dschat_parser(step).parse_args(argv)
    _dschat_refuse(ds)
    dataset, rows = prepare_dschat_data(ds, step)
    common = ["--dataset" if step < 3 else "--prompt_data", dataset, "--seed", str(ds.seed),
              "--lr_scheduler", ds.lr_scheduler_type] + (["--bf16"] if ds.dtype == "bf16" else []) + \
             (["--tensorboard", ds.tensorboard_path] if ds.enable_tensorboard else [])
    if step in (1, 2):
        global_batch = ds.per_device_train_batch_size * ds.gradient_accumulation_steps * world_size
        steps = max(rows // global_batch, 1) * ds.num_train_epochs
        out = ["--pretrain", ds.model_name_or_path, "--save_path", ds.output_dir, "--micro_train_batch_size",
               str(ds.per_device_train_batch_size), "--train_batch_size", str(global_batch), "--max_len",
               str(ds.max_seq_len), "--learning_rate", str(ds.learning_rate), "--l2", str(ds.weight_decay),
               "--max_epochs", str(ds.num_train_epochs), "--lr_warmup_ratio", str(min(ds.num_warmup_steps / steps, 1)),
               "--zero_stage", str(ds.zero_stage), "--lora_rank", str(ds.lora_dim), "--prompt_key", "prompt",
               "--chosen_key", "chosen", "--rejected_key", "rejected"]
        out += ["--input_key", "prompt", "--output_key", "chosen"] if step == 1 else []
        return out + (["--gradient_checkpointing"] if ds.gradient_checkpointing else []) + common
    return _dschat_ppo(ds, world_size, rows) + common


def _unsup_path(ds: argparse.Namespace) -> str:
    """--unsupervised_dataset_name [--unsupervised_dataset_config_name]: a local folder or a cached Hub name, and
    the config's subfolder inside it."""
    from rlhf.data.sources import DatasetSpec, local_path

    path = ds.unsupervised_dataset_name
    if ds.unsupervised_dataset_config_name:
        sub = os.path.join(local_path(DatasetSpec(path)), ds.unsupervised_dataset_config_name)
        if not os.path.isdir(sub):
            raise ValueError(f"--unsupervised_dataset_config_name {ds.unsupervised_dataset_config_name}: no such "
                             f"folder in {path} ({sub})")
        return sub
    return path


def _dschat_ppo(ds: argparse.Namespace, world: int, rows: int) -> list[str]:
    if ds.actor_weight_decay != ds.critic_weight_decay:
        raise ValueError(f"--actor_weight_decay {ds.actor_weight_decay} and --critic_weight_decay "
                         f"{ds.critic_weight_decay}: one --l2 for both roles here; make them equal")
    gen = ds.per_device_generation_batch_size * world * ds.generation_batches
    train = ds.per_device_training_batch_size * ds.gradient_accumulation_steps * world
    steps = max(rows // gen, 1) * ds.num_train_epochs
    out = ["--pretrain", ds.actor_model_name_or_path, "--reward_pretrain", ds.critic_model_name_or_path,
           "--critic_pretrain", ds.critic_model_name_or_path, "--save_path", os.path.join(ds.output_dir, "actor"),
           "--input_key", "prompt", "--rollout_batch_size", str(gen), "--n_samples_per_prompt", "1",
           "--micro_rollout_batch_size", str(ds.per_device_generation_batch_size), "--train_batch_size", str(train),
           "--micro_train_batch_size", str(ds.per_device_training_batch_size), "--max_epochs", str(ds.ppo_epochs),
           "--num_episodes", str(ds.num_train_epochs), "--generate_max_len", str(ds.max_answer_seq_len),
           "--prompt_max_len", str(ds.max_prompt_seq_len), "--actor_learning_rate", str(ds.actor_learning_rate),
           "--critic_learning_rate", str(ds.critic_learning_rate), "--l2", str(ds.actor_weight_decay),
           "--zero_stage", str(max(ds.actor_zero_stage, ds.critic_zero_stage)), "--lora_rank", str(ds.actor_lora_dim),
           "--critic_lora_rank", str(ds.critic_lora_dim), "--vllm_tensor_parallel_size", str(ds.inference_tp_size),
           "--lr_warmup_ratio", str(min(ds.num_warmup_steps / steps, 1)),
           # DeepSpeed-Chat's PPO constants (its ppo_trainer.py): KL 0.1, clip 0.2 / 0.2, gamma 1, lambda 0.95
           "--init_kl_coef", "0.1", "--eps_clip", "0.2", "--value_clip", "0.2", "--gamma", "1.0", "--lambd", "0.95"]
    if ds.offload_reference_model:
        out.append("--ref_reward_offload")
    if ds.enable_ema:  # DeepSpeed-Chat's EMA coefficient
        out += ["--enable_ema", "--ema_beta", "0.992"]
    if ds.unsupervised_dataset_name:  # PPO-ptx
        out += ["--pretrain_data", _unsup_path(ds), "--ptx_coef", str(ds.unsup_coef)]
    if ds.actor_gradient_checkpointing or ds.critic_gradient_checkpointing:
        out.append("--gradient_checkpointing")
    return out
