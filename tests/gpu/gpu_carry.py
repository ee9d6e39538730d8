"""What the GPU check carries to the lent GPU machine, and its size against the 64 MiB a call may carry.

    python tests/gpu/gpu_carry.py            # one line per part, then the total; exit 1 if it is over the limit

The carry is the working tree as the device tool copies it (tracked files and untracked ones git does not ignore)
plus ``tests/gpu/wheels`` (ignored by git, named in the call's ``carry``): the wheels the machine lacks
(megatron-core, transformers, regex, liger-kernel; and for the GRPO part TRL with what its ``datasets`` needs beyond
the machine's own pyarrow, pandas and xxhash: trl, datasets, dill, multiprocess; tests/gpu/gpu_check.sh's header has
the command that fetches them). Where a wheel is not there yet, its size is measured by zipping the installed
package's files (deflate, as a wheel is), from the project's venv or TRL's (bench/.venv-trl).
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 64 << 20
WHEELS = {"megatron-core": "megatron_core", "transformers": "transformers", "regex": "regex",
          "liger-kernel": "liger_kernel", "trl": "trl", "datasets": "datasets", "dill": "dill",
          "multiprocess": "multiprocess"}
"""Distribution name -> wheel file prefix, for every package the GPU machine lacks."""
FETCHED_BYTES = {"trl": 992_576, "datasets": 608_276, "dill": 120_019, "multiprocess": 150_281}
"""The grpo part's wheels (trl-1.12.0, datasets-5.2.0, dill-0.4.1, multiprocess-0.70.19 for CPython 3.12), as
``pip download`` fetched them: their size where neither they nor TRL's venv are here."""


def tree_bytes(repo: str = REPO) -> int:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout.decode()
    return sum(os.path.getsize(os.path.join(repo, f)) for f in out.split("\0")
               if f and os.path.isfile(os.path.join(repo, f)))


def wheel_bytes(dist: str, prefix: str, wheels_dir: str) -> tuple[int, str]:
    """(bytes, how): the wheel in ``wheels_dir``, else the installed distribution zipped as a wheel would be."""
    if os.path.isdir(wheels_dir):
        found = [f for f in os.listdir(wheels_dir) if f.lower().startswith(prefix.lower() + "-") and f.endswith(".whl")]
        if found:
            return os.path.getsize(os.path.join(wheels_dir, found[0])), found[0]
    from importlib import metadata

    try:
        d = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        import glob

        found = [x for site in glob.glob(os.path.join(REPO, "bench", ".venv-trl", "lib", "python*", "site-packages"))
                 for x in metadata.distributions(name=dist, path=[site])]
        if not found:  # a CI machine: neither TRL's venv nor the fetched wheels
            return FETCHED_BYTES[dist], f"{dist}: not here; its wheel's size as fetched from PyPI on 2026-12-08"
        d = found[0]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for f in d.files or []:
            path = d.locate_file(f)
            if os.path.isfile(path) and "__pycache__" not in str(f):
                z.write(path, str(f))
    return buf.tell(), f"{dist} {d.version} installed here, zipped"


def carry(repo: str = REPO) -> dict[str, tuple[int, str]]:
    wheels_dir = os.path.join(repo, "tests", "gpu", "wheels")
    parts = {"tree": (tree_bytes(repo), "git ls-files (tracked and untracked, not ignored)")}
    for dist, prefix in WHEELS.items():
        parts[dist] = wheel_bytes(dist, prefix, wheels_dir)
    return parts


def main() -> int:
    parts = carry()
    total = sum(b for b, _ in parts.values())
    for name, (b, how) in parts.items():
        print(f"{name:15s} {b / 2**20:7.2f} MiB  ({how})")
    print(f"{'total':15s} {total / 2**20:7.2f} MiB of {LIMIT >> 20} MiB")
    return 0 if total < LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
