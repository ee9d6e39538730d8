"""The package's shape, checked from the source (no imports run): workflows never import each other, shared
layers never import a workflow, and the size limits a reader relies on hold."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "rlhf")
# Each workflow and the modules that belong to it alone (conditional SFT is a mode of SFT).
WORKFLOWS = {"sft": ("rlhf.sft", "rlhf.conditional"), "rm": ("rlhf.rm",), "dpo": ("rlhf.dpo",), "kto": ("rlhf.kto",),
             "ppo": ("rlhf.ppo",), "rejection_sampling": ("rlhf.rejection_sampling",),
             "batch_inference": ("rlhf.batch_inference",)}


def modules():
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield rel.removesuffix(".__init__"), path


def workflow_of(mod: str) -> str | None:
    for name, prefixes in WORKFLOWS.items():
        if any(mod == p or mod.startswith(p + ".") for p in prefixes):
            return name
    return None


def imported(path: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("rlhf")}


def test_workflows_share_layers_never_each_other():
    bad = []
    for mod, path in modules():
        mine = workflow_of(mod)
        for dep in imported(path):
            theirs = workflow_of(dep)
            if theirs is not None and theirs != mine:
                bad.append(f"{mod} ({mine or 'shared layer'}) imports {dep} ({theirs})")
    assert not bad, "\n".join(bad)


def test_size_limits():
    """No module over 450 lines, no function over 80 (flag tables aside), the PPO step at most 40."""
    bad = []
    for mod, path in modules():
        src = open(path).read()
        if src.count("\n") > 450:
            bad.append(f"{mod}: {src.count(chr(10))} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                flag_table = node.name.startswith("add_") and node.name.endswith("args")
                if n > 80 and not flag_table:
                    bad.append(f"{mod}.{node.name}: {n} lines")
                if mod == "rlhf.ppo.trainer" and node.name == "train_step" and n > 40:
                    bad.append(f"PPOTrainer.train_step: {n} lines (at most 40)")
    assert not bad, "\n".join(bad)


def test_layout_checks_can_fail(tmp_path):
    """The import scan sees a workflow importing another one."""
    p = tmp_path / "m.py"
    p.write_text("from rlhf.dpo import DPOTask\nimport rlhf.ppo.stages\n")
    assert {workflow_of(d) for d in imported(str(p))} == {"dpo", "ppo"}
