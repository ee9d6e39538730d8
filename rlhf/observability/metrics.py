"""Rank-0 logging: one progress line per logged step (with ETA), TensorBoard scalars, and every logged record at
full precision in ``<save_path>/metrics.jsonl`` (one JSON object a line: ``{"prefix", "step", ...metrics}``;
appended, so a resumed run continues the file and the last record of a step is the one that counts)."""
from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Mapping

log = logging.getLogger("rlhf")


class MetricsLogger:
    def __init__(self, enabled: bool, total_steps: int, tensorboard_dir: str | None = None, prefix: str = "train",
                 jsonl_path: str | None = None, args=None):
        self.enabled, self.total, self.prefix = enabled, total_steps, prefix
        self.start = time.time()
        self.start_step: int | None = None
        self.writer = None
        self.jsonl = None
        self.wandb = start_wandb(args) if enabled and args is not None and getattr(args, "use_wandb", None) else None
        self.mlflow = None
        if enabled and args is not None and getattr(args, "use_mlflow", False):
            from rlhf.observability.mlflow_log import MlflowRun

            self.mlflow = MlflowRun(args, run_config(args))
        if enabled and jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self.jsonl = open(jsonl_path, "a")
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard_dir)

    def log(self, step: int, metrics: Mapping[str, float], prefix: str | None = None, progress: bool = True) -> None:
        if not self.enabled:
            return
        prefix = prefix or self.prefix
        if self.jsonl is not None:
            rec = {"prefix": prefix, "step": step,
                   **{k: (float(v) if math.isfinite(float(v)) else str(float(v))) for k, v in metrics.items()}}
            self.jsonl.write(json.dumps(rec) + "\n")
            self.jsonl.flush()
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(f"{prefix}/{k}", v, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{k}": float(v) for k, v in metrics.items()}, step=step)
        if self.mlflow is not None:  # the same names, values and steps as W&B's
            self.mlflow.log({f"{prefix}/{k}": float(v) for k, v in metrics.items()}, step=step)
        if not progress:
            log.info("[%s step %d] %s", prefix, step, _fmt(metrics))
            return
        if self.start_step is None:
            self.start_step, self.start = step - 1, time.time()
        done = step - self.start_step
        elapsed = time.time() - self.start
        eta = elapsed / max(done, 1) * (self.total - step)
        log.info("[%s %d/%d %3.0f%% eta %s] %s", prefix, step, self.total, 100.0 * step / max(self.total, 1),
                 _hms(eta), _fmt(metrics))

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.mlflow is not None:
            self.mlflow.finish()
            self.mlflow = None
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None


WANDB_ID_FILE = "wandb_run_id"
"""Under --save_path: the W&B run id, so a resumed job (the same --save_path) continues the same run."""


def start_wandb(args):
    """The W&B run of this job (rank 0): project, group, name and entity from the flags, the flags as its config,
    online with an API key, else offline under <save_path>/wandb (logged once; ``wandb sync`` uploads it later).
    A job resumed into the same --save_path continues the run whose id is saved there."""
    import wandb

    key = args.use_wandb if args.use_wandb not in ("True", "true", "1") else None
    if key:
        os.environ["WANDB_API_KEY"] = key
    mode = os.environ.get("WANDB_MODE")
    if mode is None and not (os.environ.get("WANDB_API_KEY") or wandb.api.api_key):
        mode = "offline"
        log.info("wandb: no API key (--use_wandb KEY, WANDB_API_KEY or `wandb login`): logging offline under %s; "
                 "`wandb sync` uploads it", os.path.join(args.save_path, "wandb"))
    os.makedirs(args.save_path, exist_ok=True)
    id_file = os.path.join(args.save_path, WANDB_ID_FILE)
    import secrets

    run_id = open(id_file).read().strip() if os.path.exists(id_file) and getattr(args, "load_checkpoint", False) \
        else secrets.token_hex(4)
    run = wandb.init(project=args.wandb_project, entity=args.wandb_org, group=args.wandb_group,
                     name=args.wandb_run_name or os.path.basename(os.path.abspath(args.save_path)), config=run_config(args),
                     dir=args.save_path, id=run_id, resume="allow", mode=mode, reinit="finish_previous")
    with open(id_file + ".tmp", "w") as f:
        f.write(run.id)
    os.replace(id_file + ".tmp", id_file)
    return run


def run_config(args) -> dict:
    """The job's configuration as the trackers log it (W&B's config, MLflow's params): every flag of a plain type,
    without --use_wandb (it may hold the API key)."""
    return {k: v for k, v in vars(args).items() if k != "use_wandb" and isinstance(v, (int, float, str, bool,
                                                                                        type(None), list))}


def read_metrics_jsonl(path: str, prefix: str) -> dict[int, dict[str, float]]:
    """``{step: metrics}`` of one prefix from a ``metrics.jsonl`` (the last record of a step wins: a resumed run
    repeats the steps after its checkpoint). Non-finite values come back as floats."""
    out: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.pop("prefix") == prefix:
                step = int(rec.pop("step"))
                out[step] = {k: float(v) for k, v in rec.items()}
    return out


def _fmt(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def _hms(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def setup_logging(rank: int) -> None:
    """INFO on rank 0, WARNING elsewhere; megatron's chatter at WARNING."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("megatron", "megatron.core", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class PhaseTimer:
    """Seconds, tokens/s and memory of each named phase of a step (STYLE: time every phase by name).

    Memory: peak allocated device memory during the phase on CUDA; on CPU the process's resident set size at
    the end of the phase (CPU has no per-phase peak counter)."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    def reset(self) -> None:
        self.metrics = {}

    def phase(self, name: str, tokens: float | None = None):
        import contextlib

        import torch

        from rlhf.distributed.watchdog import phase

        @contextlib.contextmanager
        def cm():
            with phase(name):  # the phase a failure or a stall is reported in
                cuda = torch.cuda.is_available()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                yield self
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                self.metrics[f"time/{name}"] = self.metrics.get(f"time/{name}", 0.0) + dt
                if tokens is not None:
                    self.metrics[f"tokens_per_s/{name}"] = tokens / max(self.metrics[f"time/{name}"], 1e-9)
                if cuda:
                    self.metrics[f"mem/{name}_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
                else:
                    import psutil

                    self.metrics[f"mem/{name}_rss_gb"] = psutil.Process().memory_info().rss / 2**30

        return cm()


def metric_series(save_path: str, prefix: str) -> dict[str, list[float]]:
    """A run's logged metrics at full precision from ``<save_path>/metrics.jsonl``: ``{name: [value per logged
    step, in step order]}`` for one prefix (``sft``, ``rm``, ``dpo``, ``kto``, ``ppo``, ``eval``)."""
    steps = read_metrics_jsonl(os.path.join(save_path, "metrics.jsonl"), prefix)
    names = sorted({k for m in steps.values() for k in m})
    return {k: [steps[s][k] for s in sorted(steps) if k in steps[s]] for k in names}
