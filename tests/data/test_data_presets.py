"""Hub snapshot folders, Hub names from the local HF cache, and the seed datasets' layouts (rlhf/data/sources.py,
rlhf/data/presets.py), read through the same load_records the trainers use."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.data.build import load_records
from rlhf.data.config import DataConfig
from rlhf.data.sources import DatasetSpec, read_source

README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
  - split: test
    path: data/test-*
---
# a dataset card
"""


def _snapshot(root, readme: bool = True):
    (root / "data").mkdir(parents=True)
    rows = {"train-00000-of-00002": [{"i": 0}, {"i": 1}], "train-00001-of-00002": [{"i": 2}],
            "test-00000-of-00001": [{"i": 10}]}
    for name, rs in rows.items():
        pq.write_table(pa.Table.from_pylist(rs), root / "data" / f"{name}.parquet")
    if readme:
        (root / "README.md").write_text(README)
    return root


@pytest.mark.parametrize("readme", [True, False])
def test_snapshot_folder_splits(tmp_path, readme):
    folder = _snapshot(tmp_path / "snap", readme)
    assert [r.data["i"] for r in read_source(DatasetSpec(str(folder)))] == [0, 1, 2]
    assert [r.data["i"] for r in read_source(DatasetSpec(str(folder), "test"))] == [10]
    with pytest.raises(ValueError, match=r"no split 'dev'; the dataset has \['test', 'train'\]"):
        read_source(DatasetSpec(str(folder), "dev"))


def test_hub_name_from_the_local_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    repo = cache / "datasets--someorg--prefs"
    _snapshot(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    cfg = DataConfig(dataset="someorg/prefs@test", input_key="i", output_key=None, dataset_format="plain")
    assert [r.data["i"] for r in read_source(cfg.specs[0])] == [10]
    from rlhf.config.job import check_paths_exist

    check_paths_exist("--dataset", "someorg/prefs@test")
    with pytest.raises(ValueError, match=r"--prompt_data: not found: someorg/other \(nor a Hub dataset in the local HF "
                                         r"cache"):
        check_paths_exist("--prompt_data", "someorg/other")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_webgpt_comparisons(tmp_path):
    rows = [{"question": {"full_text": "Why?"}, "answer_0": "A", "answer_1": "B", "score_0": -1.0, "score_1": 1.0,
             "quotes_0": {}, "quotes_1": {}},
            {"question": {"full_text": "How?"}, "answer_0": "C", "answer_1": "D", "score_0": 0.0, "score_1": 0.0,
             "quotes_0": {}, "quotes_1": {}},  # a tie: no preference, dropped
            {"question": {"full_text": "What?"}, "answer_0": "E", "answer_1": "F", "score_0": 2.0, "score_1": 0.5,
             "quotes_0": {}, "quotes_1": {}}]
    path = _jsonl(tmp_path / "webgpt_comparisons.jsonl", rows)
    records, _ = load_records(DataConfig(dataset=path, prompt_key="prompt", seed=0), "rm")
    got = sorted((r.data["prompt"], r.data["chosen"], r.data["rejected"]) for r in records)
    assert got == [("What?", "E", "F"), ("Why?", "B", "A")]


def test_hh_rlhf_dialogues(tmp_path):
    prompt = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: sort 3 1 2\n\nAssistant:"
    rows = [{"chosen": prompt + " 1 2 3", "rejected": prompt + " 3 2 1"},
            {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: x\n\nAssistant: y"}]
    path = _jsonl(tmp_path / "train.jsonl", rows)  # detected from the keys and texts, not the name
    cfg = DataConfig(dataset=path, prompt_key="prompt", input_key="prompt", skip_bad_samples=True, seed=0)
    records, stats = load_records(cfg, "rm")
    assert [(r.data["prompt"], r.data["chosen"], r.data["rejected"]) for r in records] == [(prompt, "1 2 3", "3 2 1")]
    assert stats.num_bad_skipped == 1  # the pair whose dialogues differ before the last turn
    sft, _ = load_records(DataConfig(dataset=path, input_key="input", output_key="output", skip_bad_samples=True,
                                     dataset_format="hh"), "sft")
    assert (sft[0].data["input"], sft[0].data["output"]) == (prompt, "1 2 3")


def test_chat_preference_mixture(tmp_path):
    """chosen/rejected as whole conversations without a prompt field: the shared turns are the prompt."""
    shared = [{"role": "user", "content": "sort 3 1 2"}]
    rows = [{"chosen": shared + [{"role": "assistant", "content": "1 2 3"}],
             "rejected": shared + [{"role": "assistant", "content": "3 2 1"}]}]
    path = _jsonl(tmp_path / "mix.jsonl", rows)
    records, _ = load_records(DataConfig(dataset=path, prompt_key="prompt", apply_chat_template=True), "rm")
    d = records[0].data
    assert (d["prompt"], d["chosen"], d["rejected"]) == (shared, [{"role": "assistant", "content": "1 2 3"}],
                                                          [{"role": "assistant", "content": "3 2 1"}])


def test_unknown_keys_name_what_was_found_and_the_flags(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError, match=r"its records have keys \['answer', 'question'\]: map them with "
                                         r"--input_key/--output_key .*--dataset_format \(webgpt, hh, chat\)"):
        load_records(DataConfig(dataset=path), "sft")
