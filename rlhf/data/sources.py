"""Read raw records from the ``--dataset`` flag: ``.jsonl``, ``.json``, ``.parquet`` files and HF ``save_to_disk``
folders, each record tagged with where it came from (file + 1-based line or row) for error messages.

    specs = parse_dataset_flag("a.jsonl,b.parquet,hf_folder@test")
    check_sources_exist(specs)          # every path, before reading any
    records = read_source(specs[0])     # list[Record]

Malformed entries (a JSONL line that is not JSON, a row that is not an object) come back as a ``Record`` with
``error`` set instead of raising here, so that ``--skip_bad_samples`` can count them with the other bad records.
Errors that concern a whole file (missing, empty, unreadable, unsupported) raise ``ValueError`` at once.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

log = logging.getLogger(__name__)

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_JSON_LIST_KEYS = ("data", "train")  # where a .json file that is an object keeps its records, in this order
_logged_readers: set[str] = set()


@dataclass(frozen=True)
class DatasetSpec:
    """One ``--dataset`` entry: a path, and for HF folders / JSON objects an optional ``@split``."""

    path: str
    split: str | None = None

    def __str__(self) -> str:
        return self.path if self.split is None else f"{self.path}@{self.split}"


@dataclass
class Record:
    """One raw record. ``index`` is 1-based: the physical line for ``.jsonl`` (``unit="line"``), else the row."""

    data: dict[str, Any] | None
    path: str
    index: int
    unit: str = "row"
    error: str | None = None  # why the raw entry is unusable (then ``data`` is None)

    @property
    def where(self) -> str:
        return f"{self.path}: {self.unit} {self.index}"


def parse_dataset_flag(value: str | Sequence[str]) -> list[DatasetSpec]:
    """Split the comma-separated ``--dataset`` value into specs.

    ``path@split`` selects a split; the ``@`` is only taken as a separator when the whole entry is not an existing
    path, so a file name that contains ``@`` still works.
    """
    entries = value.split(",") if isinstance(value, str) else list(value)
    entries = [e.strip() for e in entries]
    if not entries or any(not e for e in entries):
        raise ValueError(f"--dataset must be a comma-separated list of paths without empty entries, got {value!r}")
    specs = []
    for e in entries:
        if "@" in e and not os.path.exists(e):
            path, split = e.rsplit("@", 1)
            if not path or not split:
                raise ValueError(f"--dataset entry {e!r}: expected PATH or PATH@SPLIT")
            specs.append(DatasetSpec(path, split))
        else:
            specs.append(DatasetSpec(e))
    return specs


def _kind(spec: DatasetSpec) -> str:
    if os.path.isdir(spec.path):
        return "hf_disk"
    for suffix in FILE_SUFFIXES:
        if spec.path.endswith(suffix):
            return suffix[1:]
    raise ValueError(f"--dataset entry {spec}: unsupported file type; expected a {', '.join(FILE_SUFFIXES)} file "
                     f"or a folder written by datasets' save_to_disk")


def check_sources_exist(specs: Sequence[DatasetSpec]) -> None:
    """Raise ``ValueError`` naming the first entry that does not exist or has an unsupported type (reads nothing)."""
    for spec in specs:
        if not os.path.exists(spec.path):
            raise ValueError(f"--dataset entry {spec}: {spec.path} does not exist (hub dataset names are not "
                             f"fetched; save the dataset with datasets' save_to_disk and pass the folder)")
        kind = _kind(spec)
        if spec.split is not None and kind not in ("hf_disk", "json"):
            raise ValueError(f"--dataset entry {spec}: '@{spec.split}' selects a split of an HF save_to_disk folder "
                             f"or a key of a .json object; a .{kind} file has no splits")


def _log_reader_once(kind: str, how: str) -> None:
    if kind not in _logged_readers:
        _logged_readers.add(kind)
        log.info("reading %s datasets with %s", kind, how)


def _as_record(obj: Any, path: str, index: int, unit: str) -> Record:
    if isinstance(obj, dict):
        return Record(obj, path, index, unit)
    return Record(None, path, index, unit, error=f"expected a JSON object, got {type(obj).__name__}")


def _read_jsonl(spec: DatasetSpec) -> list[Record]:
    out = []
    with open(spec.path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue  # blank lines (often a trailing newline) are not records
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                out.append(Record(None, spec.path, lineno, "line", error=f"invalid JSON ({e.msg}, column {e.colno})"))
                continue
            out.append(_as_record(obj, spec.path, lineno, "line"))
    return out


def _read_json(spec: DatasetSpec) -> list[Record]:
    with open(spec.path, encoding="utf-8") as f:
        try:
            top = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{spec.path}: line {e.lineno}: invalid JSON ({e.msg}); a .json dataset must be one "
                             f"JSON document (use .jsonl for one object per line)") from None
    if isinstance(top, dict):
        keys = (spec.split,) if spec.split is not None else _JSON_LIST_KEYS
        key = next((k for k in keys if isinstance(top.get(k), list)), None)
        if key is None:
            want = f"'{spec.split}'" if spec.split is not None else " or ".join(repr(k) for k in _JSON_LIST_KEYS)
            raise ValueError(f"{spec.path}: a .json dataset must be a list of objects or an object whose {want} key "
                             f"holds that list; found keys {sorted(top)[:10]}")
        top = top[key]
    if not isinstance(top, list):
        raise ValueError(f"{spec.path}: a .json dataset must be a list of objects, got {type(top).__name__}")
    return [_as_record(obj, spec.path, i, "row") for i, obj in enumerate(top, 1)]


def _read_parquet(spec: DatasetSpec) -> list[Record]:
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"--dataset entry {spec}: reading .parquet files needs pyarrow, which is not installed: "
                         f"pip install pyarrow") from None
    _log_reader_once("parquet", f"pyarrow {pyarrow.__version__}")
    try:
        rows = pq.read_table(spec.path).to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
        raise ValueError(f"{spec.path}: not a readable parquet file: {e}") from None
    return [Record(row, spec.path, i, "row") for i, row in enumerate(rows, 1)]


def _read_hf_disk(spec: DatasetSpec) -> list[Record]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--dataset entry {spec}: {spec.path} is a folder; reading datasets' save_to_disk folders "
                         f"needs the datasets package, which is not installed: pip install datasets") from None
    _log_reader_once("hf_disk", f"datasets {datasets.__version__} load_from_disk")
    try:
        ds = datasets.load_from_disk(spec.path)
    except FileNotFoundError as e:
        raise ValueError(f"--dataset entry {spec}: {spec.path} is not a folder written by save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = sorted(ds)
        if spec.split is not None:
            split = spec.split
        elif len(splits) == 1:
            split = splits[0]
        elif "train" in ds:
            split = "train"
        else:
            raise ValueError(f"--dataset entry {spec}: the folder holds splits {splits}; pick one with PATH@SPLIT")
        if split not in ds:
            raise ValueError(f"--dataset entry {spec}: no split {split!r}; the folder holds {splits}")
        ds = ds[split]
    elif spec.split is not None:
        raise ValueError(f"--dataset entry {spec}: the folder holds a single Dataset without splits; drop "
                         f"'@{spec.split}'")
    return [Record(row, spec.path, i, "row") for i, row in enumerate(ds, 1)]


_READERS = {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet, "hf_disk": _read_hf_disk}


def read_source(spec: DatasetSpec) -> list[Record]:
    """All records of one spec, in file order. Raises ``ValueError`` if it is missing, unreadable or empty."""
    check_sources_exist([spec])
    records = _READERS[_kind(spec)](spec)
    if not records:
        raise ValueError(f"--dataset entry {spec}: the dataset is empty (no records)")
    return records
