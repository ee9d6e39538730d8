"""One typed part of a job's configuration (the parallel layout, the rollout, the algorithm, ...), in the manner
of torchtitan's ``JobConfig`` sections or megatron's ``TransformerConfig``.

A part is a dataclass that declares its own flags (``add_args``), is built once from the parsed flags at the entry
point (``from_args``: one field per flag ``dest``, plus values derived there), and checks its own values
(``check``: a ``ValueError`` naming the flag and its value). A component receives the part it needs, never the
argparse ``Namespace``. Adding a flag touches the part's ``add_args``, one field, and the component that reads it.
"""
from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any, TypeVar

P = TypeVar("P", bound="Part")


class Part:
    """Base of the typed parts. Subclasses are ``@dataclass``es."""

    DESTS: dict[str, str] = {}
    """field name -> the flag's ``dest`` where the two differ"""

    @classmethod
    def add_args(cls, g: Any) -> None:
        """Declare this part's flags on an argparse group (parts built only from other parts' flags declare none)."""

    @classmethod
    def from_args(cls: type[P], ns: argparse.Namespace, **derived: Any) -> P:
        """The part from the parsed flags: each init field from the flag of its name (or ``DESTS``), the fields
        given in ``derived`` from those values; then ``check``. A field that is neither is a wiring error."""
        kw: dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if not f.init:
                continue
            if f.name in derived:
                kw[f.name] = derived.pop(f.name)
                continue
            dest = cls.DESTS.get(f.name, f.name)
            if not hasattr(ns, dest):
                raise TypeError(f"{cls.__name__}.{f.name}: no flag dest {dest!r} in the parsed flags and no derived "
                                f"value given")
            kw[f.name] = getattr(ns, dest)
        if derived:
            raise TypeError(f"{cls.__name__}: no fields {sorted(derived)}")
        part = cls(**kw)
        part.check()
        return part

    def check(self) -> None:
        """Checks of this part's own values: ``ValueError`` naming the flag and its value."""
