"""The registry of planted bugs: each a small textual edit of a product file that breaks one claim, and the tests of
the suite that must then fail. ``python tools/mutants.py`` applies each to a copy of the tree and runs its tests
there; a survivor is a failing check, fixed by a better test, never by deleting the mutant.

A file per area (``sandbox.py``, ``ppo.py``, ...) holds ``MUTANTS``, a list of ``Mutant``. The quick check of the
registry itself (every edit still applies to exactly one place, every named test exists) is
``tests/test_mutants.py``, in the suite."""
from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Mutant:
    name: str
    """unique across the registry: ``<area>-<what breaks>``"""
    file: str
    """the product file, relative to the repository's root"""
    find: str
    """the text to replace: it must occur exactly once in ``file``"""
    replace: str
    claim: str
    """what the code promises, which this edit breaks"""
    tests: tuple[str, ...]
    """pytest node ids (relative to the root) of which at least one must fail"""


def areas() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([HERE]))


def load(area: str | None = None) -> list[tuple[str, Mutant]]:
    """(area, mutant) for every mutant of ``area`` (all areas when None), in the registry's order."""
    out = []
    for a in areas():
        if area in (None, a):
            mod = importlib.import_module(f"{__name__}.{a}")
            out += [(a, m) for m in mod.MUTANTS]
    return out
