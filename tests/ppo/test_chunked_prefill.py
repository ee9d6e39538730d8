"""Regression test of the vLLM CPU chunked-prefill crash (fixed in 1e6fcec, rlhf/rollout/vllm_generator.py::
vllm_memory_kwargs): vLLM 0.32.0 rewinds a partially prefilled request's seeded generator with
``Generator.set_offset``, which CPU generators refuse ("CPU Generator does not use offset"); the SmolLM2 calculator
agent crashed at step 14 when its trajectories outgrew one step's token budget. The same engine and requests
(prompts 11x a 64-token step, a seed per request) run with the trainer's CPU kwargs, and the negative control,
vLLM's chunked prefill at a 64-token budget, still raises vLLM's error: the day a vLLM release fixes it, the control
fails and says the workaround can go. Two engine start-ups in child processes (a dead engine leaves no state)."""
import os

import pytest
from helpers import REPO, require, run_python, tail

require("vllm")
WORKER = os.path.join(REPO, "tests/ppo/_chunked_prefill_worker.py")


@pytest.mark.parametrize("mode", ["ours", "chunked"])
def test_seeded_sampling_over_prompts_longer_than_a_step(ppo_setup, mode):
    p = run_python([WORKER, ppo_setup["actor"], mode], timeout=300, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    last = [ln for ln in p.stdout.splitlines() if ln.startswith(("OK", "FAILED"))]
    assert p.returncode == 0 and last, tail(p)
    if mode == "ours":
        assert last[-1].startswith("OK ["), last[-1]
    else:
        assert last[-1] == "FAILED RuntimeError CPU Generator does not use offset", last[-1]
