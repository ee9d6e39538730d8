"""``--config FILE`` (rlhf/config/config_file.py) with the entry points' real parsers, argparse itself the
reference: a YAML and a TOML file give what the same flags written on the command line give (dests, option strings,
OpenRLHF's dotted names, nested tables, switches of each kind); the command line wins over the file, OpenRLHF's
defaults included; keys that are no flag, and values a flag cannot take, are one error naming the file and each
key; on every launch/*.py entry point the resolved flags written beside a run (every flag off its default, or every
flag at it) read back through ``--config`` to the same parse. Through ``rlhf.config.job.cli_main`` and each
launch/*.py main: a file's flags reach ``run``, the resolved file lands beside the run (a W&B key left out), a bad
key stops the entry point with ``error:`` and exit 2 before anything runs, an abbreviated --config is refused.
Real runs that take --config: tests/ppo/test_mlflow.py (PPO, YAML) and tests/ppo/test_evaluate.py (the evaluator,
TOML)."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os

import pytest
import yaml

from rlhf.config.config_file import add_config_arg, expand, resolved_path, write_resolved
from rlhf.config.job import cli_main
from rlhf.config.migration import add_launcher_args
from rlhf.config.openrlhf import translate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--pretrain", "m", "--prompt_data", "d", "--save_path", "o", "--reward_fn", "m:f"]
ENTRIES = {"sft": "rlhf.supervised.sft", "rm": "rlhf.supervised.rm", "dpo": "rlhf.supervised.dpo",
           "kto": "rlhf.supervised.kto", "ppo": "rlhf.ppo.args",
           "rejection_sampling": "rlhf.offline.rejection_sampling", "batch_inference": "rlhf.offline.batch_inference",
           "evaluate": "rlhf.offline.evaluate"}


def _parser(entry: str = "ppo") -> argparse.ArgumentParser:
    """As cli_main builds it."""
    p = argparse.ArgumentParser()
    importlib.import_module(ENTRIES[entry]).add_args(p)
    add_launcher_args(p)
    add_config_arg(p)
    return p


def _parse(p, argv, entry="ppo"):
    """As cli_main parses: the file expanded, OpenRLHF's dotted names translated, then argparse."""
    return p.parse_args(translate(expand(argv, p, entry), entry, set(p._option_string_actions)))


def _plain(ns, drop=("config", "local_rank")) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(ns).items() if k not in drop}


YAML = """\
actor_learning_rate: 3.0e-6         # a dest
--critic_learning_rate: 2.0e-6      # an option string
eps_clip_low_high: [0.2, 0.28]      # a flag of two values
use_kl_loss: false                  # a --x / --no-x flag
packing_samples: true               # a switch
use_routing_replay: true            # slime's store-const alias of --moe_router_replay train
use_wandb: true                     # --use_wandb [KEY], bare
algo: {dynamic_filtering_enable: true}  # an option string of ours that is dotted, as a nested table
rollout: {batch_size: 16}           # OpenRLHF's --rollout.batch_size, as a nested table
actor.adam.betas: [0.9, 0.95]       # OpenRLHF's dotted name
actor.gradient_checkpointing_enable: true  # OpenRLHF's dotted switch
advantage_estimator: grpo
n_samples_per_prompt: 4
reward_pretrain: null               # null: the default
"""
TOML = """\
actor_learning_rate = 3.0e-6
"--critic_learning_rate" = 2.0e-6
eps_clip_low_high = [0.2, 0.28]
use_kl_loss = false
packing_samples = true
use_routing_replay = true
use_wandb = true
advantage_estimator = "grpo"
n_samples_per_prompt = 4
[algo]
dynamic_filtering_enable = true
[rollout]
batch_size = 16
[actor]
gradient_checkpointing_enable = true
[actor.adam]
betas = [0.9, 0.95]
"""
SAME = ["--actor_learning_rate", "3e-6", "--critic_learning_rate", "2e-6", "--eps_clip_low_high", "0.2", "0.28",
        "--no-use_kl_loss", "--packing_samples", "--use_routing_replay", "--use_wandb", "--dynamic_filtering",
        "--rollout.batch_size", "16", "--actor.adam.betas", "0.9", "0.95", "--actor.gradient_checkpointing_enable",
        "--advantage_estimator", "grpo", "--n_samples_per_prompt", "4"]


@pytest.mark.parametrize("ext,text", [(".yaml", YAML), (".toml", TOML)])
def test_a_file_is_its_command_line(tmp_path, ext, text):
    cfg = tmp_path / f"c{ext}"
    cfg.write_text(text)
    p = _parser()
    got, want = _parse(p, BASE + ["--config", str(cfg)]), _parse(p, BASE + SAME)
    assert vars(got) == vars(want)
    assert got.actor_learning_rate == 3e-6 and got.use_kl_loss is False and got.packing_samples is True
    assert got.moe_router_replay == "train" and got.use_wandb == "True" and got.dynamic_filtering is True
    assert got.rollout_batch_size == 16 and tuple(got.adam_betas) == (0.9, 0.95) and got.gradient_checkpointing
    assert vars(got) != vars(_parse(p, BASE)), "the file changed nothing"


