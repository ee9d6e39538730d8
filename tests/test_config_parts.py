"""The typed configuration parts (issue 43 item 1): every flag of each training entry point belongs to exactly one
part of its job or to the launchers' part that ``cli_main`` applies first (no flag outside a part, none in two), each
part built from the parsed defaults holds the parser's defaults, every field holds a non-default value of the flag its
docstring names (so a field wired to another flag with an equal default fails), ``Job.namespace()`` is the parts'
values flat, and a part's own check raises ``ValueError`` naming the flag. Cheap: parsers and dataclasses only."""
from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from rlhf.config.migration import LauncherPart
from rlhf.config.part import Part


def _ppo():
    from rlhf.ppo.args import PPOJobConfig, add_args

    return add_args, list(PPOJobConfig.part_types().values()) + [LauncherPart], ["--pretrain", "m", "--prompt_data", "d",
                                                                 "--save_path", "o", "--reward_fn", "m:f"]


def _supervised(name: str):
    import importlib

    from rlhf.config.job import SupervisedJob

    mod = importlib.import_module(f"rlhf.supervised.{name}")
    parts = list(SupervisedJob.part_types().values()) + list(mod.TASK_PARTS.values()) + [LauncherPart]
    return mod.add_args, parts, ["--pretrain", "m", "--dataset", "d", "--save_path", "o"]


JOBS = {"ppo": _ppo, **{n: (lambda n=n: _supervised(n)) for n in ("sft", "rm", "dpo", "kto")}}


def _parser(add_args) -> argparse.ArgumentParser:
    """What ``rlhf.config.job.cli_main`` parses: the entry point's flags and the launchers'."""
    p = argparse.ArgumentParser()
    add_args(p)
    LauncherPart.add_args(p)
    return p


def _dests(p: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in p._actions if not isinstance(a, argparse._HelpAction)}


def ownership(dests: set[str], parts: list[type[Part]]) -> tuple[list[str], dict[str, list[str]], dict[str, list]]:
    """(flags no part owns, flags two parts own, part -> fields whose flag the parser lacks)."""
    owners: dict[str, list[str]] = {}
    for part in parts:
        for d in part.flag_dests():
            owners.setdefault(d, []).append(part.__name__)
    orphans = sorted(dests - set(owners))
    doubles = {d: o for d, o in owners.items() if len(o) > 1}
    missing = {part.__name__: sorted(part.flag_dests() - dests) for part in parts if part.flag_dests() - dests}
    return orphans, doubles, missing


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_flag_belongs_to_one_part(job):
    add_args, parts, _ = JOBS[job]()
    assert len(set(parts)) == len(parts), f"{job}: a part listed twice"
    orphans, doubles, missing = ownership(_dests(_parser(add_args)), parts)
    assert not orphans, f"{job}: flags in no part: {orphans}"
    assert not doubles, f"{job}: flags in two parts: {doubles}"
    assert not missing, f"{job}: part fields without a flag (list them in DERIVED): {missing}"


def test_an_orphan_flag_and_a_shared_one_are_found():
    add_args, parts, _ = JOBS["ppo"]()
    p = _parser(add_args)
    p.add_argument("--not_in_any_part", type=int, default=0)
    orphans, doubles, _ = ownership(_dests(p), parts)
    assert orphans == ["not_in_any_part"]
    assert not doubles
    from rlhf.config.parts import BatchPart

    _, doubles, _ = ownership(_dests(p), parts + [BatchPart])  # PPOBatch already owns the batch flags
    assert set(doubles) == {"train_batch_size", "micro_train_batch_size", "max_epochs"}
    _, _, missing = ownership(_dests(p) - {"seed"}, parts)
    assert missing == {"EnginePart": ["seed"]}


