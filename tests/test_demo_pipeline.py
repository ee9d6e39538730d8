"""The embedded default job, reduced (examples/demo/run.py --quick): SFT -> RM -> PPO on the bundled task on 2 ranks;
the RM ranks held-out pairs and PPO raises the held-out gold score above the SFT model's, with the RM reward
rising too (no reward hacking)."""
import json
import os

import pytest
from helpers import REPO, run_python, tail, require

require("vllm")


@pytest.mark.slow
def test_demo_pipeline_improves_gold(tmp_path):
    out = str(tmp_path / "demo")
    p = run_python([os.path.join(REPO, "examples/demo/run.py"), "--out", out, "--seed", "1", "--quick"], timeout=840)  # under the per-test 900 s
    assert p.returncode == 0, tail(p)
    s = json.load(open(os.path.join(out, "summary.json")))
    # Measured (--quick: 4000 pairs, 4 RM epochs at 1e-3, 1 PPO episode; 2-core Intel Xeon with AMX, 2026-11-26):
    # seed 1: RM held-out accuracy 0.909 (1000 held-out pairs); gold 0.757 -> 0.841; RM reward -0.64 -> +0.41;
    # exactly sorted 0.17 -> 0.40 (256 held-out samples); seed 2: 0.896, +0.055, +0.90, +0.18. The earlier quick
    # schedule (2000 pairs, 2 epochs at 2e-3) gave a 0.84 reward model on the task of 2026-11-26 (SFT replies
    # sorted 15% of the time), and PPO then lowered gold (0.757 -> 0.696): the reward model's blind spots. The
    # bands sit well below these figures (the full demo: README).
    assert s["rm_heldout_acc"] >= 0.74, s
    assert s["after"]["gold"] >= s["before"]["gold"] + 0.02, s
    assert s["after"]["rm"] >= s["before"]["rm"] + 0.2, s
    assert s["after"]["exact_sorted"] >= s["before"]["exact_sorted"] + 0.05, s
    assert os.path.getsize(os.path.join(out, "ppo_curves.png")) > 10_000
    assert os.listdir(os.path.join(out, "tb", "ppo"))
