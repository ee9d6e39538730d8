"""PPO-ptx (--pretrain_data/--ptx_coef; launch/ppo.py's body in this process, one rank, the megatron generator,
GRPO): with a constant reward every advantage is zero, so the ptx loss alone moves the actor, and its
next-token loss on the pretraining texts falls step after step. The loss combination itself is checked by hand in
tests/algo/test_ptx_loss.py."""
from __future__ import annotations

import json
import math

from ppo_common import TINY_GRPO, ppo_args


def test_ptx_loss_trains_the_actor(ppo_setup, tmp_path, monkeypatch):
    from helpers import free_port
    from rlhf.metrics import read_metrics_jsonl
    from rlhf.ppo import main

    texts = tmp_path / "wiki.jsonl"
    texts.write_text("".join(json.dumps({"text": "one two three four five six seven eight"}) + "\n"
                             for _ in range(16)))
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = tmp_path / "o"
    argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--reward_fn": "_rule_reward:constant_reward",
                                            "--rollout_backend": "megatron", "--max_samples": "16",
                                            "--max_epochs": "1", "--unsupervised_dataset_name": str(texts),
                                            "--unsup_coef": "1.0", "--init_kl_coef": "0"})
    assert main(argv) == 0
    rows = read_metrics_jsonl(str(out / "metrics.jsonl"), "ppo")
    ptx = [rows[k]["actor/ptx_loss"] for k in sorted(rows)]
    assert len(ptx) == 4 and all(math.isfinite(x) for x in ptx)
    assert all(abs(rows[k]["advantages_abs"]) == 0 for k in rows)  # the policy term contributes nothing
    assert ptx[-1] < ptx[0] - 0.5, ptx
