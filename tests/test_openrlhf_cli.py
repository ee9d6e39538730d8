"""OpenRLHF's command lines of today (its dotted flags; rlhf/config/openrlhf.py): the flag lines of its own example
scripts (examples/scripts/train_*.sh at 3c3be6234e0c, tests/peers/openrlhf/example_commands.json) parse with our
entry points' parsers, only the launcher changed, into the values they name; the flags without a meaning here are
refused by name; a misspelled flag still fails (the control)."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex

import pytest

from helpers import REPO

EXAMPLES = json.load(open(os.path.join(REPO, "tests", "peers", "openrlhf", "example_commands.json")))
ENTRY = {"train_sft": "rlhf.supervised.sft", "train_rm": "rlhf.supervised.rm", "train_dpo": "rlhf.supervised.dpo",
         "train_ppo_ray": "rlhf.ppo.args"}

REFUSED: dict[str, str] = {}
"""Scripts whose settings have no counterpart here: refused before anything runs, naming the flag and why."""


def flag_line(command: str, cli: str) -> list[str]:
    """The arguments after ``-m openrlhf.cli.<cli>``, shell variables replaced by placeholders."""
    command = re.sub(r"\$\{?(\w+)\}?", lambda m: f"/tmp/{m.group(1).lower()}", command)
    tail = command.split(f"openrlhf.cli.{cli}", 1)[1]
    tail = tail.split('"', 1)[0] if tail.count('"') % 2 else tail  # the end of a bash -c "..." string
    return shlex.split(tail.split("&>>")[0])


def parse(cli: str, argv: list[str]) -> argparse.Namespace:
    """What rlhf.config.job.cli_main does before running: the entry point's parser, the launcher flags, translate."""
    from rlhf.config.migration import add_launcher_args
    from rlhf.config.openrlhf import entry_name, translate

    mod = importlib.import_module(ENTRY[cli])
    p = argparse.ArgumentParser()
    mod.add_args(p)
    add_launcher_args(p)
    return p.parse_args(translate(argv, entry_name(ENTRY[cli]), set(p._option_string_actions)))


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_openrlhf_example_scripts_parse(script):
    ex = EXAMPLES[script]
    argv = flag_line(ex["command"], ex["cli"])
    assert len(argv) > 15, argv
    refused = REFUSED.get(os.path.basename(script))
    if refused:
        with pytest.raises(ValueError, match=re.escape(refused)):
            parse(ex["cli"], argv)
        return
    args = parse(ex["cli"], argv)
    given = dict(zip(argv, argv[1:]))
    if "--ds.ring_attn_size" in given:  # ring attention is context parallelism here
        assert args.context_parallel_size == int(given["--ds.ring_attn_size"])
    if ex["cli"] == "train_ppo_ray":
        assert args.pretrain == given["--actor.model_name_or_path"]
        assert args.rollout_batch_size == int(given["--rollout.batch_size"])
        assert args.actor_learning_rate == float(given["--actor.adam.lr"])
        assert args.bf16 == (given.get("--ds.param_dtype") == "bf16")
    else:
        assert args.pretrain == given["--model.model_name_or_path"]
        assert args.learning_rate == float(given["--adam.lr"])
        assert args.train_batch_size == int(given["--train.batch_size"])
        assert args.micro_train_batch_size == int(given["--train.micro_batch_size"])
        assert args.save_path == given["--ckpt.output_dir"]
    if "--ds.packing_samples" in argv:
        assert args.packing_samples
    if "--data.image_key" in argv:  # a vision-language model's prompts (train_vlm_math_hybrid_engine.sh)
        assert args.image_key == given["--data.image_key"]
        assert args.max_images_per_prompt == int(given["--data.max_images_per_prompt"])
        assert args.freeze_vision_tower == ("--actor.freeze_visual_encoder" in argv)
    if "--algo.advantage.is_correction_enable" in argv:  # OpenRLHF's bounds 0.5 5.0 unless given
        lo, hi = (given["--algo.advantage.is_correction_threshold"], argv[argv.index(
            "--algo.advantage.is_correction_threshold") + 2]) if "--algo.advantage.is_correction_threshold" in argv \
            else ("0.5", "5.0")
        assert (args.use_tis, args.tis_floor, args.tis_cap) == (True, float(lo), float(hi))
        assert args.is_correction_type == given.get("--algo.advantage.is_correction_type", "tis")
    if "--train.async_enable" in argv:  # OpenRLHF's one-step-off whole batches, or with its partial rollouts ours
        assert args.async_one_step_off and args.partial_rollout == ("--train.partial_rollout_enable" in argv)
        if "--train.async_queue_size" in given:
            assert args.max_staleness == int(given["--train.async_queue_size"])


def test_values_reach_their_flags():
    """One line of each kind: a value, a switch, two values, a picked value, an ignored and a refused flag."""
    args = parse("train_ppo_ray", ["--actor.model_name_or_path", "m", "--reward.remote_url", "r.py", "--ckpt.output_dir", "o",
                                   "--data.prompt_dataset", "p.jsonl", "--algo.dynamic_filtering_range", "0.1", "0.9",
                                   "--algo.dynamic_filtering_enable", "--ds.param_dtype", "bf16",
                                   "--vllm.sync_backend", "nccl", "--rollout.max_new_tokens=64",
                                   "--algo.advantage.estimator", "group_norm", "--ds.lora.target_modules", "q_proj",
                                   "v_proj", "--actor.adam.betas", "0.9", "0.99"])
    assert (args.pretrain, args.remote_rm_url, args.prompt_data) == ("m", "r.py", "p.jsonl")
    assert args.dynamic_filtering and list(args.dynamic_filtering_range) == [0.1, 0.9] and args.bf16
    assert args.generate_max_len == 64 and args.advantage_estimator == "group_norm"
    assert args.target_modules == "q_proj,v_proj" and list(args.adam_betas) == [0.9, 0.99]
    with pytest.raises(ValueError, match=r"--ds.param_dtype fp16 \(OpenRLHF\): only bf16, fp32, float32"):
        parse("train_sft", ["--ds.param_dtype", "fp16"])
    with pytest.raises(ValueError, match="--actor.muon.lr"):
        parse("train_ppo_ray", ["--actor.muon.lr", "0.02"])


