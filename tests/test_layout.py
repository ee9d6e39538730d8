"""The package's shape, checked from the source (no imports run): workflows never import each other, shared
layers never import a workflow, no module imports in a circle (nor any script outside rlhf/), and the size limits a
reader relies on hold."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "rlhf")
# Each workflow and the modules that belong to it alone (conditional SFT is a mode of SFT).
WORKFLOWS = {"sft": ("rlhf.supervised.sft", "rlhf.supervised.conditional"), "rm": ("rlhf.supervised.rm",),
             "dpo": ("rlhf.supervised.dpo",), "kto": ("rlhf.supervised.kto",), "ppo": ("rlhf.ppo",),
             "rejection_sampling": ("rlhf.offline.rejection_sampling",),
             "batch_inference": ("rlhf.offline.batch_inference",), "evaluate": ("rlhf.offline.evaluate",)}
LAYERS = {  # docs/layout.md's table, bottom to top: a module's layer is its longest prefix's
    0: ("rlhf", "rlhf.compat", "rlhf.config.part", "rlhf.kernels"),
    1: ("rlhf.distributed",),
    2: ("rlhf.models", "rlhf.algo", "rlhf.data", "rlhf.config.openrlhf", "rlhf.rewards.verifiers"),
    3: ("rlhf.runtime", "rlhf.planner", "rlhf.observability"),
    4: ("rlhf.rollout", "rlhf.agents", "rlhf.rewards", "rlhf.sandbox", "rlhf.runtime.export",
        "rlhf.runtime.checkpoint"),
    5: ("rlhf.config",),
    6: ("rlhf.supervised", "rlhf.supervised.loop", "rlhf.supervised.reference"),
    7: ("rlhf.supervised.sft", "rlhf.supervised.rm", "rlhf.supervised.dpo", "rlhf.supervised.kto",
        "rlhf.supervised.conditional", "rlhf.offline", "rlhf.ppo", "rlhf.demo"),
}
UPWARD = {("rlhf.compat.megatron", "rlhf.models.fused")}
"""Imports that go up, each for a reason: compat's megatron patches call the fused kernels when they run (the patch
replaces megatron's own op with the model stack's dispatch)."""


def layer_of(mod: str) -> int | None:
    best, n = None, -1
    for lv, prefixes in LAYERS.items():
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > n:
                best, n = lv, len(p)
    return best


def modules(root: str = ROOT, pkg: str = "rlhf"):
    for dirpath, _, files in os.walk(os.path.join(root, pkg)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
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


def import_graph(root: str = ROOT, pkg: str = "rlhf") -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its source (top level, inside functions, under
    ``if TYPE_CHECKING:`` too). ``from a.b import c`` is an edge to module ``a.b.c`` when that is a module, else to
    ``a.b``; a package is its ``__init__``; relative imports are resolved. Importing ``a.b.c`` runs ``a/__init__``
    and ``a/b/__init__`` too, but those parents are not edges: a package's face imports its own modules, so every
    module would sit in a circle with its package; a module that takes a name from its package's face
    (``from a import x``) is an edge to ``a``, so a face whose modules import it back is still caught."""
    mods = dict(modules(root, pkg))

    def known(name: str) -> str | None:  # the longest prefix of ``name`` that is one of the package's modules
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in mods.items():
        here = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                out.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                out.update(known(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else known(base)
                           for a in node.names)
        graph[mod] = out - {None, mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module: modules that each reach the other."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for dep in graph.get(todo.pop(), ()):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    reached = {m: reach(m) for m in graph}
    out, placed = [], set()
    for m in sorted(graph):
        if m not in placed:
            comp = {m} | {n for n in reached[m] if m in reached[n]}
            placed |= comp
            if len(comp) > 1:
                out.append(sorted(comp))
    return out


SCRIPT_DIRS = ("launch", "tools", "bench", "examples", os.path.join("tests", "gpu"))
"""The scripts outside rlhf/: entry points, tools, benchmarks, examples and the GPU check."""
ON_PATH = ("bench", "tools")
"""Folders scripts put on sys.path, so that a bare ``import x`` may mean one of their files."""


def script_graph(root: str = ROOT) -> dict[str, set[str]]:
    """Script -> the scripts it imports (paths relative to ``root``), anywhere in its source: a dotted name
    (``examples.rlvr.run``, ``from examples.demo import make_data``) is a file under ``root``; a bare one
    (``gpu_harness``, ``_machine``) a file of the importer's own folder, else of an ``ON_PATH`` folder."""
    files = set()
    for top in SCRIPT_DIRS:
        for d, dirs, fs in os.walk(os.path.join(root, top)):
            dirs[:] = [x for x in dirs if not x.startswith(".")]  # a venv (bench/.venv-trl) holds no script of ours
            files.update(os.path.relpath(os.path.join(d, f), root) for f in fs if f.endswith(".py"))

    def resolve(name: str, here: str) -> str | None:
        parts = name.split(".")
        if len(parts) == 1:
            for folder in (here, *ON_PATH):
                if os.path.join(folder, name + ".py") in files:
                    return os.path.join(folder, name + ".py")
            return None
        for cand in (os.path.join(*parts) + ".py", os.path.join(*parts, "__init__.py")):
            if cand in files:
                return cand
        return None

    graph = {}
    for path in files:
        here, out = os.path.dirname(path), set()
        for node in ast.walk(ast.parse(open(os.path.join(root, path)).read())):
            if isinstance(node, ast.Import):
                out.update(resolve(a.name, here) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.add(resolve(node.module, here))
                out.update(resolve(f"{node.module}.{a.name}", here) for a in node.names)
        graph[path] = out - {None, path}
    return graph


def test_no_script_imports_in_a_circle():
    """The scripts outside rlhf/ import each other one way only (the GPU check's runner and its speed parts share
    tests/gpu/gpu_harness.py rather than each other)."""
    found = circles(script_graph())
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_a_script_circle_is_found(tmp_path):
    gpu, ex = tmp_path / "tests" / "gpu", tmp_path / "examples" / "a"
    gpu.mkdir(parents=True)
    ex.mkdir(parents=True)
    (gpu / "one.py").write_text("def f():\n    import two\n")
    (gpu / "two.py").write_text("import one\n")
    (ex / "run.py").write_text("from examples.a import helper\n")
    (ex / "helper.py").write_text("from examples.a.run import x\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "t.py").write_text("from examples.a.helper import y\nimport os\n")
    graph = script_graph(str(tmp_path))
    assert graph[os.path.join("tools", "t.py")] == {os.path.join("examples", "a", "helper.py")}
    assert circles(graph) == [[os.path.join("examples", "a", "helper.py"), os.path.join("examples", "a", "run.py")],
                              [os.path.join("tests", "gpu", "one.py"), os.path.join("tests", "gpu", "two.py")]]


def test_no_module_imports_in_a_circle():
    """A circle means two modules each need the other: what they both need moves down a layer (docs/layout.md)."""
    graph = import_graph()
    found = circles(graph)
    assert not found, "\n".join(" <-> ".join(c) + ": " + "; ".join(f"{m} imports {sorted(graph[m] & set(c))}"
                                                                     for m in c) for c in found)


def test_the_tree_is_the_layer_table():
    """Every module of rlhf/ sits in a package of the layer table and imports only from its layer or below; nothing
    is left flat at the top of rlhf/ but its ``__init__``."""
    graph = import_graph()
    flat = sorted(m for m in graph if m.count(".") == 1 and os.path.isfile(os.path.join(ROOT, *m.split(".")) + ".py"))
    assert not flat, f"modules flat at the top of rlhf/: {flat}"
    assert not [m for m in graph if layer_of(m) is None], [m for m in graph if layer_of(m) is None]
    up = sorted((m, d) for m, deps in graph.items() for d in deps
                if layer_of(d) > layer_of(m) and (m, d) not in UPWARD)
    assert not up, "\n".join(f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})" for m, d in up)


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
    p.write_text("from rlhf.supervised.dpo import DPOTask\nimport rlhf.ppo.stages\n")
    assert {workflow_of(d) for d in imported(str(p))} == {"dpo", "ppo"}


def test_a_circle_is_found(tmp_path):
    """The circle scan sees a two-module circle through a function-level import, one through relative imports, and
    none through a package face that imports its own modules."""
    files = {"__init__.py": "from pkg.c import y\n", "a.py": "from pkg.b import x\n",
             "b.py": "def x():\n    from pkg import a\n", "c.py": "import pkg.a\ny = 1\n",
             "d.py": "from . import e\n", "e.py": "from .d import z\n"}
    (tmp_path / "pkg").mkdir()
    for name, text in files.items():
        (tmp_path / "pkg" / name).write_text(text)
    graph = import_graph(str(tmp_path), "pkg")
    assert graph["pkg"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert circles(graph) == [["pkg.a", "pkg.b"], ["pkg.d", "pkg.e"]]
