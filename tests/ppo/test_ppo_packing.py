"""--packing_samples in PPO: packed experience forwards and updates equal the padded ones (TP2 and PP2)."""
import json
import os

import pytest
from helpers import REPO, run_torchrun, tail

WORKER = os.path.join(REPO, "tests/ppo/_packing_worker.py")


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_packed_equals_padded(ppo_setup, tp, pp):
    p = run_torchrun(WORKER, 2, ["--actor", ppo_setup["actor"], "--rm", ppo_setup["rm"], "--tp", str(tp),
                                 "--pp", str(pp)], timeout=600)
    assert p.returncode == 0, tail(p)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, tail(p)
    r = json.loads(line[0][7:])
    for k, v in r.items():
        if not k.endswith("_scale"):
            assert v <= 2e-5, (k, r)
    assert r["actor_fwd_scale"] > 1 and r["reward_fwd_scale"] > 0.1  # compared something real
