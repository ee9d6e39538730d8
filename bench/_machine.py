"""What a bench records beside its figures: the commit it ran and the CPU it ran on."""
from __future__ import annotations

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit() -> str:
    """The checkout's short commit hash."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip()


def cpu_model() -> str:
    """lscpu's model name, the core count and the bf16 units the figures depend on (AVX-512, AVX512_BF16, AMX)."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln for ln in out.splitlines() if ln.startswith("Flags")), "")
    units = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return f"{name}, {os.cpu_count()} cores, {'/'.join(units) or 'AVX2 only'}"
