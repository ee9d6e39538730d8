"""MLflow tracking (``--use_mlflow``): rank 0 logs every scalar that W&B gets, under the same names and steps, and the
same configuration (the job's flags) as the run's params. The store is ``--mlflow_tracking_uri``, else
``$MLFLOW_TRACKING_URI``, else a local file store under ``<save_path>/mlruns`` (MLflow's filesystem backend, which
MLflow 3 keeps in maintenance mode and opens only with ``MLFLOW_ALLOW_FILE_STORE=true``: set for this process when
that default is taken, logged once). A job resumed into the same ``--save_path`` (``--load_checkpoint``) continues
the run whose id is saved there, as the W&B run does.

Metric keys are sanitised as verl's ``_MlflowLoggingAdapter`` does (verl/utils/tracking.py at b178a3cd): ``@`` becomes
``_at_``, repeated slashes one, any other character MLflow refuses ``_`` (``eval/pass@4`` -> ``eval/pass_at_4``),
each renamed key logged once."""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

from rlhf.config.part import Part, flag

log = logging.getLogger("rlhf")
MLFLOW_ID_FILE = "mlflow_run_id"
"""Under --save_path: the MLflow run id, so a resumed job continues the same run."""
_INVALID = re.compile(r"[^/\w.\- :]")
_SLASHES = re.compile(r"/+")
PARAM_MAX = 6000
"""MLflow's longest param value (mlflow/utils/validation.py MAX_PARAM_VAL_LENGTH); longer values are cut, logged"""


@dataclass(frozen=True)
class MlflowPart(Part):
    """MLflow tracking (rank 0), beside TensorBoard and W&B."""

    use_mlflow: bool = flag(action="store_true", help="log the metrics and the flags to MLflow (rank 0): "
                                                      "--mlflow_tracking_uri, else $MLFLOW_TRACKING_URI, else a "
                                                      "local file store <save_path>/mlruns", default=False)
    """(--use_mlflow)"""
    mlflow_tracking_uri: str | None = flag(metavar="URI", help="--use_mlflow: the tracking store (http(s)://, "
                                                               "file:, sqlite:///... with the full mlflow package; "
                                                               "default: $MLFLOW_TRACKING_URI, else "
                                                               "file:<save_path>/mlruns)", default=None)
    """(--mlflow_tracking_uri)"""
    mlflow_experiment_name: str = flag(help="--use_mlflow: the experiment (created when missing)",
                                       default="rlhf-megatron")
    """(--mlflow_experiment_name) as --wandb_project"""
    mlflow_run_name: str | None = flag(help="--use_mlflow: the run's name (default: the --save_path folder's name)",
                                       default=None)
    """(--mlflow_run_name) as --wandb_run_name"""

    def check(self) -> None:
        if not self.use_mlflow:
            given = [f"--{k} {getattr(self, k)}" for k in ("mlflow_tracking_uri", "mlflow_run_name")
                     if getattr(self, k) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} without --use_mlflow: add --use_mlflow or drop it")
        if not self.mlflow_experiment_name:
            raise ValueError("--mlflow_experiment_name must not be empty")


def sanitize_key(key: str) -> str:
    """verl's sanitisation of a metric key for MLflow."""
    return _INVALID.sub("_", _SLASHES.sub("/", key.replace("@", "_at_")))


def tracking_uri(flag_uri: str | None, save_path: str) -> str:
    """The store: the flag, else $MLFLOW_TRACKING_URI, else ``file:<save_path>/mlruns``."""
    return flag_uri or os.environ.get("MLFLOW_TRACKING_URI") or "file:" + os.path.join(os.path.abspath(save_path),
                                                                                       "mlruns")


def _is_file_store(uri: str) -> bool:
    return uri.startswith("file:") or "://" not in uri and not uri.startswith(("sqlite:", "databricks"))


class MlflowRun:
    """One MLflow run of this job, written through ``MlflowClient`` (no global active run)."""

    def __init__(self, args, config: dict):
        uri = tracking_uri(args.mlflow_tracking_uri, args.save_path)
        if _is_file_store(uri) and "MLFLOW_ALLOW_FILE_STORE" not in os.environ:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
            log.info("mlflow: a local file store at %s (MLflow's filesystem backend; MLFLOW_ALLOW_FILE_STORE=true set "
                     "for this process); --mlflow_tracking_uri takes a server or a database instead", uri)
        from mlflow.tracking import MlflowClient

        self.uri, self.client, self._renamed = uri, MlflowClient(tracking_uri=uri), set()
        os.makedirs(args.save_path, exist_ok=True)
        id_file = os.path.join(args.save_path, MLFLOW_ID_FILE)
        self.run_id = self._resumed(id_file) if getattr(args, "load_checkpoint", False) else None
        if self.run_id is None:
            exp = self.client.get_experiment_by_name(args.mlflow_experiment_name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
                args.mlflow_experiment_name)
            name = args.mlflow_run_name or os.path.basename(os.path.abspath(args.save_path))
            self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        self._log_params(config)
        with open(id_file + ".tmp", "w") as f:
            f.write(self.run_id)
        os.replace(id_file + ".tmp", id_file)
        log.info("mlflow: run %s at %s", self.run_id, uri)

    def _resumed(self, id_file: str) -> str | None:
        if not os.path.exists(id_file):
            return None
        run_id = open(id_file).read().strip()
        try:
            self.client.get_run(run_id)
        except Exception as e:  # noqa: BLE001 - the store lost it: a new run, said so
            log.info("mlflow: run %s of %s is not in %s (%s): a new run", run_id, id_file, self.uri, e)
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def _log_params(self, config: dict) -> None:
        """The configuration as params (each a string of at most ``PARAM_MAX``); on a resumed run only the keys it
        lacks (MLflow refuses to change a param), the changed ones named once."""
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params
        params, changed = [], []
        for k, v in config.items():
            s = str(v)
            if len(s) > PARAM_MAX:
                log.info("mlflow: param %s cut to %d characters", k, PARAM_MAX)
                s = s[:PARAM_MAX]
            if k not in have:
                params.append(Param(sanitize_key(k), s))
            elif have[k] != s:
                changed.append(k)
        if changed:
            log.info("mlflow: params differing from the resumed run's, kept as first logged: %s", ", ".join(changed))
        for i in range(0, len(params), 100):  # MLflow's batch limit for params
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        out = []
        for k, v in metrics.items():
            key = sanitize_key(k)
            if key != k and k not in self._renamed:
                self._renamed.add(k)
                log.info("mlflow: metric %s logged as %s (MLflow's allowed characters)", k, key)
            out.append(Metric(key, float(v), now, step))
        for i in range(0, len(out), 1000):  # MLflow's batch limit for metrics
            self.client.log_batch(self.run_id, metrics=out[i:i + 1000])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)
