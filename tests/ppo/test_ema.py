"""--enable_ema (launch/ppo.py's body in this process, one rank, the megatron generator, GRPO): the average is
exported under <save_path>/ema; at --ema_beta 1 it never moves from the initial actor (the HF model it started
from, weight for weight), at --ema_beta 0 it follows the actor to its final weights."""
from __future__ import annotations

import pytest
import torch
from ppo_common import TINY_GRPO, ppo_args
from safetensors.torch import load_file


def _run(setup, out, beta, monkeypatch):
    from helpers import free_port
    from rlhf.ppo import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    argv = ppo_args(setup, str(out), **{**TINY_GRPO, "--reward_fn": "_rule_reward:length_reward",
                                        "--rollout_backend": "megatron", "--max_samples": "8", "--enable_ema": "",
                                        "--ema_beta": str(beta)})
    assert main(argv) == 0
    return load_file(str(out / "ema" / "model.safetensors")), load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("beta", [1.0, 0.0])
def test_ema_bounds(ppo_setup, tmp_path, monkeypatch, beta):
    ema, actor = _run(ppo_setup, tmp_path / "o", beta, monkeypatch)
    initial = load_file(f"{ppo_setup['actor']}/model.safetensors")
    want = initial if beta == 1.0 else actor
    assert ema.keys() == want.keys()
    assert all(torch.equal(ema[k], want[k]) for k in want)
    assert any(not torch.equal(actor[k], initial[k]) for k in initial)  # the actor did train
