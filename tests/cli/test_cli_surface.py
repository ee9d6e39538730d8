"""Freezes every entry point's command line: each flag's spellings, destination, default, type, choices, nargs,
whether it is required, and its help text. A user's scripts break when a flag silently changes, so a change here
must be deliberate: regenerate the snapshots with

    RLHF_UPDATE_CLI=1 .venv/bin/python -m pytest tests/cli/test_cli_surface.py -q

and commit the diff of ``tests/cli/surface/*.json`` with the change that caused it.

The parser is taken from the entry point itself (its ``main``), stopped at ``parse_args``, so flags added
anywhere on the way (shared groups, LoRA, task hooks) are all seen."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SNAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "surface")
ENTRY_POINTS = ["launch/sft.py", "launch/rm.py", "launch/dpo.py", "launch/kto.py", "launch/ppo.py",
                "launch/rejection_sampling.py", "launch/batch_inference.py", "launch/evaluate.py",
                "tools/convert_hf_to_megatron.py",
                "tools/convert_megatron_to_hf.py", "tools/compare_logits.py", "tools/plan_memory.py",
                "tools/convert_reward_model.py",
                # the tools' own command lines: the bundled tasks' data makers, the sandbox, the SandboxFusion server
                "rlhf/demo/arith_task.py", "rlhf/demo/calc_task.py", "rlhf/demo/code_task.py", "rlhf/demo/swe_task.py",
                "rlhf/demo/vision_task.py", "rlhf/sandbox/__main__.py", "rlhf/sandbox/fusion.py"]


def snapshot_name(rel: str) -> str:
    """launch/ppo.py -> ppo.json; a package's __main__.py takes the package's name (rlhf/sandbox -> sandbox.json)."""
    base = os.path.basename(rel)
    return (os.path.basename(os.path.dirname(rel)) if base == "__main__.py" else base[:-3]) + ".json"


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _jsonable(v):
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


def surface(parser: argparse.ArgumentParser) -> dict:
    out = {}
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        key = a.option_strings[0] if a.option_strings else a.dest
        out[key] = {"flags": sorted(a.option_strings), "dest": a.dest, "default": _jsonable(a.default),
                    "type": getattr(a.type, "__name__", _jsonable(a.type)), "choices": _jsonable(a.choices),
                    "nargs": _jsonable(a.nargs), "required": a.required, "action": type(a).__name__,
                    "help": " ".join((a.help or "").split())}
    return dict(sorted(out.items()))


def entry_parser(rel: str, monkeypatch) -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location("_entry_" + rel.replace("/", "_")[:-3], os.path.join(ROOT, rel))
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)

    def stop(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop)
    with pytest.raises(_Parsed) as e:
        mod.main([])
    return e.value.parser


@pytest.mark.parametrize("rel", ENTRY_POINTS)
def test_cli_surface_frozen(rel, monkeypatch):
    got = surface(entry_parser(rel, monkeypatch))
    path = os.path.join(SNAP, snapshot_name(rel))
    if os.environ.get("RLHF_UPDATE_CLI") == "1":
        os.makedirs(SNAP, exist_ok=True)
        with open(path, "w") as f:
            json.dump(got, f, indent=1)
            f.write("\n")
    with open(path) as f:
        want = json.load(f)
    changed = [k for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    assert not changed, (f"{rel}: the command line changed for {changed}:\n" + "\n".join(
        f"  {k}: was {want.get(k)}\n  {' ' * len(k)}  now {got.get(k)}" for k in changed)
        + "\nIf deliberate, regenerate with RLHF_UPDATE_CLI=1 (see this file's docstring).")


def test_surface_sees_a_changed_default(monkeypatch):
    """The snapshot comparison can fail: a parser whose default moved differs from its record."""
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=1e-6, help="x")
    before = surface(p)
    p._actions[-1].default = 2e-6
    assert surface(p) != before