@pytest.mark.parametrize("job", sorted(JOBS))
def test_parts_hold_the_parsed_defaults(job, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").write_text("{}\n")  # --prompt_data / --dataset must exist
    add_args, parts, required = JOBS[job]()
    ns = _parser(add_args).parse_args(required)
    for part_cls in parts:
        part = part_cls.from_args(ns)
        for f in fields(part):
            if not f.init or f.name in part_cls.DERIVED:
                continue
            dest = part_cls.DESTS.get(f.name, f.name)
            got = getattr(part, f.name)
            assert got == getattr(ns, dest), f"{job}: {part_cls.__name__}.{f.name} = {got!r}, flag {getattr(ns, dest)!r}"


def test_from_args_is_strict():
    from rlhf.config.parts import ParallelPart

    with pytest.raises(TypeError, match="ParallelPart.pipeline_model_parallel_size"):
        ParallelPart.from_args(argparse.Namespace(tensor_model_parallel_size=1))
    full = argparse.Namespace(**{f.name: f.default for f in fields(ParallelPart)})
    with pytest.raises(TypeError, match="no fields"):
        ParallelPart.from_args(full, not_a_field=1)


def _bad_parts():
    from rlhf.config.job import DataPart, SupervisedBatch
    from rlhf.supervised.dpo import DPOPart
    from rlhf.supervised.kto import KTOPart
    from rlhf.models.routing_replay import RouterReplayPart
    from rlhf.config.parts import BatchPart, EnginePart
    from rlhf.ppo.algo_args import AlgoPart
    from rlhf.ppo.ema import EmaPart
    from rlhf.ppo.evaluation import EvalConfig
    from rlhf.ppo.parts import GenerationPart, OffloadPart, PPOBatch, PPOLogging, PPOLora, PPOOptim, RolloutPart
    from rlhf.ppo.ptx import PtxPart
    from rlhf.supervised.reference import ReferencePart

    return [
        (lambda: BatchPart(micro_train_batch_size=0), "--micro_train_batch_size must be >= 1, got 0"),
        (lambda: PPOBatch(rollout_batch_size=0), "--rollout_batch_size must be >= 1, got 0"),
        (lambda: SupervisedBatch(max_len=4), "--max_len must be >= 8, got 4"),
        (lambda: EnginePart(zero_stage=7), "--zero_stage must be 0..3, got 7"),
        (lambda: DataPart(eval_split=1.5), r"--eval_split must be in \[0, 1\), got 1.5"),
        (lambda: GenerationPart(temperature=0.0), "--temperature must be > 0 for sampling, got 0.0"),
        (lambda: GenerationPart(top_p=1.5), r"--top_p must be in \(0, 1\], got 1.5"),
        (lambda: AlgoPart(dynamic_filtering=True, dynamic_filtering_range=(1.0, 0.5)),
         "--dynamic_filtering_range 1 0.5: LO must be below HI"),
        (lambda: AlgoPart(reward_clip_range=(2.0, 1.0)), "--reward_clip_range 2 1: LOW must be below HIGH"),
        (lambda: EmaPart(enable_ema=True, ema_beta=2.0), r"--ema_beta must be in \[0, 1\], got 2.0"),
        (lambda: PtxPart(pretrain_data="/no/such/texts.jsonl"), "--pretrain_data: not found"),
        (lambda: PtxPart(pretrain_data="README.md", ptx_coef=-1.0), "--ptx_coef must be >= 0, got -1.0"),
        (lambda: OffloadPart(colocate_all=False), "--no-colocate_all"),
        (lambda: RolloutPart(vllm_tensor_parallel_size=0), "--vllm_tensor_parallel_size must be >= 1, got 0"),
        (lambda: PPOLogging(logging_steps=0), "--logging_steps must be >= 1, got 0"),
        (lambda: PPOOptim(critic_l2=-1.0), "--critic_l2 must be >= 0, got -1.0"),
        (lambda: PPOLora(critic_lora_rank=-2), r"--critic_lora_rank must be >= 0 \(0: full fine-tuning\), got -2"),
        (lambda: EvalConfig(dataset="README.md", n_samples_per_prompt=0),
         "--eval_n_samples_per_prompt must be >= 1, got 0"),
        (lambda: ReferencePart(beta=0.0), "--beta must be > 0, got 0.0"),
        (lambda: DPOPart(loss_type="cdpo"), r"--label_smoothing must be in \(0, 0.5\) for --loss_type cdpo"),
        (lambda: KTOPart(undesirable_loss_weight=0.0), "--undesirable_loss_weight must be > 0, got 0.0"),
        (lambda: RouterReplayPart(moe_router_replay="R4"), "--moe_router_replay 'R4': expected one of off"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_parts())))
def test_a_part_check_names_its_flag(case, monkeypatch):
    import os

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # README.md exists
    make, message = _bad_parts()[case]
    with pytest.raises(ValueError, match=message):
        make().check()


