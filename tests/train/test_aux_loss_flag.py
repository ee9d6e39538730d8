"""--aux_loss_coef reaches a real SFT job on a tiny Mixtral (the launcher's body, rlhf.supervised.loop.main, in this process,
one rank): from the same initial weights and data, two steps at 0.05 end with other router weights than at 0 (the
load-balancing loss moved them), and at 0.05 twice with the same ones (the difference is the flag's, not noise). The
gradients the loss gives, its CP invariance and its effect on them: tests/models/test_context_parallel.py; megatron's
per-layer loss is not compared with transformers' (Mixtral's ``load_balancing_loss_func`` pools every layer's tokens
into one loss, so the two differ by construction)."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.timeout(300)


def _sft(train_setup, model, out, monkeypatch, coef: str) -> dict:
    from safetensors.torch import load_file

    from helpers import free_port
    from rlhf.supervised import sft
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.supervised.loop import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    argv = ["--pretrain", model, "--dataset", train_setup["sft"], "--save_path", str(out), "--train_batch_size", "8",
            "--micro_train_batch_size", "4", "--max_len", "32", "--max_samples", "16", "--learning_rate", "1e-2",
            "--lr_warmup_ratio", "0", "--seed", "7", "--aux_loss_coef", coef]
    try:
        assert main(sft, argv) == 0
    finally:
        destroy_mesh()
    return load_file(os.path.join(out, "model.safetensors"))


def test_aux_loss_coef_moves_the_routers(train_setup, tmp_path, monkeypatch):
    from rlhf.models.tiny import make_tiny_hf

    model = make_tiny_hf(str(tmp_path / "mixtral"), "mixtral", seed=3, num_hidden_layers=2, hidden_size=64,
                         intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                         tokenizer_dir=train_setup["model"])
    off = _sft(train_setup, model, tmp_path / "off", monkeypatch, "0")
    on = _sft(train_setup, model, tmp_path / "on", monkeypatch, "0.05")
    again = _sft(train_setup, model, tmp_path / "again", monkeypatch, "0.05")
    routers = [k for k in on if k.endswith("block_sparse_moe.gate.weight") or k.endswith("mlp.gate.weight")]
    assert routers, sorted(on)[:10]
    assert all(torch.equal(on[k], again[k]) for k in on)  # deterministic: a difference below is the flag's
    moved = max((on[k] - off[k]).abs().max().item() for k in routers)
    assert moved > 1e-4, moved
