"""Small writers for dataset files used by the tests in tests/data."""
from __future__ import annotations

import json
import os
from typing import Any


def write_jsonl(path: str | os.PathLike, rows: list[Any], blank_lines: tuple[int, ...] = ()) -> str:
    """One JSON value per line; a blank line is inserted before each 0-based row index in ``blank_lines``."""
    with open(path, "w", encoding="utf-8") as f:
        for i, r in enumerate(rows):
            if i in blank_lines:
                f.write("\n")
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def write_json(path: str | os.PathLike, obj: Any) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    return str(path)


def sft_rows(n: int, tag: str = "a") -> list[dict[str, str]]:
    words = "apple banana cherry delta echo golf hotel india".split()
    return [{"input": f"{tag} {words[i % 8]} {i}", "output": f"{words[(i + 3) % 8]} {tag} {i}"} for i in range(n)]
