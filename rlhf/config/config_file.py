"""``--config FILE`` on every ``launch/*.py`` entry point but ``launch/dschat.py`` (DeepSpeed-Chat's flags only): its
flags from a YAML or TOML file, the command line over it; and the resolved flags written beside each run, a file that
``--config`` takes back.

A key is any flag of the entry point, as its ``dest`` (``actor_learning_rate``) or an option string with or without
the dashes (``--actor_learning_rate``, ``algo.dynamic_filtering_enable``), or one of OpenRLHF's dotted names that
the entry point translates (``actor.adam.lr``; ``rlhf/config/openrlhf.py``), also as nested tables
(``actor: {adam: {lr: 5e-7}}``, TOML's ``[actor.adam]``). A value is what the flag takes: a scalar, a list for a
flag of several values, true/false for a switch (false on a ``--x`` / ``--no-x`` flag is ``--no-x``; on a plain
switch it leaves the switch off), null for the default. Keys that are no flag are one ``ValueError`` naming them
all and the file, before anything runs; so is a value a flag cannot take.

The file's flags become command-line tokens put before the given ones, so a flag given both ways takes the command
line's value (argparse keeps the last) and OpenRLHF's dotted names are translated as if typed. A plain switch that
the file turns on cannot be turned off from the command line (it has no ``--no-`` form).

The resolved flags (every flag's parsed value by its ``dest``) go to ``<save_path>/run_config.yaml``, else
``<output_dir>/run_config.yaml``, else ``<output_path without its extension>.run_config.yaml``, on rank 0: before the
run starts where that folder exists (a relaunch), and when the run ends; never into a folder made for it, so that a
run its own checks refuse leaves nothing behind. A W&B API key given to ``--use_wandb`` is written as ``True`` (the rerun logs in from the environment);
the launcher's per-rank ``--local_rank`` is left out."""
from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Any

from rlhf.config.part import Part, flag

log = logging.getLogger("rlhf")
FLAG = "--config"
RESOLVED_NAME = "run_config.yaml"
NOT_RECORDED = ("config", "local_rank")
"""dests the resolved file leaves out: the file itself, the launcher's per-rank local rank"""


@dataclass
class ConfigFilePart(Part):
    """``--config``: every entry point takes it, and ``rlhf.config.job.cli_main`` expands it before parsing."""

    GROUP = "configuration file"

    config: str | None = flag(metavar="FILE", default=None,
                              help="flags from a YAML or TOML file (any flag as a key, OpenRLHF's dotted names too; "
                                   "the command line wins); the resolved flags are written to run_config.yaml beside "
                                   "the run")
    """(--config) flags from a YAML or TOML file; the command line wins"""


add_config_arg = ConfigFilePart.add_args


def load_file(path: str) -> dict[str, Any]:
    """The file's keys, nested tables flattened with dots. ValueError naming --config on a missing or bad file."""
    if not os.path.isfile(path):
        raise ValueError(f"{FLAG} {path}: no such file")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".toml", ".yaml", ".yml"):
        raise ValueError(f"{FLAG} {path}: expected a .yaml, .yml or .toml file")
    try:
        if ext == ".toml":
            import tomllib

            with open(path, "rb") as f:
                data = tomllib.load(f)
        else:
            import yaml

            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
    except Exception as e:  # noqa: BLE001 - the parser's own error, named
        raise ValueError(f"{FLAG} {path}: {type(e).__name__}: {e}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{FLAG} {path}: expected a mapping of flags to values, got {type(data).__name__}")
    return _flatten(data)


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --config path or None, argv without it). ValueError when given twice or without a value."""
    path, rest, i = None, [], 0
    while i < len(argv):
        tok = argv[i]
        if tok == FLAG or tok.startswith(FLAG + "="):
            if path is not None:
                raise ValueError(f"{FLAG} given twice ({path} and {tok})")
            if "=" in tok:
                path = tok.split("=", 1)[1]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                path, i = argv[i + 1], i + 1
            else:
                raise ValueError(f"{FLAG} needs a file")
            i += 1
            continue
        rest.append(tok)
        i += 1
    return path, rest


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """key -> action: each action's dest (its first action where several share it) and option strings, with and
    without the dashes."""
    out: dict[str, argparse.Action] = {}
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction) or a.dest == "config":
            continue
        out.setdefault(a.dest, a)
        for s in a.option_strings:
            out.setdefault(s, a)
            out.setdefault(s.lstrip("-"), a)
    return out


def _bool(key: str, value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"{FLAG} {path}: {key} is a switch: true or false, got {value!r}")


def _str(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def _tokens(key: str, action: argparse.Action, value: Any, path: str) -> list[str]:
    """The command-line tokens that give ``action`` ``value`` (none for null: the default)."""
    if value is None:
        return []
    name = next((s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-")),
                action.option_strings[0])
    if isinstance(action, argparse.BooleanOptionalAction):
        neg = next(s for s in action.option_strings if s.startswith("--no-"))
        return [name] if _bool(key, value, path) else [neg]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return [name] if _bool(key, value, path) else []
    if isinstance(action, argparse._StoreConstAction):  # slime's --use_routing_replay: the flag, or not
        if value is True or value == action.const:
            return [name]
        if value is False:
            return []
        raise ValueError(f"{FLAG} {path}: {key} is a switch ({name} sets {action.const!r}): true or false, "
                         f"got {value!r}")
    if not isinstance(action, argparse._StoreAction):
        raise ValueError(f"{FLAG} {path}: {key} ({type(action).__name__}) cannot be given in a file")
    if action.nargs == "?" and isinstance(value, bool):  # --use_wandb [KEY]: true is the bare flag
        return [name] if value else []
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, bool) for v in values):  # YAML reads on/off/yes/no as true/false
        raise ValueError(f"{FLAG} {path}: {key} takes a value, not true/false, got {value!r} (quote a word such as "
                         f"'off')")
    n = action.nargs
    if (n is None or n == "?") and len(values) != 1 or isinstance(n, int) and len(values) != n:
        raise ValueError(f"{FLAG} {path}: {key} takes {1 if n in (None, '?') else n} value(s), got {value!r}")
    return [name, *map(_str, values)]


def _dotted_tokens(key: str, flag: str, arity: int | str, value: Any, path: str) -> list[str]:
    """OpenRLHF's dotted ``flag`` with ``value``, as typed on its command line (``translate`` rewrites it)."""
    if value is None:
        return []
    if arity == 0:
        return [flag] if _bool(key, value, path) else []
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if arity != "*" and len(values) != int(arity):
        raise ValueError(f"{FLAG} {path}: {key} (OpenRLHF) takes {arity} value(s), got {value!r}")
    return [flag, *map(_str, values)]