# ------------------------------------------------------------------------------------------------- every field read
def _field_flags(part_cls: type[Part]) -> dict[str, str]:
    """field -> the option string its docstring names (``\"\"\"(--flag) ...`` or ``\"\"\"--flag ...``), read from the source: the flag a
    reader of the part takes the field for, independent of the wiring (``DESTS``, argparse's ``dest=``)."""
    import inspect
    import re

    out: dict[str, str] = {}
    for klass in reversed(part_cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, Part)) or klass is Part:
            continue
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        # a field's line, its continuation lines (a multi-line ``flag(...)``), then its docstring
        for m in re.finditer(r"^    (\w+): [^\n]+(?:\n {5,}[^\n]*)*\n    [rR]?\"\"\"\(?(--[\w.-]+)", src, re.M):
            out[m.group(1)] = m.group(2)
    return out


def _nondefault(action: argparse.Action, options: list[str]) -> list[list[str]]:
    """Command lines that set ``action``'s flag to a value other than its default (tried in order)."""
    flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
    d = action.default
    if isinstance(action, argparse.BooleanOptionalAction):
        return [[f"--no-{flag[2:]}"] if d else [flag]]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)):
        return [[flag]]
    n = action.nargs if isinstance(action.nargs, int) else 2 if action.nargs in ("+", "*") else 1
    if action.choices:
        return [[flag, *[str(c)] * n] for c in action.choices if c != d and [c] * n != d]
    if action.type is int:
        return [[flag, *[str((d if isinstance(d, int) else 0) + 3 + i) for i in range(n)]]]
    if action.type is float:
        return [[flag, *[repr(0.37 + 0.11 * i) for i in range(n)]]]
    return [[flag, *[v] * n] for v in ("nondefault_value", "x:y", "3", "0.37", "a,b")]