def test_the_command_line_wins_over_the_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(YAML)
    p = _parser()
    over = _parse(p, ["--actor_learning_rate", "1e-6"] + BASE + [f"--config={cfg}", "--use_kl_loss",
                                                                  "--rollout_batch_size", "8"])
    assert over.actor_learning_rate == 1e-6 and over.use_kl_loss is True and over.rollout_batch_size == 8
    assert over.critic_learning_rate == 2e-6  # the file's, where the command line is silent
    # A value the file gives is given, even where it equals our default: an OpenRLHF command line (it names the
    # actor by --actor.model_name_or_path) gets OpenRLHF's importance-weight cap 5 only where nothing sets one.
    cfg.write_text("tis_cap: 2.0\n")
    openrlhf = ["--actor.model_name_or_path", "m", "--prompt_data", "d", "--save_path", "o", "--reward_fn", "m:f"]
    assert _parse(p, openrlhf).tis_cap == 5.0
    assert _parse(p, openrlhf + ["--config", str(cfg)]).tis_cap == 2.0


def test_unknown_keys_and_bad_values_are_errors_naming_the_file_and_the_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("actor_learning_rate: 1.0e-6\nactor_lerning_rate: 2\nmodel: {nonsense: 1}\n")
    with pytest.raises(ValueError, match=r"--config .*c\.yaml: not flags of this entry point: actor_lerning_rate, "
                                         r"model\.nonsense$"):
        expand(BASE + ["--config", str(cfg)], _parser(), "ppo")
    for text, msg in (("packing_samples: 3\n", "packing_samples is a switch: true or false, got 3"),
                      ("use_kl_loss: 'no'\n", "use_kl_loss is a switch"),
                      ("use_routing_replay: rollout\n", r"use_routing_replay is a switch \(--use-routing-replay "
                                                        r"sets 'train'\)"),
                      ("prompt_data: [a, b]\n", r"prompt_data takes 1 value\(s\)"),
                      ("eps_clip_low_high: 0.2\n", r"eps_clip_low_high takes 2 value\(s\)"),
                      ("moe_router_replay: off\n", "moe_router_replay takes a value, not true/false"),
                      ("rollout.batch_size: [1, 2]\n", r"rollout\.batch_size \(OpenRLHF\) takes 1 value\(s\)"),
                      ("actor.gradient_checkpointing_enable: 1\n", "actor.gradient_checkpointing_enable is a switch"),
                      ("config: other.yaml\n", r"a config file cannot name another \(config\)"),
                      ("- a\n", "expected a mapping")):
        cfg.write_text(text)
        with pytest.raises(ValueError, match=f"--config {cfg}: {msg}"):
            expand(BASE + ["--config", str(cfg)], _parser(), "ppo")
    cfg.write_text("a: [1\n")
    with pytest.raises(ValueError, match=f"--config {cfg}: ParserError"):
        expand(["--config", str(cfg)], _parser(), "ppo")
    with pytest.raises(ValueError, match="no such file"):
        expand(["--config", str(tmp_path / "missing.yaml")], _parser(), "ppo")
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ValueError, match="expected a .yaml, .yml or .toml file"):
        expand(["--config", str(tmp_path / "c.json")], _parser(), "ppo")
    with pytest.raises(ValueError, match="given twice"):
        expand(["--config", str(cfg), "--config", str(cfg)], _parser(), "ppo")


