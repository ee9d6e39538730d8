"""An SFT job on a Gated DeltaNet hybrid (qwen3_5_text, rlhf.models.tiny.TINY_HYBRIDS; the launcher's body,
rlhf.supervised.loop.main, in this process, one rank, packed micro-batches): the export loads in transformers as
``Qwen3_5ForCausalLM``, every DeltaNet tensor moved (the gradient reached the recurrence, its convolution, gates and
norms), and transformers' own loss on the training records fell. The forward and gradients against transformers:
tests/models/test_hybrid_equivalence.py."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.timeout(300)


def _loss(model_dir: str, tok_dir: str, rows: list[dict]) -> float:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = n = 0.0
    with torch.no_grad():
        for r in rows:
            ids = tok(r["input"] + r["output"], return_tensors="pt").input_ids[:, :32]
            total += model(ids, labels=ids).loss.item() * (ids.shape[1] - 1)
            n += ids.shape[1] - 1
    return total / n


def test_sft_trains_a_hybrid(train_setup, tmp_path, monkeypatch):
    import transformers
    from safetensors.torch import load_file

    from helpers import free_port
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.models.tiny import make_tiny_hybrid
    from rlhf.supervised import sft
    from rlhf.supervised.loop import main

    model = make_tiny_hybrid(str(tmp_path / "q35"), "qwen3_5_text", seed=5, tokenizer_dir=train_setup["model"])
    out = tmp_path / "out"
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    argv = ["--pretrain", model, "--dataset", train_setup["sft"], "--save_path", str(out), "--train_batch_size", "8",
            "--micro_train_batch_size", "4", "--max_len", "32", "--max_samples", "32", "--learning_rate", "1e-2",
            "--lr_warmup_ratio", "0", "--seed", "7", "--packing_samples"]
    try:
        assert main(sft, argv) == 0
    finally:
        destroy_mesh()
    assert type(transformers.AutoModelForCausalLM.from_pretrained(str(out))).__name__ == "Qwen3_5ForCausalLM"
    before = load_file(os.path.join(model, "model.safetensors"))
    after = load_file(os.path.join(out, "model.safetensors"))
    assert set(before) == set(after)
    deltanet = [k for k in before if ".linear_attn." in k]
    assert deltanet and all(not torch.equal(before[k], after[k]) for k in deltanet), \
        [k for k in deltanet if torch.equal(before[k], after[k])]
    rows = [json.loads(line) for line in open(train_setup["sft"])][:32]
    assert _loss(str(out), train_setup["model"], rows) < _loss(model, train_setup["model"], rows)
