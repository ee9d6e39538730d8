"""The embedded default job, reduced (tools/run_demo.py --quick): SFT -> RM -> PPO on the bundled task on 2 ranks;
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
    p = run_python([os.path.join(REPO, "tools/run_demo.py"), "--out", out, "--seed", "1", "--quick"], timeout=1500)
    assert p.returncode == 0, tail(p)
    s = json.load(open(os.path.join(out, "summary.json")))
    # Measured (seed 1, --quick: 2 RM epochs, 1 PPO episode; 2-core Intel Xeon, 2026-11-25): RM held-out accuracy
    # 0.825; gold 0.830 -> 0.900; RM reward -0.98 -> -0.08; exactly sorted 0.33 -> 0.52 (256 held-out samples);
    # seed 2: 0.815, +0.042, +0.41, +0.06. With one RM epoch the reward model reached 0.745-0.82, and whether PPO
    # then raised gold depended on the last bits of the CPU kernels (MKL or oneDNN, batched or looped attention:
    # +0.036, +0.016, -0.001). The bands sit below the two-epoch figures (the full demo reaches 0.885-0.945 and
    # +0.14 to +0.26 gold: README).
    assert s["rm_heldout_acc"] >= 0.74, s
    assert s["after"]["gold"] >= s["before"]["gold"] + 0.02, s
    assert s["after"]["rm"] >= s["before"]["rm"] + 0.2, s
    assert s["after"]["exact_sorted"] >= s["before"]["exact_sorted"] + 0.05, s
    assert os.path.getsize(os.path.join(out, "ppo_curves.png")) > 10_000
    assert os.listdir(os.path.join(out, "tb", "ppo"))