def expand(argv: list[str], parser: argparse.ArgumentParser, entry: str) -> list[str]:
    """``argv`` with its ``--config FILE`` replaced by the file's flags, put before the given ones (OpenRLHF's
    dotted names stay dotted: ``rlhf.config.openrlhf.translate`` rewrites them with the command line's)."""
    from rlhf.config.openrlhf import TABLE

    path, rest = split_config(argv)
    if path is None:
        return rest
    by_key, dotted = _actions(parser), TABLE.get(entry, {})
    out, unknown = [], []
    for key, value in load_file(path).items():
        flag = key if key.startswith("--") else "--" + key
        if key in ("config", FLAG):
            raise ValueError(f"{FLAG} {path}: a config file cannot name another ({key})")
        if key in by_key:
            out += _tokens(key, by_key[key], value, path)
        elif flag in dotted:
            out += _dotted_tokens(key, flag, dotted[flag].arity, value, path)
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{FLAG} {path}: not flags of this entry point: {', '.join(unknown)}")
    log.info("%s %s: %d tokens of flags from the file (the command line's win)", FLAG, path, len(out))
    return out + rest


def check_spelled(args: argparse.Namespace) -> None:
    """After parsing: ``expand`` took every ``--config``, so one argparse still parsed came abbreviated (``--conf``)
    and was never read."""
    if getattr(args, "config", None) is not None:
        raise ValueError(f"{FLAG} {args.config}: spell the flag out as {FLAG}")


def resolved(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Every flag's parsed value by its dest (tuples as lists), less ``NOT_RECORDED`` and a W&B key."""
    dests = {a.dest for a in parser._actions if not isinstance(a, argparse._HelpAction)} - set(NOT_RECORDED)
    out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k in dests}
    if out.get("use_wandb") not in (None, "True", "true", "1"):  # the API key (rlhf/observability/metrics.py)
        out["use_wandb"] = "True"
    return out


def resolved_path(args: argparse.Namespace) -> str | None:
    """Where the run's resolved flags go: in --save_path, else --output_dir, else beside --output_path."""
    folder = getattr(args, "save_path", None) or getattr(args, "output_dir", None)
    if folder:
        return os.path.join(folder, RESOLVED_NAME)
    out = getattr(args, "output_path", None)
    return f"{os.path.splitext(out)[0]}.{RESOLVED_NAME}" if out else None


def write_resolved(args: argparse.Namespace, parser: argparse.ArgumentParser, entry: str) -> str | None:
    """Rank 0: the resolved flags into ``resolved_path(args)``; that path. Nothing where the entry point names no
    output, or where the output's folder does not exist yet: a run refused by its own checks then leaves nothing
    behind (``cli_main`` calls this again once the run has made its folder)."""
    import yaml

    from rlhf.distributed.env import DistEnv

    path = resolved_path(args)
    if path is None or DistEnv.from_environ().rank != 0:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return None
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(f"# launch/{entry}.py: every flag as this run resolved it; `--config {os.path.basename(path)}` "
                f"runs it again\n")
        yaml.safe_dump(resolved(args, parser), f, sort_keys=False)
    os.replace(path + ".tmp", path)
    return path
