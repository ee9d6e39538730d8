"""Read raw records from the ``--dataset`` flag: ``.jsonl``, ``.json``, ``.parquet`` files, HF ``save_to_disk``
folders, Hub snapshot folders (a downloaded dataset repository: data files, splits from its README's ``configs``
or from the file names) and Hub names already in the local HF cache (offline: nothing is fetched), each record
tagged with where it came from (file + 1-based line or row) for error messages.

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


SNAPSHOT_SUFFIXES = (".parquet", ".jsonl", ".json", ".arrow")
_SAVE_TO_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def hub_cache_dir() -> str:
    """Where ``huggingface_hub`` keeps downloaded repositories (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/...)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def resolve_hub_name(name: str) -> str | None:
    """The local snapshot folder of Hub dataset ``org/name`` in the HF cache (the revision ``refs/main`` names,
    else the newest), or None. Offline: nothing is downloaded."""
    if os.path.exists(name) or name.count("/") > 1 or name.startswith((".", "/")):
        return None
    repo = os.path.join(hub_cache_dir(), "datasets--" + name.replace("/", "--"))
    snaps = os.path.join(repo, "snapshots")
    if not os.path.isdir(snaps):
        return None
    ref = os.path.join(repo, "refs", "main")
    if os.path.exists(ref):
        with open(ref) as f:
            rev = os.path.join(snaps, f.read().strip())
        if os.path.isdir(rev):
            return rev
    revs = sorted((os.path.join(snaps, r) for r in os.listdir(snaps)), key=os.path.getmtime)
    return revs[-1] if revs else None


def local_path(spec: DatasetSpec) -> str:
    """The path to read: the entry itself, or the cached snapshot of a Hub name."""
    return spec.path if os.path.exists(spec.path) else (resolve_hub_name(spec.path) or spec.path)


def _has_data_files(folder: str) -> bool:
    return any(f.endswith(SNAPSHOT_SUFFIXES) for _, _, files in os.walk(folder) for f in files)


def _kind(spec: DatasetSpec) -> str:
    path = local_path(spec)
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, m)) for m in _SAVE_TO_DISK_MARKERS) or not _has_data_files(path):
            return "hf_disk"  # (a folder with neither gets save_to_disk's own error)
        return "snapshot"
    for suffix in FILE_SUFFIXES:
        if spec.path.endswith(suffix):
            return suffix[1:]
    raise ValueError(f"--dataset entry {spec}: unsupported file type; expected a {', '.join(FILE_SUFFIXES)} file "
                     f"or a folder written by datasets' save_to_disk")


def check_sources_exist(specs: Sequence[DatasetSpec]) -> None:
    """Raise ``ValueError`` naming the first entry that does not exist or has an unsupported type (reads nothing)."""
    for spec in specs:
        if not os.path.exists(local_path(spec)):
            raise ValueError(f"--dataset entry {spec}: {spec.path} does not exist, and no Hub dataset of that name is "
                             f"in the local HF cache ({hub_cache_dir()}); nothing is downloaded: fetch it first "
                             f"(huggingface-cli download --repo-type dataset {spec.path}) or pass a local path")
        kind = _kind(spec)
        if spec.split is not None and kind not in ("hf_disk", "json", "snapshot"):
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
        ds = datasets.load_from_disk(local_path(spec))
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


def snapshot_splits(folder: str) -> dict[str, list[str]]:
    """``{split: [data files]}`` of a Hub snapshot folder: from the README's YAML ``configs`` (the ``default``
    config, else the first) when it declares them, else from the file names (``train-00000-of-00002.parquet``,
    ``test.jsonl``, ``data/validation/...``); files of no recognizable split belong to ``train``."""
    import glob
    import re

    declared = _readme_configs(folder)
    if declared:
        out: dict[str, list[str]] = {}
        for split, patterns in declared.items():
            files = sorted({f for pat in patterns for f in glob.glob(os.path.join(folder, pat), recursive=True)})
            out[split] = [f for f in files if f.endswith(SNAPSHOT_SUFFIXES)]
        return {k: v for k, v in out.items() if v}
    out = {}
    for dirpath, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.endswith(SNAPSHOT_SUFFIXES):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            parts = re.split(r"[/\\\-_.]", rel.lower())
            split = next((p for p in parts if p in ("train", "test", "validation", "valid", "dev", "eval")), "train")
            out.setdefault(split, []).append(os.path.join(dirpath, name))
    return out


def _readme_configs(folder: str) -> dict[str, list[str]]:
    readme = os.path.join(folder, "README.md")
    if not os.path.exists(readme):
        return {}
    text = open(readme, encoding="utf-8").read()
    if not text.startswith("---"):
        return {}
    import yaml

    try:
        meta = yaml.safe_load(text.split("---", 2)[1]) or {}
    except yaml.YAMLError:
        return {}
    configs = meta.get("configs") or []
    if not configs:
        return {}
    cfg = next((c for c in configs if c.get("config_name") == "default"), configs[0])
    files = cfg.get("data_files") or []
    if isinstance(files, (str, list)) and not (isinstance(files, list) and files and isinstance(files[0], dict)):
        return {"train": [files] if isinstance(files, str) else list(files)}
    out: dict[str, list[str]] = {}
    for entry in files:
        paths = entry.get("path")
        out.setdefault(entry.get("split", "train"), []).extend([paths] if isinstance(paths, str) else paths)
    return out


def _read_snapshot(spec: DatasetSpec) -> list[Record]:
    folder = local_path(spec)
    splits = snapshot_splits(folder)
    if not splits:
        raise ValueError(f"--dataset entry {spec}: {folder} holds no data files ({', '.join(SNAPSHOT_SUFFIXES)}) "
                         f"and is not a save_to_disk folder")
    if spec.split is not None:
        split = spec.split
    elif len(splits) == 1:
        split = next(iter(splits))
    elif "train" in splits:
        split = "train"
    else:
        raise ValueError(f"--dataset entry {spec}: the dataset has splits {sorted(splits)}; pick one with NAME@SPLIT")
    if split not in splits:
        raise ValueError(f"--dataset entry {spec}: no split {split!r}; the dataset has {sorted(splits)}")
    _log_reader_once("snapshot", "its data files (Hub snapshot layout)")
    out: list[Record] = []
    for f in splits[split]:
        shard = DatasetSpec(f)
        out += _read_arrow(shard) if f.endswith(".arrow") else _READERS[_kind(shard)](shard)
    return out


def _read_arrow(spec: DatasetSpec) -> list[Record]:
    import pyarrow as pa

    try:
        with pa.memory_map(spec.path) as src:
            try:
                table = pa.ipc.open_stream(src).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_file(src).read_all()
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{spec.path}: not a readable Arrow file: {e}") from None
    return [Record(row, spec.path, i, "row") for i, row in enumerate(table.to_pylist(), 1)]


_READERS = {"jsonl": _read_jsonl, "json": _read_json, "parquet": _read_parquet, "hf_disk": _read_hf_disk,
            "snapshot": _read_snapshot}


def read_source(spec: DatasetSpec) -> list[Record]:
    """All records of one spec, in file order. Raises ``ValueError`` if it is missing, unreadable or empty."""
    check_sources_exist([spec])
    records = _READERS[_kind(spec)](spec)
    if not records:
        raise ValueError(f"--dataset entry {spec}: the dataset is empty (no records)")
    return records
