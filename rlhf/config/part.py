"""One typed part of a job's configuration (the parallel layout, the rollout, the algorithm, ...), in the manner
of torchtitan's ``JobConfig`` sections or megatron's ``TransformerConfig``.

A part is a dataclass that declares its own flags (``add_args``), is built once from the parsed flags at the entry
point (``from_args``: one field per flag ``dest``, plus values derived there), and checks its own values
(``check``: a ``ValueError`` naming the flag and its value). A component receives the part it needs, never the
argparse ``Namespace``. A flag is one field (``flag``: its names, default and help together); adding one touches
that field and the component that reads it.
"""
from __future__ import annotations

import argparse
import typing
from dataclasses import MISSING, field, fields
from typing import Any, TypeVar

P = TypeVar("P", bound="Part")


def flag(*names: str, default: Any = MISSING, default_factory: Any = MISSING, **argparse_kwargs: Any) -> Any:
    """A part's field that is a command-line flag, defined once: its option strings (``names``; default
    ``--<field name>``), its default (the field's and the flag's), and the rest of ``add_argument``'s keywords (help,
    type, choices, action, nargs, metavar, const). ``Part.add_args`` declares it from here, as megatron's
    ``megatron/training/argument_utils.py`` builds argparse from its dataclasses' fields. ``switches``: other
    names that each set the field to a constant, as ``((names...), const, help)`` (a peer's switch for one value).
    ``default`` may be ``config_default(SomeConfig, "field")``: the default of the component's own configuration
    that the flag sets, written once, there."""
    meta = {"flag": {"names": names, **argparse_kwargs}}
    if isinstance(default, _ConfigDefault):
        meta["default_from"] = default.where
        default = default.value
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


class _ConfigDefault:
    def __init__(self, value: Any, where: str) -> None:
        self.value, self.where = value, where


def config_default(config: type, name: str) -> Any:
    """For ``flag(default=...)``: the default of field ``name`` of a component's configuration (``OptimConfig``,
    ``RolloutConfig``, ``LoraConfig``, ``DataConfig``, ...), so that a flag and the configuration it fills share one
    written value; the flag's field records where it came from (``metadata["default_from"]``)."""
    f = config.__dataclass_fields__[name]
    if f.default is MISSING:
        raise TypeError(f"{config.__name__}.{name} has no default to share")
    return _ConfigDefault(f.default, f"{config.__name__}.{name}")


def config_field(config: type, name: str) -> Any:
    """A part's field that is no flag of its own (``add_args`` declares it) with ``config_default``'s value."""
    shared = config_default(config, name)
    return field(default=shared.value, metadata={"default_from": shared.where})


class Part:
    """Base of the typed parts. Subclasses are ``@dataclass``es."""

    DESTS: dict[str, str] = {}
    """field name -> the flag's ``dest`` where the two differ"""
    DERIVED: tuple[str, ...] = ()
    """init fields that no flag of this part sets: the entry point derives them (``from_args(ns, name=...)``)"""
    RESOLVED: tuple[str, ...] = ()
    """non-init fields the job's checks resolve (e.g. PPO's old log-probs' source), shown in ``Job.namespace``"""

    GROUP: str | None = None
    """the title of this part's group in ``--help`` (None: the group the entry point passes)"""

    @classmethod
    def add_args(cls, g: Any, *, skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
                 **changes: dict) -> None:
        """Declare this part's flags on an argparse group: each ``flag`` field, in field order (parts built only from
        other parts' flags declare none). ``skip`` / ``only``: the fields an entry point does not / does take;
        ``changes``: field -> keywords an entry point sets otherwise (a default, a help text, ``names``). A part with a
        ``GROUP`` title declares its flags in that group of the parser."""
        if cls.GROUP and isinstance(g, argparse.ArgumentParser):
            g = g.add_argument_group(cls.GROUP)
        for f in fields(cls):  # type: ignore[arg-type]
            spec = f.metadata.get("flag")
            if spec is None or f.name in skip or (only is not None and f.name not in only):
                continue
            kw = {k: v for k, v in spec.items() if k not in ("names", "switches")}
            if f.default is not MISSING:
                kw["default"] = f.default
            elif f.default_factory is not MISSING:  # type: ignore[misc]
                kw["default"] = f.default_factory()  # type: ignore[misc]
            kw.update(changes.get(f.name, {}))
            names = kw.pop("names", None) or spec["names"] or (f"--{f.name}",)
            g.add_argument(*names, **kw)
            for switch, const, text in spec.get("switches", ()):
                g.add_argument(*switch, dest=kw.get("dest", cls.DESTS.get(f.name, f.name)), action="store_const",
                               const=const, help=text)

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

    @classmethod
    def flag_dests(cls) -> set[str]:
        """The flag ``dest`` of every init field that a flag sets: the flags this part owns."""
        return {cls.DESTS.get(f.name, f.name) for f in fields(cls)  # type: ignore[arg-type]
                if f.init and f.name not in cls.DERIVED}


class Job:
    """A job's configuration: a dataclass with one field per part (the field's type, a ``Part``), built once at
    the entry point (``from_args``) and handed out part by part."""

    @classmethod
    def part_types(cls) -> dict[str, type[Part]]:
        """field name -> its part's class, in field order."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in fields(cls)  # type: ignore[arg-type]
                if isinstance(hints[f.name], type) and issubclass(hints[f.name], Part)}

    @classmethod
    def from_args(cls, ns: argparse.Namespace, derived: dict[str, dict[str, Any]] | None = None, **extra: Any):
        """Every part from the parsed flags, in field order (each checks its own values as it is built);
        ``derived``: part name -> the values its ``DERIVED`` fields take; ``extra``: the other fields."""
        derived = derived or {}
        return cls(**{name: t.from_args(ns, **derived.get(name, {})) for name, t in cls.part_types().items()},
                   **extra)

    def namespace(self) -> argparse.Namespace:
        """The job as one flat ``Namespace`` (every flag's ``dest`` with its value, resolved ones included), for
        the code that still reads flags by name: built from the parts, never the parsed flags themselves."""
        ns = argparse.Namespace()
        for part in self.parts():
            for f in fields(part):  # type: ignore[arg-type]
                if f.init and f.name not in part.DERIVED:
                    setattr(ns, part.DESTS.get(f.name, f.name), getattr(part, f.name))
            for name in part.RESOLVED:
                setattr(ns, name, getattr(part, name))
        return ns

    def parts(self) -> list[Part]:
        """Every part of the job (a field holding a dict of parts contributes each of them)."""
        out: list[Part] = []
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out.extend(x for x in (v.values() if isinstance(v, dict) else [v]) if isinstance(x, Part))
        return out
