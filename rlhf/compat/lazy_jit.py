"""Defer megatron-core's ``torch.compile`` decorators to the first call (megatron-core 0.16.1: ``jit_fuser``
compiles at import, 1.5-3 s per process).

``megatron.core.jit.jit_fuser`` is ``torch.compile``, applied when megatron-core's modules are imported. Applying
it imports ``torch._dynamo`` and ``torch._inductor``: 1.5-3 s of CPU in every process that imports megatron-core,
although the decorated fusions are off in our configs (``rlhf.models.gpt``) and most are never called. Importing
``rlhf`` installs an import hook that wraps ``jit_fuser`` as soon as ``megatron.core.jit`` has run, so that a
decorated function is compiled by the same ``torch.compile`` call, with the same arguments, when it is first
called, instead of when it is defined. Nothing else changes; a process that imports megatron before ``rlhf``
keeps megatron's eager behaviour. Standard library only: importing ``rlhf`` stays light.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

_TARGET = "megatron.core.jit"


def lazy_compile(compile_fn: Callable[..., Callable]) -> Callable[..., Any]:
    """A decorator with ``torch.compile``'s call forms (``@c``, ``@c(**kw)``, ``c(fn, **kw)``) that runs
    ``compile_fn(fn, **kw)`` at the first call of ``fn``."""

    def deco(fn=None, **kwargs):
        if fn is None:
            return lambda f: deco(f, **kwargs)
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(fn, **kwargs)
            return compiled(*args, **kw)

        call.__rlhf_lazy_compile__ = True
        return call

    deco.__rlhf_lazy_compile__ = True
    return deco


# megatron-core 0.16.1: jit_fuser is torch.compile applied at import (1.5-3 s of torch._dynamo per process).
def _patch(module: Any) -> None:
    import torch

    if getattr(module, "jit_fuser", None) is torch.compile:
        module.jit_fuser = lazy_compile(torch.compile)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    if _TARGET in sys.modules:
        _patch(sys.modules[_TARGET])  # too late for modules that already imported it by name
        return
    sys.meta_path.insert(0, _Finder())
