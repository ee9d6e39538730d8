"""OpenRLHF's --vllm.enable_prefix_caching (--vllm_enable_prefix_caching here) turns vLLM's prefix caching on, and,
as OpenRLHF's broadcast_to_vllm does (openrlhf/trainer/ray/ppo_actor.py: ``reset_prefix_cache`` on every engine
before the weights go out), every weight sync resets the cache: after an update and a sync, the cached prompt blocks
are not reused and vLLM's log-probs equal the trainer's. Negative control (same job): a sync without the reset
serves the old weights' blocks and the log-probs move away (> 1e-3)."""
import json
import os

from helpers import REPO, require, run_torchrun, tail

require("vllm")
WORKER = os.path.join(REPO, "tests/ppo/_prefix_cache_worker.py")


def test_prefix_cache_is_reset_by_every_weight_sync(ppo_setup):
    p = run_torchrun(WORKER, 1, [ppo_setup["actor"]], timeout=600)
    assert p.returncode == 0, tail(p)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, tail(p)
    r = json.loads(line[0][7:])
    print("prefix caching:", r)
    assert r["enabled"], r
    assert r["first"] <= 1e-4 and r["after_sync"] <= 1e-4, r
    assert r["without_reset"] > 1e-3, r  # the cache was used: without the reset it serves stale blocks
    assert "vLLM prefix caching (--vllm_enable_prefix_caching): on, reset at every weight sync" in p.stdout + p.stderr
