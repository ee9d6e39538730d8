"""MLflow (--use_mlflow) with the real ``mlflow`` package and a real local store, read back from the store's own files
(``<experiment>/<run>/metrics/<key>``: one "timestamp value step" line per logged value; ``params/<key>``), not
through our code nor MLflow's client: a PPO run (launch/ppo.py's body in this process, one rank) logging to W&B
(offline) and MLflow at once gives MLflow every metric W&B got, under the same name (sanitised as verl does), at the
same step with the same value, and W&B's configuration as its params; a job resumed into the same --save_path
continues the same MLflow run, which ends FINISHED. The MLflow flags come from a ``--config`` YAML file, and the
resolved flags are written beside the run. The default store (no --mlflow_tracking_uri, no
$MLFLOW_TRACKING_URI) is a file store under --save_path."""
from __future__ import annotations

import glob
import os

import pytest

from ppo_common import TINY_GRPO, ppo_args

pytestmark = pytest.mark.timeout(300)


def read_store(root: str) -> dict:
    """{run id: {"exp", "name", "status", "metrics": {key: {step: value}}, "params": {key: value}}} of a file store."""
    runs = {}
    for meta in glob.glob(os.path.join(root, "*", "*", "meta.yaml")):
        run_dir = os.path.dirname(meta)
        fields = dict(line.split(": ", 1) for line in open(meta).read().splitlines() if ": " in line)
        metrics: dict = {}
        for path in glob.glob(os.path.join(run_dir, "metrics", "**"), recursive=True):
            if os.path.isfile(path):
                key = os.path.relpath(path, os.path.join(run_dir, "metrics"))
                for line in open(path).read().splitlines():
                    _, value, step = line.split()
                    metrics.setdefault(key, {})[int(step)] = float(value)
        params = {}
        for path in glob.glob(os.path.join(run_dir, "params", "**"), recursive=True):
            if os.path.isfile(path):
                params[os.path.relpath(path, os.path.join(run_dir, "params"))] = open(path).read()
        runs[os.path.basename(run_dir)] = {"exp": os.path.basename(os.path.dirname(run_dir)),
                                           "name": fields.get("run_name"), "status": fields.get("status"),
                                           "metrics": metrics, "params": params}
    return runs


def test_mlflow_logs_what_wandb_logs_and_resume_continues_the_run(ppo_setup, tmp_path, monkeypatch, capsys):
    from helpers import free_port
    from wandb_files import wandb_history_and_config

    from rlhf.ppo import main

    for k in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    save, store = tmp_path / "o", tmp_path / "store"
    flags = {**TINY_GRPO, "--reward_fn": "_rule_reward:char_code_reward", "--rollout_backend": "megatron",
             "--max_samples": "8", "--save_steps": "1", "--use_wandb": "", "--eval_dataset": ppo_setup["prompts"],
             "--eval_steps": "1", "--eval_n_samples_per_prompt": "2", "--eval_max_samples": "4"}
    cfg = tmp_path / "tracking.yaml"  # the trackers' flags from a --config file (rlhf/config/config_file.py)
    cfg.write_text(f"use_mlflow: true\nmlflow_tracking_uri: file:{store}\nmlflow_experiment_name: exp-a\n"
                   "mlflow_run_name: ppo-run\n")
    flags["--config"] = str(cfg)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert main(ppo_args(ppo_setup, str(save), **flags, **{"--stop_after_steps": "1"})) == 0
    first = open(save / "mlflow_run_id").read()
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert main(ppo_args(ppo_setup, str(save), **flags, **{"--load_checkpoint": ""})) == 0
    err = capsys.readouterr().err
    assert open(save / "mlflow_run_id").read() == first
    import yaml

    resolved = yaml.safe_load(open(save / "run_config.yaml"))  # the second run's flags, the file's among them
    assert resolved["use_mlflow"] is True and resolved["mlflow_run_name"] == "ppo-run"
    assert resolved["load_checkpoint"] is True and resolved["save_steps"] == 1
    runs = read_store(str(store))
    assert list(runs) == [first], runs.keys()
    run = runs[first]
    assert run["name"] == "ppo-run" and run["status"] == "3", run["status"]  # RunStatus.FINISHED == 3
    history, configs = {}, []
    for path in sorted(glob.glob(str(save / "wandb" / "offline-run-*" / "run-*.wandb"))):  # in time order
        h, c = wandb_history_and_config(path)
        for step, items in h.items():
            history.setdefault(step, {}).update(items)
        configs.append(c)
    assert len(configs) == 2
    config = configs[0]  # the first run's (MLflow keeps a param as first logged; W&B's config takes the resume's)
    assert sorted(history) == [0, 1, 2], sorted(history)  # the evaluation at step 0, then the two steps
    from rlhf.observability.mlflow_log import sanitize_key

    want = {}
    for step, items in history.items():
        for k, v in items.items():
            want.setdefault(sanitize_key(k), {})[step] = v
    assert set(run["metrics"]) == set(want), set(run["metrics"]) ^ set(want)
    for k, by_step in want.items():
        for step, v in by_step.items():
            assert run["metrics"][k][step] == pytest.approx(v, rel=1e-12, abs=1e-12), (k, step)
    renamed = [k for s in history.values() for k in s if sanitize_key(k) != k]
    assert renamed and f"mlflow: metric {renamed[0]} logged as {sanitize_key(renamed[0])}" in err, renamed
    assert len(run["params"]) > 100 and set(run["params"]) == set(config), set(run["params"]) ^ set(config)
    for k, v in config.items():
        assert run["params"][k] == str(v), (k, run["params"][k], v)
    changed = sorted(k for k in config if configs[1][k] != config[k])
    assert changed == ["load_checkpoint", "stop_after_steps"], changed
    assert "mlflow: params differing from the resumed run's, kept as first logged: load_checkpoint, " \
           "stop_after_steps" in err, err[-3000:]


def test_the_default_store_is_a_file_store_under_save_path(tmp_path, monkeypatch):
    """No flag and no $MLFLOW_TRACKING_URI: ``file:<save_path>/mlruns``, the file store allowed for this process;
    $MLFLOW_TRACKING_URI wins over the default; the part refuses its flags without --use_mlflow."""
    import argparse

    from rlhf.observability.mlflow_log import MlflowPart, MlflowRun, tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    args = argparse.Namespace(mlflow_tracking_uri=None, mlflow_experiment_name="e", mlflow_run_name=None,
                              save_path=str(tmp_path / "job"), load_checkpoint=False)
    run = MlflowRun(args, {"lr": 0.5})
    run.log({"ppo/reward": 1.5, "eval/pass@2": 0.25}, step=3)
    run.finish()
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    store = read_store(str(tmp_path / "job" / "mlruns"))
    assert list(store) == [run.run_id] and store[run.run_id]["name"] == "job"
    assert store[run.run_id]["metrics"] == {"ppo/reward": {3: 1.5}, "eval/pass_at_2": {3: 0.25}}
    assert store[run.run_id]["params"] == {"lr": "0.5"}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracker:5000")
    assert tracking_uri(None, "x") == "http://tracker:5000" and tracking_uri("file:/y", "x") == "file:/y"
    with pytest.raises(ValueError, match="--mlflow_tracking_uri file:/y without --use_mlflow"):
        MlflowPart(mlflow_tracking_uri="file:/y").check()
