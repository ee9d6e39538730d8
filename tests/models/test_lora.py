"""LoRA on megatron's parallel linears: TP2 == unsharded (loss and adapter gradients), B = 0 is the base model,
training moves only the adapters, merged weights == unmerged forward; flag validation."""
import argparse
import json
import os

import pytest
from helpers import REPO, run_torchrun, tail

WORKER = os.path.join(REPO, "tests/models/_lora_worker.py")


@pytest.fixture(scope="module")
def result(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "result.json"
    p = run_torchrun(WORKER, 2, [os.path.join(tiny_models, "hf", "llama"), str(out)], timeout=600)
    assert p.returncode == 0, tail(p)
    return json.loads(out.read_text())


@pytest.mark.parametrize("layout", ["tp2", "tp2_recompute"])
def test_tp2_equals_unsharded(result, layout):
    r = result[layout]
    assert r["names_match"] and r["n_grads"] == 2 * 4 * 4  # A and B of 4 linears x 4 layers
    assert r["loss_diff"] <= 1e-6
    assert r["min_grad_norm"] > 1e-3  # B != 0, so A has a gradient too
    assert r["max_grad_diff"] <= 1e-6


def test_zero_b_is_base_and_only_adapters_train(result):
    assert result["b0_vs_base"] == 0.0
    assert result["losses"][-1] < result["losses"][0]
    assert result["changed"] and all(n.endswith((".lora_A", ".lora_B")) for n in result["changed"])
    assert len(result["changed"]) == 2 * 4 * 4
    assert result["trained_vs_base"] > 1e-2  # the adapters did change the model
    c = result["counts"]
    assert c["trainable_params"] == c["lora_params"] and c["trainable_params"] < 0.2 * c["total_params"]


def test_merged_weights_give_unmerged_logits(result):
    assert result["merged_vs_unmerged"] <= 1e-5


def test_pp2_trains_like_tp2(result):
    assert max(abs(a - b) for a, b in zip(result["pp2_losses"], result["losses"])) <= 1e-5


# --------------------------------------------------------------------------------------------- validation
def _args(**kw):
    base = dict(lora_rank=8, lora_alpha=16.0, target_modules="all-linear", lora_dropout=0.0, seed=1)
    base.update(kw)
    return argparse.Namespace(**base)


def test_target_names():
    from rlhf.models.lora import resolve_targets

    assert resolve_targets("all-linear") == ("linear_fc1", "linear_fc2", "linear_proj", "linear_qkv")
    assert resolve_targets("q_proj,v_proj") == ("linear_qkv",)
    assert resolve_targets("o_proj,down_proj,linear_fc1") == ("linear_fc1", "linear_fc2", "linear_proj")


@pytest.mark.parametrize("kw,needle", [
    (dict(target_modules="foo"), "--target_modules: unknown module 'foo'"),
    (dict(target_modules=","), "--target_modules"),
    (dict(lora_rank=-1), "--lora_rank must be >= 0"),
    (dict(lora_alpha=0.0), "--lora_alpha"),
    (dict(lora_dropout=1.0), "--lora_dropout"),
])
def test_bad_lora_flags(kw, needle):
    from rlhf.models.lora import lora_config_from_args

    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        lora_config_from_args(_args(**kw))


def test_rank_zero_is_full_finetuning():
    from rlhf.models.lora import lora_config_from_args

    assert lora_config_from_args(_args(lora_rank=0)) is None
    cfg = lora_config_from_args(_args(lora_rank=4, lora_alpha=8.0))
    assert cfg.scale == 2.0 and cfg.targets == ("linear_fc1", "linear_fc2", "linear_proj", "linear_qkv")