CONTEXT = {"--reward_weights": ["--reward_pretrain", "rm"]}
"""flags whose non-default value needs another flag set (checked where the part is built)"""


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_part_field_reads_its_own_flag(job, tmp_path, monkeypatch):
    """Each field of each part, with its flag (the one its docstring names, else ``--<field>``) set to a value other
    than the default and every other flag left alone, holds that value: a field wired to another flag (a wrong
    ``DESTS`` entry or ``dest=``) keeps the other flag's default and fails, even where the two defaults are equal.
    The parts' own checks are off here (a value only has to differ); they have their own tests below."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").write_text("{}\n")
    add_args, parts, required = JOBS[job]()
    p = _parser(add_args)
    by_option = {o: a for a in p._actions for o in a.option_strings}
    unread, wrong = [], []
    for part_cls in parts:
        monkeypatch.setattr(part_cls, "check", lambda self: None)
        named = _field_flags(part_cls)
        for f in fields(part_cls):
            if not f.init or f.name in part_cls.DERIVED:
                continue
            action = by_option.get(named.get(f.name, f"--{f.name}"))
            if action is None:
                unread.append(f"{part_cls.__name__}.{f.name} (no flag {named.get(f.name, '--' + f.name)})")
                continue
            got, why = None, "no non-default value found"
            for argv in _nondefault(action, list(action.option_strings)):
                argv = CONTEXT.get(action.option_strings[0], []) + argv
                try:
                    ns = p.parse_args(required + argv)
                except SystemExit:
                    continue
                if getattr(ns, action.dest) == action.default:
                    continue
                try:
                    got = getattr(part_cls.from_args(ns), f.name)
                    break
                except ValueError as e:  # a check outside ``check`` (``__post_init__``): the next value
                    why = str(e)
            else:
                unread.append(f"{part_cls.__name__}.{f.name} ({action.option_strings}): {why}")
                continue
            if got != getattr(ns, action.dest):
                wrong.append(f"{part_cls.__name__}.{f.name} = {got!r} with {' '.join(argv)}")
    assert not wrong, f"{job}: fields that do not read their flag: {wrong}"
    assert not unread, f"{job}: fields not checked: {unread}"


def test_job_namespace_is_the_parts_flat(tmp_path, monkeypatch):
    """``Job.namespace()`` (what the ranks' consistency check, the logged configuration and the HF export read): one
    entry per flag any part owns, holding the part's value, plus the values the checks resolve (``RESOLVED``).
    Non-default values in several parts, two of them behind ``DESTS`` (--eval_temperature, --eval_steps)."""
    from rlhf.ppo.args import PPOJobConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").write_text("{}\n")
    add_args, _, required = JOBS["ppo"]()
    ns = _parser(add_args).parse_args(required + [
        "--actor_learning_rate", "3e-6", "--temperature", "0.7", "--eval_temperature", "0.9", "--eval_steps", "5",
        "--critic_l2", "0.01", "--n_samples_per_prompt", "4", "--max_staleness", "2", "--tp", "2",
        "--moe_router_replay", "R3"])
    job = PPOJobConfig.from_args(ns)
    out = vars(job.namespace())
    owned = set().union(*(t.flag_dests() for t in PPOJobConfig.part_types().values()))
    resolved = {r for part in job.parts() for r in part.RESOLVED}
    assert set(out) == owned | resolved, (set(out) ^ (owned | resolved))
    assert {d: out[d] for d in owned if out[d] != getattr(ns, d)} == {"moe_router_replay": "rollout"}  # R3's name
    assert (out["eval_temperature"], out["eval_steps"], out["temperature"], out["tensor_model_parallel_size"]) == \
        (0.9, 5, 0.7, 2)
    for name in resolved:
        assert out[name] == next(getattr(p, name) for p in job.parts() if name in p.RESOLVED)


# A flag whose value fills a component's own configuration takes its default from that configuration, written once
# there (``rlhf.config.part.config_default``); a literal in the part is the second definition this rules out.
SHARED_DEFAULTS = {
    "rlhf.config.parts:OptimPart": {
        "l2": "OptimConfig.weight_decay", "adam_betas": "OptimConfig.adam_betas", "max_norm": "OptimConfig.clip_grad",
        "lr_warmup_ratio": "OptimConfig.warmup_ratio", "aux_loss_coef": "OptimConfig.aux_loss_coef",
        "moe_router_bias_update_rate": "OptimConfig.expert_bias_update_rate",
        "max_skipped_steps": "OptimConfig.max_skipped_steps"},
    "rlhf.config.parts:TextPart": {
        "input_template": "DataConfig.input_template", "apply_chat_template": "DataConfig.apply_chat_template",
        "skip_bad_samples": "DataConfig.skip_bad_samples", "dataset_format": "DataConfig.dataset_format"},
    "rlhf.config.parts:KeysPart": {k: f"DataConfig.{k}" for k in
                                   ("prompt_key", "chosen_key", "rejected_key", "input_key", "output_key")},
    "rlhf.config.parts:SamplingPart": {"prompt_max_len": "DataConfig.prompt_max_len"},
    "rlhf.config.parts:GeneratorPart": {"rollout_backend": "RolloutConfig.backend"},
    "rlhf.ppo.parts:RolloutPart": {
        "rollout_backend": "RolloutConfig.backend", "vllm_num_engines": "RolloutConfig.num_engines",
        "vllm_enforce_eager": "RolloutConfig.enforce_eager",
        "vllm_enable_prefix_caching": "RolloutConfig.enable_prefix_caching",
        "weight_sync_bucket_mb": "RolloutConfig.weight_sync_bucket_mb"},
    "rlhf.models.lora:LoraPart": {
        "lora_alpha": "LoraConfig.alpha", "target_modules": "LoraConfig.target_modules",
        "lora_dropout": "LoraConfig.dropout"},
}


@pytest.mark.parametrize("where", sorted(SHARED_DEFAULTS))
def test_flags_take_their_defaults_from_the_configs_they_fill(where):
    import importlib

    from rlhf.data.config import DataConfig
    from rlhf.models.lora import LoraConfig
    from rlhf.rollout.types import RolloutConfig
    from rlhf.runtime.role import OptimConfig

    mod, name = where.split(":")
    part = getattr(importlib.import_module(mod), name)
    got = {f.name: f.metadata.get("default_from") for f in fields(part) if f.metadata.get("default_from")}
    assert got == SHARED_DEFAULTS[where], f"{name}: the flags whose default is a component config's"
    owners = {c.__name__: c for c in (DataConfig, LoraConfig, OptimConfig, RolloutConfig)}
    for f in fields(part):
        if f.name in got:
            owner, field_name = got[f.name].split(".")
            assert f.default == owners[owner].__dataclass_fields__[field_name].default
