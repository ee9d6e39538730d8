"""Sharded vs unsharded: converted logits vs transformers, and loss/gradients vs the single-rank run.

One 4-rank torchrun job (tests/models/_mp_equivalence.py) covers every architecture and layout, so that the
process start-up (~10 s) is paid once.
"""
import json
import os

import pytest
from helpers import REPO, run_torchrun, tail

LAYOUTS = ["tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2"]
MODELS = ["llama", "llama-cls", "qwen2", "qwen2-cls", "mistral", "mistral-cls",
          "llama-llama3", "llama-linear", "qwen2-yarn", "qwen3", "qwen3-cls", "llama-kv1"]


@pytest.fixture(scope="module")
def result(tiny_models):
    proc = run_torchrun(os.path.join(REPO, "tests/models/_mp_equivalence.py"), 4, [str(tiny_models)], timeout=900)
    assert proc.returncode == 0, tail(proc)
    with open(os.path.join(tiny_models, "result.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_converted_logits_match_transformers(result, model, layout):
    assert result[f"logits/{model}/{layout}"] <= 1e-4


# untied; tied embeddings + sliding window; q/k norms; one KV head replicated over TP 2
@pytest.mark.parametrize("model", ["llama", "mistral", "qwen3", "llama-kv1"])
@pytest.mark.parametrize("layout", LAYOUTS)  # DP4, DP2xTP2, DP2xPP2, TP2xPP2
def test_loss_and_grads_match_single_rank(result, model, layout):
    r = result[f"grads/{model}/{layout}"]
    assert r["mismatched_names"] == []
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"])
    assert r["max_rel_grad_diff"] <= 1e-5
