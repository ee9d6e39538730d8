"""Planted bugs of ``--config FILE`` (rlhf/config/config_file.py and its call in rlhf.config.job.cli_main): each
caught by tests/test_config_file.py, which takes argparse on the same flags as the reference."""
from tests.mutants import Mutant

T = "tests/test_config_file.py::"
SAME = (T + "test_a_file_is_its_command_line[.yaml-text0]", T + "test_a_file_is_its_command_line[.toml-text1]")
WINS = T + "test_the_command_line_wins_over_the_file"
BAD = T + "test_unknown_keys_and_bad_values_are_errors_naming_the_file_and_the_key"
SECRET = T + "test_the_resolved_file_leaves_out_a_wandb_key_and_the_local_rank"
BESIDE = T + "test_beside_a_file_output_the_resolved_file_is_named_after_it"
ENTRIES = ("sft", "rm", "dpo", "kto", "ppo", "rejection_sampling", "batch_inference", "evaluate")
CLI = tuple(T + f"test_cli_main_runs_with_the_files_flags_and_writes_them_beside_the_run[{e}]" for e in ENTRIES)
MAINS = tuple(T + f"test_every_launch_main_refuses_a_bad_key_before_anything_runs[{e}]" for e in ENTRIES)
ROUND_PPO = T + "test_every_entry_points_resolved_flags_read_back_to_the_same_parse[off_default-ppo]"
F = "rlhf/config/config_file.py"

MUTANTS = [
    Mutant("config-file-after-command-line", F,
           find="    return out + rest\n", replace="    return rest + out\n",
           claim="a flag given in the file and on the command line takes the command line's value",
           tests=(WINS, *CLI)),
    Mutant("config-given-default-dropped", F,
           find="            out += _tokens(key, by_key[key], value, path)\n",
           replace="            out += [] if value == by_key[key].default else "
                   "_tokens(key, by_key[key], value, path)\n",
           claim="a value the file gives is given, even one equal to our default (OpenRLHF's defaults yield to it)",
           tests=(WINS,)),
    Mutant("config-unknown-keys-ignored", F,
           find="            unknown.append(key)\n", replace="            pass\n",
           claim="keys that are no flag of the entry point are an error naming each and the file",
           tests=(BAD, *MAINS)),
    Mutant("config-dotted-names-refused", F,
           find="        elif flag in dotted:\n", replace="        elif False:\n",
           claim="OpenRLHF's dotted names are keys of the file, translated as on the command line",
           tests=(*SAME, WINS, BAD)),
    Mutant("config-tables-not-flattened", F,
           find="        if isinstance(v, dict):\n            out.update(",
           replace="        if False:\n            out.update(",
           claim="nested tables (actor: {adam: ...}, TOML's [actor.adam]) are dotted names", tests=(*SAME, WINS, BAD)),
    Mutant("config-no-x-dropped", F,
           find="        return [name] if _bool(key, value, path) else [neg]\n",
           replace="        return [name] if _bool(key, value, path) else []\n",
           claim="false on a --x / --no-x flag is --no-x, not the flag's default", tests=(*SAME, ROUND_PPO)),
    Mutant("config-store-const-true-refused", F,
           find="        if value is True or value == action.const:\n",
           replace="        if value == action.const:\n",
           claim="true on a store-const alias (slime's --use_routing_replay) gives the flag", tests=(*SAME, WINS)),
    Mutant("config-bare-optional-value", F,
           find="        return [name] if value else []\n", replace="        return [name, 'true'] if value else []\n",
           claim="true on a flag of an optional value (--use_wandb [KEY]) is the bare flag, not the value 'true'",
           tests=SAME),
    Mutant("config-switch-takes-any-value", F,
           find="    if isinstance(value, bool):\n        return value\n",
           replace="    if True:\n        return bool(value)\n",
           claim="a switch takes true or false, and anything else is an error naming the key", tests=(BAD,)),
    Mutant("config-value-count-unchecked", F,
           find='''    if (n is None or n == "?") and len(values) != 1 or isinstance(n, int) and len(values) != n:''',
           replace="    if False:",
           claim="a list for a flag of one value, or the wrong count for one of several, is an error naming the key",
           tests=(BAD,)),
    Mutant("config-yaml-bool-word-passed-on", F,
           find="    if any(isinstance(v, bool) for v in values):", replace="    if False:",
           claim="true/false for a flag of a value (YAML's off) is an error, not the string 'false'", tests=(BAD,)),
    Mutant("config-wandb-key-written", F,
           find='''        out["use_wandb"] = "True"\n''', replace="        pass\n",
           claim="the resolved file never holds a W&B API key", tests=(SECRET,)),
    Mutant("config-local-rank-written", F,
           find='''NOT_RECORDED = ("config", "local_rank")''', replace='''NOT_RECORDED = ("config",)''',
           claim="the resolved file leaves out the launcher's per-rank --local_rank", tests=(SECRET,)),
    Mutant("config-every-rank-writes", F,
           find="    if path is None or DistEnv.from_environ().rank != 0:",
           replace="    if path is None:",
           claim="rank 0 alone writes the resolved file", tests=(SECRET,)),
    Mutant("config-missing-output-folder-written", F,
           find="    if not os.path.isdir(folder):\n        return None\n",
           replace="    if not os.path.isdir(folder):\n        os.makedirs(folder)\n",
           claim="no output folder is made for the resolved file: a run refused by its checks leaves nothing",
           tests=(BESIDE, SECRET, "tests/train/test_bad_tokenizer.py::test_the_folder_is_refused_before_anything_loads")),
    Mutant("config-abbreviation-unread", F,
           find='''    if getattr(args, "config", None) is not None:''', replace="    if False:",
           claim="an abbreviated --config (argparse's --conf) is refused, never silently unread",
           tests=(T + "test_an_abbreviated_config_is_refused",)),
    Mutant("config-not-expanded", "rlhf/config/job.py",
           find="        argv = config_file.expand(list(sys.argv[1:] if argv is None else argv), p, entry)\n",
           replace="        argv = list(sys.argv[1:] if argv is None else argv)\n",
           claim="every entry point (cli_main) takes the file's flags", tests=(*CLI, *MAINS)),
    Mutant("config-resolved-not-written", "rlhf/config/job.py",
           find="            config_file.write_resolved(args, p, entry)  # beside what the run made\n",
           replace="            pass\n",
           claim="every entry point writes its resolved flags beside the run, a first launch's too",
           tests=(*CLI, T + "test_the_resolved_file_is_written_when_the_run_made_its_folder")),
    Mutant("config-optim-default-written-twice", "rlhf/config/parts.py",
           find='''    l2: float = flag(type=float, help="weight decay", default=config_default(OptimConfig, "weight_decay"))\n''',
           replace='''    l2: float = flag(type=float, help="weight decay", default=0.0)\n''',
           claim="a flag takes its default from the component configuration it fills, written once",
           tests=("tests/test_config_parts.py::test_flags_take_their_defaults_from_the_configs_they_fill"
                  "[rlhf.config.parts:OptimPart]",)),
    Mutant("config-rollout-default-written-twice", "rlhf/ppo/parts.py",
           find='''    weight_sync_bucket_mb: int = flag(type=int, default=config_default(RolloutConfig, "weight_sync_bucket_mb"))\n''',
           replace='''    weight_sync_bucket_mb: int = flag(type=int, default=512)\n''',
           claim="a flag takes its default from the component configuration it fills, written once",
           tests=("tests/test_config_parts.py::test_flags_take_their_defaults_from_the_configs_they_fill"
                  "[rlhf.ppo.parts:RolloutPart]",)),
]
