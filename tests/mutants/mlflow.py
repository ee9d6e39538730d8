"""Planted bugs of --use_mlflow (rlhf/observability/mlflow_log.py and its call in the metrics logger): each caught by
the PPO run that logs to W&B and MLflow at once and reads the MLflow store's own files back."""
from tests.mutants import Mutant

JOB = "tests/ppo/test_mlflow.py::test_mlflow_logs_what_wandb_logs_and_resume_continues_the_run"
UNIT = "tests/ppo/test_mlflow.py::test_the_default_store_is_a_file_store_under_save_path"
M = "rlhf/observability/mlflow_log.py"

MUTANTS = [
    Mutant("mlflow-metrics-not-logged", "rlhf/observability/metrics.py",
           find='''            self.mlflow.log({f"{prefix}/{k}": float(v) for k, v in metrics.items()}, step=step)''',
           replace='''            pass''',
           claim="every scalar W&B gets reaches MLflow", tests=(JOB,)),
    Mutant("mlflow-prefix-lost", "rlhf/observability/metrics.py",
           find='''            self.mlflow.log({f"{prefix}/{k}": float(v) for k, v in metrics.items()}, step=step)''',
           replace='''            self.mlflow.log({k: float(v) for k, v in metrics.items()}, step=step)''',
           claim="MLflow's metric names are W&B's (the logger's prefix included)", tests=(JOB,)),
    Mutant("mlflow-step-shifted", M,
           find="out.append(Metric(key, float(v), now, step))", replace="out.append(Metric(key, float(v), now, step + 1))",
           claim="a metric is logged at the step W&B logs it at", tests=(JOB, UNIT)),
    Mutant("mlflow-at-kept", M,
           find='''key.replace("@", "_at_")''', replace='''key.replace("@", "_")''',
           claim="metric keys are sanitised as verl's adapter does (@ -> _at_)", tests=(JOB, UNIT)),
    Mutant("mlflow-resume-new-run", M,
           find='''self.run_id = self._resumed(id_file) if getattr(args, "load_checkpoint", False) else None''',
           replace='''self.run_id = None''',
           claim="a job resumed into the same --save_path continues the same MLflow run", tests=(JOB,)),
    Mutant("mlflow-params-not-logged", M,
           find="            self.client.log_batch(self.run_id, params=params[i:i + 100])",
           replace="            pass",
           claim="the job's flags are the run's params, as W&B's config", tests=(JOB, UNIT)),
    Mutant("mlflow-resume-relogs-changed-params", M,
           find="            if k not in have:\n", replace="            if True:\n",
           claim="a resumed run keeps its params and names those that changed (MLflow refuses a changed param)",
           tests=(JOB,)),
    Mutant("mlflow-never-finished", M,
           find="        self.client.set_terminated(self.run_id)", replace="        pass",
           claim="the run ends FINISHED when the job ends", tests=(JOB,)),
    Mutant("mlflow-default-store-elsewhere", M,
           find='''or "file:" + os.path.join(os.path.abspath(save_path),''',
           replace='''or "file:" + os.path.join(os.path.abspath("."),''',
           claim="the default store is a file store under --save_path", tests=(UNIT,)),
]