def _off_default(p: argparse.ArgumentParser, tmp: str) -> list[str]:
    """Tokens that set every flag (each dest's first action) off its default, as argparse takes them."""
    out, seen = [], set()
    for a in p._actions:
        if isinstance(a, argparse._HelpAction) or a.dest in seen or a.dest in ("config", "use_wandb"):
            continue
        seen.add(a.dest)
        name = a.option_strings[0]
        if isinstance(a, argparse.BooleanOptionalAction):
            out.append(next(s for s in a.option_strings if s.startswith("--no-")) if a.default else name)
        elif isinstance(a, argparse._StoreConstAction):
            out.append(name)
        elif a.choices:
            out += [name, str(next(c for c in a.choices if c != a.default))]
        elif a.type in (int, float):
            base = a.default if isinstance(a.default, (int, float)) else 0
            vals = [a.type(base + (3 if a.type is int else 0.25) + i) for i in range(a.nargs or 1)]
            out += [name, *map(str, vals)] if a.nargs else [name, str(vals[0])]
        else:
            out += [name, os.path.join(tmp, a.dest)]
    return out


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("which", ["off_default", "default"])
def test_every_entry_points_resolved_flags_read_back_to_the_same_parse(entry, which, tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    p = _parser(entry)
    argv = _off_default(p, str(tmp_path))
    required = [t for i, t in enumerate(argv) if t in _required_flags(p) or i and argv[i - 1] in _required_flags(p)]
    first = _parse(p, argv if which == "off_default" else required, entry)
    os.makedirs(os.path.dirname(resolved_path(first)), exist_ok=True)  # the run's folder (it writes none itself)
    path = write_resolved(first, p, entry)
    assert path is not None and os.path.isfile(path)
    again = _parse(p, ["--config", path], entry)
    assert _plain(again) == _plain(first)
    if which == "off_default":  # every flag but the required ones and the W&B key was off its default
        defaults = _plain(_parse(p, required, entry))
        assert {k for k, v in _plain(first).items() if v == defaults[k]} == \
            {a.dest for a in p._actions if a.required} | ({"use_wandb"} & set(defaults))


def _required_flags(p) -> set[str]:
    return {s for a in p._actions if a.required for s in a.option_strings}


def test_the_resolved_file_leaves_out_a_wandb_key_and_the_local_rank(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    p = _parser("ppo")
    args = _parse(p, BASE[:4] + ["--save_path", str(tmp_path / "run"), "--use_wandb", "SECRETKEY", "--local_rank",
                                 "3"])
    assert write_resolved(args, p, "ppo") is None and not (tmp_path / "run").exists()  # no folder made for it
    (tmp_path / "run").mkdir()
    path = write_resolved(args, p, "ppo")
    assert path == str(tmp_path / "run" / "run_config.yaml")
    text = open(path).read()
    assert "SECRETKEY" not in text and "local_rank" not in text
    assert yaml.safe_load(text)["use_wandb"] == "True"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    os.remove(path)
    assert write_resolved(args, p, "ppo") is None and not os.path.exists(path)  # rank 0 writes it


def test_beside_a_file_output_the_resolved_file_is_named_after_it(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    p = _parser("batch_inference")
    args = _parse(p, ["--mode", "generate", "--pretrain", "m", "--dataset", "d", "--output_path",
                      str(tmp_path / "gen.jsonl")], "batch_inference")
    assert write_resolved(args, p, "batch_inference") == str(tmp_path / "gen.run_config.yaml")
    args.output_path = str(tmp_path / "missing" / "gen.jsonl")  # the entry point refuses a missing folder itself
    assert write_resolved(args, p, "batch_inference") is None and not (tmp_path / "missing").exists()


REQUIRED = {"ppo": ["--pretrain", "m", "--prompt_data", "d", "--save_path", "{o}"],
            "evaluate": ["--pretrain", "m", "--dataset", "d", "--output_dir", "{o}"],
            "rejection_sampling": ["--pretrain", "m", "--dataset", "d", "--output_path", "{o}/best.jsonl"],
            "batch_inference": ["--pretrain", "m", "--dataset", "d", "--output_path", "{o}/gen.jsonl", "--mode",
                                "generate"]}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_cli_main_runs_with_the_files_flags_and_writes_them_beside_the_run(entry, tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    o = tmp_path / "out"
    o.mkdir()
    argv = [t.format(o=o) for t in REQUIRED.get(entry, ["--pretrain", "m", "--dataset", "d", "--save_path", "{o}"])]
    cfg = tmp_path / "c.toml"
    cfg.write_text("seed = 7\nmax_samples = 99\ntp = 2\n")  # tp: the short name of a flag
    got = []
    assert cli_main(importlib.import_module(ENTRIES[entry]).add_args, got.append,
                    argv + ["--config", str(cfg), "--max_samples", "77"]) == 0
    assert (got[0].seed, got[0].max_samples, got[0].tensor_model_parallel_size) == (7, 77, 2)
    written = {"rejection_sampling": o / "best.run_config.yaml",
               "batch_inference": o / "gen.run_config.yaml"}.get(entry, o / "run_config.yaml")
    flags = yaml.safe_load(open(written))
    assert flags["seed"] == 7 and flags["max_samples"] == 77 and flags["pretrain"] == "m"
    assert open(written).readline().startswith(f"# launch/{entry}.py: ")


def _launch_main(entry: str):
    spec = importlib.util.spec_from_file_location(f"_cfg_launch_{entry}", os.path.join(ROOT, "launch", f"{entry}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_launch_main_refuses_a_bad_key_before_anything_runs(entry, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 3\nnot_a_flag: 1\n")
    assert _launch_main(entry)(["--config", str(cfg)]) == 2
    assert f"error: --config {cfg}: not flags of this entry point: not_a_flag" in capsys.readouterr().err


def test_an_abbreviated_config_is_refused(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 3\n")
    argv = ["--pretrain", "m", "--prompt_data", "d", "--save_path", str(tmp_path / "o"), "--conf", str(cfg)]
    assert _launch_main("ppo")(argv) == 2
    assert "spell the flag out as --config" in capsys.readouterr().err


def test_the_resolved_file_is_written_when_the_run_made_its_folder(tmp_path, monkeypatch):
    """A first launch: --save_path does not exist before the run; the resolved file is written once the run has
    made it (cli_main writes again after the run), not into a folder made before the run's own checks."""
    monkeypatch.delenv("RANK", raising=False)
    o = tmp_path / "new"
    seen = []

    def run(args):
        seen.append(o.exists())
        o.mkdir()

    assert cli_main(importlib.import_module(ENTRIES["sft"]).add_args, run,
                    ["--pretrain", "m", "--dataset", "d", "--save_path", str(o)]) == 0
    assert seen == [False] and yaml.safe_load(open(o / "run_config.yaml"))["save_path"] == str(o)
