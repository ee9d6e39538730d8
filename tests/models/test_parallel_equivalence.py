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
MOE_MODELS = ["mixtral", "qwen3_moe"]  # renormalised top-2 routing; qwen3_moe with norm_topk_prob=False
MOE_LAYOUTS = ["tp1pp1", "tp1pp1ep2", "tp1pp1ep4", "tp2pp1ep2", "tp1pp2ep2"]
MOE_GRAD_LAYOUTS = ["tp1pp1", "tp1pp1ep2", "tp1pp1ep4", "tp1pp2ep2", "tp2pp1ep2"]  # TP 2: sequence parallelism


@pytest.fixture(scope="module")
def result(tiny_models):
    proc = run_torchrun(os.path.join(REPO, "tests/models/_mp_equivalence.py"), 4, [str(tiny_models)], timeout=900)
    assert proc.returncode == 0, tail(proc)
    with open(os.path.join(tiny_models, "result.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("model,layout", [(m, lay) for m in MODELS for lay in LAYOUTS] +
                         [(m, lay) for m in MOE_MODELS for lay in MOE_LAYOUTS])
def test_converted_logits_match_transformers(result, model, layout):
    assert result[f"logits/{model}/{layout}"] <= 1e-4


# untied; tied embeddings + sliding window; q/k norms; one KV head replicated over TP 2; experts over EP ranks
@pytest.mark.parametrize("model,layout", [(m, lay) for m in ("llama", "mistral", "qwen3", "llama-kv1")
                                          for lay in LAYOUTS] +  # DP4, DP2xTP2, DP2xPP2, TP2xPP2
                         [(m, lay) for m in MOE_MODELS for lay in MOE_GRAD_LAYOUTS])
def test_loss_and_grads_match_single_rank(result, model, layout):
    r = result[f"grads/{model}/{layout}"]
    assert r["mismatched_names"] == []
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"])
    assert r["max_rel_grad_diff"] <= 1e-5
    # on CPU every data-parallel gradient all-reduce of these layouts went through shared memory
    assert r["dp"] == 1 or r["shm_bucket_groups"] > 0, r