def test_a_misspelled_flag_still_fails():
    with pytest.raises(SystemExit):
        parse("train_ppo_ray", ["--actor.model_name_or_path", "m", "--actor.adam.lrr", "1e-6"])


def test_the_docs_table_is_the_translation_table():
    """docs/openrlhf_flags.md lists every flag of rlhf/config/openrlhf.py's table under its entry point."""
    from rlhf.config.openrlhf import TABLE

    doc = open(os.path.join(REPO, "docs", "openrlhf_flags.md")).read()
    sections = {s.split("\n", 1)[0]: s for s in doc.split("\n## ")[1:]}
    for entry, table in TABLE.items():
        if entry == "kto":
            continue
        body = next(v for k, v in sections.items() if k.startswith(f"launch/{entry}.py"))
        missing = [f for f in table if f"| `{f}` |" not in body]
        assert not missing, (entry, missing)
        # each "no effect" row says the table's own reason
        stale = [f for f, spec in table.items()
                 if spec.ignore and f"| `{f}` | accepted, no effect: {spec.ignore} |" not in body]
        assert not stale, (entry, stale)
        # each translated flag that differs from OpenRLHF says how, in the table's own words
        stale = [f for f, spec in table.items() if spec.differs and f"differs: {spec.differs}" not in body]
        assert not stale, (entry, stale)


@pytest.mark.parametrize("cli", sorted(ENTRY))
def test_ring_attention_size_is_context_parallelism(cli):
    """OpenRLHF's --ds.ring_attn_size N is --context_parallel_size N on every entry point (the example scripts that
    use it are refused for other flags)."""
    from rlhf.config.openrlhf import entry_name, translate

    p = argparse.ArgumentParser()
    importlib.import_module(ENTRY[cli]).add_args(p)
    argv = translate(["--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride", "4"], entry_name(ENTRY[cli]),
                     set(p._option_string_actions))
    assert argv == ["--context_parallel_size", "2"]
    assert p._option_string_actions["--context_parallel_size"].dest == "context_parallel_size"


def translate_only(cli: str, argv: list[str]) -> list[str]:
    from rlhf.config.openrlhf import entry_name, translate

    p = argparse.ArgumentParser()
    importlib.import_module(ENTRY[cli]).add_args(p)
    return translate(argv, entry_name(ENTRY[cli]), set(p._option_string_actions))


@pytest.mark.parametrize("cli", sorted(ENTRY))
def test_no_effect_flags_leave_every_parsed_value_as_it_was(cli):
    """The flags accepted with "no effect here" change none of the values the entry point parses (all that a run
    reads): the same namespace with all of them as without. A short PPO run with all of them (the resumed launch of
    tests/ppo/test_rlvr_options.py's dynamic-filtering test) reproduces the run without them metric for metric.
    Negative control: one flag with an effect (--train.seed) changes the namespace."""
    base = (["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p"] if cli == "train_ppo_ray" else
            ["--model.model_name_or_path", "m", "--data.dataset", "d"]) + ["--ckpt.output_dir", "o"]
    from rlhf.config.openrlhf import entry_name, without_effect

    extra = without_effect(entry_name(ENTRY[cli]))
    assert translate_only(cli, extra) == []
    assert len(extra) >= 10, extra
    assert vars(parse(cli, base + extra)) == vars(parse(cli, base))
    assert vars(parse(cli, base + ["--train.seed", "7"])) != vars(parse(cli, base))


def test_muon_is_refused_for_the_reason_it_gives():
    """OpenRLHF's --actor.optim muon / --critic.optim muon / --optim muon and its --*.muon.* flags are refused by
    name: megatron-core's own Muon cannot be built in this environment. The reason is checked here so that the
    refusal is revisited when it stops holding: megatron-core is 0.16.1, whose muon.py runs only with
    emerging_optimizers (not importable here: HAVE_EMERGING_OPTIMIZERS is False) and calls it with use_nesterov= and
    mode=, while emerging_optimizers' only release (0.3.0) needs Python >= 3.12 and takes nesterov= / tp_mode=.
    Negative control: --actor.optim adam parses."""
    import inspect
    import sys

    import megatron.core
    from megatron.core.optimizer import muon

    assert megatron.core.__version__ == "0.16.1"
    assert not muon.HAVE_EMERGING_OPTIMIZERS and sys.version_info < (3, 12)
    src = inspect.getsource(muon)
    assert "use_nesterov=use_nesterov" in src and 'mode="duplicated" if mode == "blockwise" else mode' in src
    for cli, argv in (("train_ppo_ray", ["--actor.optim", "muon"]), ("train_ppo_ray", ["--critic.optim", "muon"]),
                      ("train_sft", ["--optim", "muon"]), ("train_ppo_ray", ["--actor.muon.momentum", "0.9"]),
                      ("train_dpo", ["--muon.nesterov"])):
        with pytest.raises(ValueError, match=r"\(OpenRLHF\): Muon is not available \(Adam only\): megatron-core "
                                             r"0\.16\.1's own Muon .* needs NVIDIA's emerging_optimizers"):
            parse(cli, argv)
    assert parse("train_ppo_ray", ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p",
                                   "--ckpt.output_dir", "o", "--actor.optim", "adam"]).pretrain == "m"
