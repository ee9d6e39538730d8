"""Weights & Biases (--use_wandb, OpenRLHF's companion flags) with the real ``wandb`` package, offline (no key, no
network): rank 0 logs the same scalars as TensorBoard at the same steps, the run carries the flags' project, group
and name, and a resumed job continues the same run. The run file is read back here with its own record format
(LevelDB log blocks of wandb's protobuf records), not through our code."""
from __future__ import annotations

import glob

import pytest

from test_sft_rm_faults import sft_args
from wandb_files import wandb_records

# Training runs in this process (main(argv)): pytest-timeout interrupts a test whose run hangs after 300 s, 5x the
# slowest of these files' tests on a loaded 2-core AMD EPYC (36-62 s, 2026-11-27; test_rlvr_options 11-50 s).
pytestmark = pytest.mark.timeout(300)


def test_wandb_offline_logs_as_tensorboard_and_resume_continues_the_run(train_setup, tmp_path, monkeypatch, capsys):
    import json

    from helpers import free_port
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlhf.supervised import sft
    from rlhf.supervised.loop import main as run_main

    def main(argv):
        return run_main(sft, argv)

    for k in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc key: the offline fallback
    monkeypatch.setenv("WANDB_SILENT", "true")
    save = tmp_path / "o"
    flags = {"--use_wandb": "", "--wandb_project": "proj", "--wandb_group": "grp", "--wandb_run_name": "sft-run",
             "--tensorboard": str(save / "tb")}
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert main(sft_args(train_setup, str(save), **flags, **{"--stop_after_steps": "3"})) == 0
    err = capsys.readouterr().err
    assert "wandb: no API key" in err and "logging offline" in err, err[-2000:]
    first_id = open(save / "wandb_run_id").read()
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert main(sft_args(train_setup, str(save), **flags, **{"--load_checkpoint": ""})) == 0
    assert open(save / "wandb_run_id").read() == first_id  # the same run, continued
    runs = sorted(glob.glob(str(save / "wandb" / f"offline-run-*-{first_id}" / f"run-{first_id}.wandb")))
    assert len(runs) == 2, runs
    history, run_meta = {}, []
    for path in runs:
        for rec in wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                items = {k: v for k, v in items.items() if not k.startswith("_")}
                history.setdefault(rec.history.step.num, {}).update(items)
            elif kind == "run":
                run_meta.append((rec.run.project, rec.run.run_group, rec.run.display_name, rec.run.run_id))
    assert set(run_meta) == {("proj", "grp", "sft-run", first_id)}, run_meta
    ev = EventAccumulator(str(save / "tb"))
    ev.Reload()
    tb = {}
    for tag in ev.Tags()["scalars"]:
        for e in ev.Scalars(tag):
            tb.setdefault(e.step, {})[tag] = e.value
    assert sorted(history) == sorted(tb) == list(range(1, len(tb) + 1)) and len(tb) > 3, (sorted(history), sorted(tb))
    for step in tb:  # the same names and values (TensorBoard stores float32)
        assert set(history[step]) == set(tb[step]), step
        for k, v in tb[step].items():
            assert abs(history[step][k] - v) <= 1e-6 * max(1.0, abs(v)), (step, k, history[step][k], v)
    assert "sft/loss" in tb[len(tb)]
