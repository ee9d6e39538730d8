"""The step timer both TRL benches hand to their trainer (bench/_trl_grpo.py, bench/_trl_ppo.py): wall seconds
between step ends, and the log records that carry ``log_key`` (a step's own metrics, not the end-of-run summary)."""
import time
from typing import Callable


def step_timer(times: list[float], logged: list[dict], log_key: str,
               record: Callable[[dict, int], dict] = lambda logs, step: dict(logs, step=step),
               on_step_end: Callable[[float], None] | None = None):
    """A ``transformers.TrainerCallback`` that appends each step's seconds to ``times`` (then calls
    ``on_step_end(seconds)``) and ``record(logs, global_step)`` to ``logged`` for every log that has ``log_key``."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            times.append(now - self.t)
            self.t = now
            if on_step_end is not None:
                on_step_end(times[-1])

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and log_key in logs:
                logged.append(record(logs, state.global_step))

    return StepTimer()
