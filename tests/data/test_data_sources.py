"""Readers: every file format, provenance (1-based line / row), and the file-level errors."""
import sys

import pytest
from _data_testlib import sft_rows, write_json, write_jsonl
from helpers import require

from rlhf.data.sources import DatasetSpec, check_sources_exist, parse_dataset_flag, read_source


def _read(path: str):
    specs = parse_dataset_flag(path)
    assert len(specs) == 1
    return read_source(specs[0])


def test_jsonl_records_keep_physical_line_numbers(tmp_path):
    rows = sft_rows(3)
    path = write_jsonl(tmp_path / "d.jsonl", rows, blank_lines=(1,))  # line 2 is blank
    recs = _read(path)
    assert [r.data for r in recs] == rows
    assert [r.index for r in recs] == [1, 3, 4]
    assert recs[1].where == f"{path}: line 3"


def test_jsonl_bad_lines_become_error_records(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ['{"input": "x", "output": "y"}', "{not json", "[1, 2]"])
    recs = _read(path)
    assert recs[0].error is None
    assert recs[1].data is None and "invalid JSON" in recs[1].error and recs[1].index == 2
    assert "expected a JSON object, got list" in recs[2].error


@pytest.mark.parametrize("wrap", [None, "data", "train"])
def test_json_list_or_object(tmp_path, wrap):
    rows = sft_rows(4)
    path = write_json(tmp_path / "d.json", rows if wrap is None else {wrap: rows, "meta": 1})
    recs = _read(path)
    assert [r.data for r in recs] == rows
    assert [r.where for r in recs][-1] == f"{path}: row 4"


def test_json_split_selects_key_and_unknown_shape_errors(tmp_path):
    path = write_json(tmp_path / "d.json", {"train": sft_rows(2), "test": sft_rows(1, "t")})
    assert [r.data for r in _read(path + "@test")] == sft_rows(1, "t")
    bad = write_json(tmp_path / "bad.json", {"rows": sft_rows(1)})
    with pytest.raises(ValueError, match=r"bad\.json.*'data' or 'train'.*\['rows'\]"):
        _read(bad)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"input": "a"},\n{oops}]')
    with pytest.raises(ValueError, match=r"broken\.json: line 2: invalid JSON"):
        _read(str(broken))


def test_missing_empty_and_unsupported_files(tmp_path):
    with pytest.raises(ValueError, match=r"--dataset entry .*nope\.jsonl.*does not exist"):
        check_sources_exist(parse_dataset_flag(f"{write_jsonl(tmp_path / 'ok.jsonl', sft_rows(1))},"
                                               f"{tmp_path / 'nope.jsonl'}"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: the dataset is empty"):
        _read(str(empty))
    with pytest.raises(ValueError, match=r"empty\.json: the dataset is empty"):
        _read(write_json(tmp_path / "empty.json", []))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"d\.csv: unsupported file type"):
        _read(str(tmp_path / "d.csv"))
    with pytest.raises(ValueError, match=r"a \.jsonl file has no splits"):
        _read(write_jsonl(tmp_path / "s.jsonl", sft_rows(1)) + "@train")
    with pytest.raises(ValueError, match="--dataset must be"):
        parse_dataset_flag("a.jsonl,,b.jsonl")


def test_parquet(tmp_path):
    require("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sft_rows(5)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    recs = _read(str(tmp_path / "d.parquet"))
    assert [r.data for r in recs] == rows and recs[4].where.endswith("d.parquet: row 5")


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match="pip install pyarrow"):
        _read(str(tmp_path / "d.parquet"))


def test_hf_folder_without_datasets_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "folder").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match="pip install datasets"):
        _read(str(tmp_path / "folder"))


def test_hf_save_to_disk_dataset_and_splits(tmp_path):
    require("datasets")
    import datasets
    rows = sft_rows(4)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "single"))
    recs = _read(str(tmp_path / "single"))
    assert [r.data for r in recs] == rows and recs[0].where.endswith("single: row 1")
    with pytest.raises(ValueError, match="single Dataset without splits"):
        _read(str(tmp_path / "single") + "@train")

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                               "test": datasets.Dataset.from_list(sft_rows(2, "t"))})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert [r.data for r in _read(str(tmp_path / "dict"))] == rows  # 'train' by default
    assert [r.data for r in _read(str(tmp_path / "dict") + "@test")] == sft_rows(2, "t")
    with pytest.raises(ValueError, match=r"no split 'dev'"):
        _read(str(tmp_path / "dict") + "@dev")

    datasets.DatasetDict({"a": datasets.Dataset.from_list(rows), "b": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "ambiguous"))
    with pytest.raises(ValueError, match=r"holds splits \['a', 'b'\]; pick one"):
        _read(str(tmp_path / "ambiguous"))


def test_at_in_an_existing_file_name_is_not_a_split(tmp_path):
    path = write_jsonl(tmp_path / "v1@final.jsonl", sft_rows(1))
    assert parse_dataset_flag(path) == [DatasetSpec(path)]
    assert parse_dataset_flag("x/folder@test") == [DatasetSpec("x/folder", "test")]
