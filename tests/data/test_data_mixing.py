"""--dataset_probs / --max_samples / --seed: the documented mixing rule, its proportions and determinism."""
from collections import Counter

import pytest
from _data_testlib import sft_rows, write_jsonl

from rlhf.data import DataConfig, load_records
from rlhf.data.mixing import mix, parse_probs, quotas


@pytest.mark.parametrize("value, match", [
    ("0.5,0.6", r"--dataset_probs '0.5,0.6' sums to 1\.1"),
    ("1.0", r"--dataset_probs '1.0' has 1 values but --dataset has 2"),
    ("0.5,abc", r"--dataset_probs must be comma-separated numbers, got '0.5,abc'"),
    ("1.5,-0.5", r"--dataset_probs '1.5,-0.5': probabilities must be finite and >= 0"),
])
def test_bad_probs_name_the_flag_and_value(value, match):
    with pytest.raises(ValueError, match=match):
        parse_probs(value, 2)


def test_probs_within_tolerance_and_default():
    assert parse_probs("0.3333,0.3333,0.3334", 3) == [0.3333, 0.3333, 0.3334]
    assert parse_probs(None, 2) is None and parse_probs("", 2) is None


def test_quotas_follow_largest_remainder():
    assert quotas([100, 100, 100], [0.5, 0.3, 0.2], 10) == [5, 3, 2]
    assert quotas([100, 100, 100], [1 / 3, 1 / 3, 1 / 3], 10) == [4, 3, 3]  # tie -> lower index
    assert quotas([30, 10], None, None) == [30, 10]  # default: proportional to sizes, everything once
    assert quotas([30, 10], None, 20) == [15, 5]
    assert quotas([30, 10], [0.5, 0.5], 1000) == [20, 20]  # capped at N = 40; dataset 1 repeats


def test_mix_is_deterministic_and_uses_each_record_once_without_probs():
    a = mix([7, 5], None, None, seed=3)
    assert a == mix([7, 5], None, None, seed=3)
    assert a != mix([7, 5], None, None, seed=4)
    assert sorted(a) == [(0, i) for i in range(7)] + [(1, i) for i in range(5)]


def test_mix_upsamples_only_past_a_full_pass():
    pairs = mix([3, 100], [0.5, 0.5], 20, seed=0)
    small = Counter(j for s, j in pairs if s == 0)
    assert sum(small.values()) == 10 and set(small.values()) <= {3, 4}  # 3 full passes + 1 more
    big = [j for s, j in pairs if s == 1]
    assert len(big) == 10 and len(set(big)) == 10  # without replacement


def test_records_mix_in_proportion_and_are_capped(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", sft_rows(200, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", sft_rows(50, "b"))
    cfg = DataConfig(dataset=f"{a},{b}", dataset_probs="0.25,0.75", max_samples=80, seed=1)
    recs, stats = load_records(cfg, "sft")
    assert len(recs) == stats.num_mixed == 80
    assert stats.per_dataset == {a: 20, b: 60}
    assert Counter(r.path for r in recs) == {a: 20, b: 60}
    assert len({(r.path, r.index) for r in recs if r.path == b}) == 50  # all of b, then 10 repeats
    again, _ = load_records(cfg, "sft")
    assert [(r.path, r.index) for r in again] == [(r.path, r.index) for r in recs]
    other, _ = load_records(DataConfig(dataset=f"{a},{b}", dataset_probs="0.25,0.75", max_samples=80, seed=2),
                            "sft")
    assert [(r.path, r.index) for r in other] != [(r.path, r.index) for r in recs]
    # the shuffle interleaves sources rather than concatenating them
    assert {r.path for r in recs[:20]} == {a, b}


def test_config_rejects_bad_values(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", sft_rows(2))
    with pytest.raises(ValueError, match="--max_samples must be >= 1, got 0"):
        DataConfig(dataset=a, max_samples=0)
    with pytest.raises(ValueError, match=r"--dataset_probs '0.5,0.5' has 2 values but --dataset has 1"):
        DataConfig(dataset=a, dataset_probs="0.5,0.5")


def test_from_args_keeps_defaults_for_unset_non_nullable_flags(tmp_path):
    import argparse

    a = write_jsonl(tmp_path / "a.jsonl", sft_rows(2))
    args = argparse.Namespace(dataset=a, chosen_key=None, output_key=None, max_samples=100_000_000, seed=7,
                              train_batch_size=8)
    cfg = DataConfig.from_args(args, max_len=64)
    assert (cfg.chosen_key, cfg.output_key, cfg.max_samples, cfg.seed, cfg.max_len) == ("chosen", None, 100_000_000,
                                                                                       7, 64)
