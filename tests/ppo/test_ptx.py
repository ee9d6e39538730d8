"""PPO-ptx (--pretrain_data/--ptx_coef; launch/ppo.py's body in this process, one rank, the megatron generator,
GRPO): with a constant reward every advantage is zero, so the ptx loss alone moves the actor, and its
next-token loss on the pretraining texts falls step after step. The loss combination itself is checked by hand in
tests/algo/test_ptx_loss.py."""
from __future__ import annotations

import json
import math

import pytest

from ppo_common import TINY_GRPO, ppo_args


def test_ptx_loss_trains_the_actor(ppo_setup, tmp_path, monkeypatch):
    from helpers import free_port
    from rlhf.observability.metrics import read_metrics_jsonl
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


def test_ptx_coef_reaches_the_step_loss(ppo_setup, tmp_path, monkeypatch):
    """--ptx_coef 0.3 with a varying reward (the policy term is not zero): in every optimizer step of the job, the loss
    the schedule takes (its micro-batches' sums over their counts, ``--dump_experience``) is OpenRLHF's
    ``actor_loss + ptx_coef * ptx_loss`` (openrlhf/trainer/ray/ppo_actor.py at 64c6350a, before OpenRLHF dropped
    ptx): the policy loss's token mean plus 0.3 times the ptx loss's. Control: at the default 0.05 it differs."""
    import torch

    from helpers import free_port
    from rlhf.ppo import main

    texts = tmp_path / "wiki.jsonl"
    texts.write_text("".join(json.dumps({"text": "one two three four five six seven eight"}) + "\n"
                             for _ in range(16)))
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dump = tmp_path / "dump"
    argv = ppo_args(ppo_setup, str(tmp_path / "o"), **{**TINY_GRPO, "--reward_fn": "_rule_reward:char_code_reward",
                                                        "--rollout_backend": "megatron", "--max_samples": "8",
                                                        "--max_epochs": "1", "--pretrain_data": str(texts),
                                                        "--ptx_coef": "0.3", "--init_kl_coef": "0",
                                                        "--dump_experience": str(dump)})
    assert main(argv) == 0
    told = 0
    for f in sorted(dump.glob("step*_rank0.pt")):
        rec = torch.load(f)
        steps, actor, combined = rec["actor_plans"], rec["actor"], rec["actor_step"]
        a = c = 0
        for plan in steps:
            n = len(plan)
            pol, both = actor[a:a + n], combined[c:c + 2 * n]
            a, c = a + n, c + 2 * n
            policy = sum(float(r["loss"]) for r in pol) / sum(int(r["count"]) for r in pol)
            ptx_rows = [r for r in both if int(r["metrics"]["ptx_loss"][1]) > 0]
            assert len(ptx_rows) == n
            ptx = sum(float(r["metrics"]["ptx_loss"][0]) for r in ptx_rows) / sum(int(r["count"]) for r in ptx_rows)
            step_loss = sum(float(r["loss"]) for r in both) / sum(int(r["count"]) for r in both)
            assert step_loss == pytest.approx(policy + 0.3 * ptx, rel=1e-5, abs=1e-6)
            told += abs((policy + 0.05 * ptx) - step_loss) > 1e-4
        assert a == len(actor) and c == len(combined)
    assert told >= 1
