"""Qwen3.5's vision-language form (``qwen3_5``, ``qwen3_5_moe``: rlhf.models.vlm on the hybrid decoder of
rlhf.models.hybrid; docs/vlm.md) and Qwen3-VL (``qwen3_vl``: a Qwen3 decoder, the interleaved rotary, the tower's
deepstack features added to the first decoder layers' outputs) on tiny random models built by transformers' own
classes.

The model checks run in one 2-rank job per family (tests/models/_vlm_worker.py, about 30 s each: the megatron model
at TP1 and TP2, or EP2 for the MoE one, transformers' reference, one backward each, the HF export)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import REPO, run_torchrun, tail

FAMILIES = {"qwen3_5": False, "qwen3_5_moe": True, "qwen3_vl": False}  # family: MoE


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The tiny models (one tokenizer) and two images of different sizes."""
    from PIL import Image

    from rlhf.models.tiny import make_tiny_qwen3_5_vl, make_tiny_qwen3_vl

    work = tmp_path_factory.mktemp("vlm35")
    for name, moe in FAMILIES.items():
        if name == "qwen3_vl":
            make_tiny_qwen3_vl(str(work / name), seed=3)
        else:
            make_tiny_qwen3_5_vl(str(work / name), moe=moe, seed=3)
    from safetensors.torch import load_file, save_file  # a released folder's MTP layer (transformers ignores it)

    tensors = load_file(str(work / "qwen3_5" / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    tensors.update({"mtp.fc.weight": torch.randn(64, 128, generator=g),
                    "mtp.norm.weight": torch.randn(64, generator=g)})
    save_file(tensors, str(work / "qwen3_5" / "model.safetensors"), metadata={"format": "pt"})
    os.makedirs(work / "images")
    g = torch.Generator().manual_seed(0)
    for name, (h, w) in (("a.png", (112, 112)), ("b.png", (84, 140))):
        px = (torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(px).save(work / "images" / name)
    return work


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_qwen3_5_vl_equals_transformers_grads_and_export(work, family):
    """Logits at TP1 (DP2) and TP2 (MoE: EP2 too; its TP2 runs sequence parallelism, measured 2.1e-7, gradients
    1.6e-6) equal transformers' ...ForConditionalGeneration's (fp32:
    1e-5; measured 2.2e-7 at a logit scale of about 1 on AMD EPYC); the controls move them by far more: the pixels
    zeroed, plain positions, and the interleaved rotary replaced by the sectioned split of Qwen2.5-VL; one step's
    gradients at both layouts, the tower's included, equal one unsharded model's (relative 1e-4: measured 6.9e-6 at
    TP2, 5e-7 at EP2), and transformers' own backward's (relative 1e-4: measured 8.8e-7 on Qwen3-VL, 1.4e-6 on
    Qwen3.5, 2.6e-6 on its MoE form, every tensor of the dense ones); the trainer's HF export from the second layout
    is read by transformers: the source's names (``model.language_model.*``, ``model.visual.*``) and tensors, bit for
    bit, the folder's mtp.* tensors (two planted in the dense one) written back as read. Qwen3-VL's control: the
    deepstack features left out (measured 0.55 off)."""
    proc = run_torchrun(os.path.join(REPO, "tests", "models", "_vlm_worker.py"), 2, [str(work), family],
                        timeout=400)
    assert proc.returncode == 0, tail(proc)
    r = json.load(open(work / f"result-{family}.json"))
    assert r["image_tokens"] == 16 + 12, r  # 112x112 -> 128x128: 8x8 patches; 84x140 -> 96x128: 6x8
    for layout in ("tp1", "ep2", "tp2") if FAMILIES[family] else ("tp1", "tp2"):
        assert r[f"logits/{layout}"] <= 1e-5, r
        assert r[f"grads/{layout}/names_match"], r
        assert r[f"grads/{layout}/max_rel_diff"] <= 1e-4, r
    deep = ("deepstack_dropped",) if family == "qwen3_vl" else ()
    for control in ("pixels_zeroed", "plain_positions", "sectioned_rotary", *deep):
        assert r[f"control/{control}"] > 100 * max(r["logits/tp1"], 1e-7), (control, r)
    assert r["grads/vision_tensors"] > 20 and r["grads/vision_grad_norm"] > 0, r
    assert r["grads/vs_transformers/max_rel_diff"] <= 1e-4, r
    if FAMILIES[family]:  # the fused experts are named otherwise in transformers' modules
        assert r["grads/vs_transformers/tensors"] > r["grads/vision_tensors"], r
    else:
        assert r["grads/vs_transformers/tensors"] == r["grads/tensors"], r
    if deep:
        assert r["grads/deepstack_grad_norm"] > 0, r  # the deepstack mergers train through the hooks
    assert r["round_trip/names_match"] and r["round_trip/max_abs_diff"] == 0.0, r
    assert r["round_trip/vision_tensors"] == r["grads/vision_tensors"], r
    assert r["round_trip/mtp_tensors"] == (2 if family == "qwen3_5" else 0) and r["round_trip/mtp_equal"], r


def test_qwen3_5_vl_config_fields_and_layouts_refused_by_name(work):
    from rlhf.models.spec import load_hf_config, spec_from_hf_config
    from rlhf.models.vlm import check_vlm_layout

    dense = spec_from_hf_config(load_hf_config(str(work / "qwen3_5")))
    moe = spec_from_hf_config(load_hf_config(str(work / "qwen3_5_moe")))
    assert dense.mrope_section == (3, 3, 2) and dense.rotary_percent == 0.5 and dense.vision["mrope_interleaved"]
    assert dense.linear_attention["layers"] == (True, True, True, False) and moe.num_experts == 4
    check_vlm_layout(dense, tp=2)
    check_vlm_layout(moe, tp=1)
    check_vlm_layout(moe, tp=2)  # sequence parallelism: the image features scattered with the embeddings
    for kw, flag in ((dict(pp=2), "--pp 2"), (dict(packing=True), "--packing_samples")):
        with pytest.raises(ValueError, match=flag):
            check_vlm_layout(dense, **kw)
    bad = load_hf_config(str(work / "qwen3_5"))
    bad["text_config"]["rope_parameters"]["mrope_interleaved"] = False
    with pytest.raises(ValueError, match="mrope_interleaved=False"):
        spec_from_hf_config(bad)
    bad = load_hf_config(str(work / "qwen3_5"))
    bad["text_config"]["rope_parameters"]["mrope_section"] = [4, 4, 2]
    with pytest.raises(ValueError, match="mrope_section"):
        spec_from_hf_config(bad)
    bad = load_hf_config(str(work / "qwen3_5"))
    bad["vision_config"]["deepstack_visual_indexes"] = [0]
    with pytest.raises(ValueError, match="deepstack_visual_indexes for model_type='qwen3_5'"):
        spec_from_hf_config(bad)
    q3 = spec_from_hf_config(load_hf_config(str(work / "qwen3_vl")))
    assert q3.vision["deepstack"] == 2 and q3.mrope_section == (6, 5, 5) and q3.vision["mrope_interleaved"]
    assert q3.linear_attention is None and q3.rotary_percent == 1.0 and q3.qk_norm
    import importlib.util

    from rlhf.models.spec_families import vllm_refusal

    if importlib.util.find_spec("torchvision") is None:  # vLLM's Qwen3-VL processor imports it
        assert "--rollout_backend megatron" in vllm_refusal(q3, 1, "float32", False)
    bad = load_hf_config(str(work / "qwen3_vl"))
    bad["vision_config"]["deepstack_visual_indexes"] = [0, 1, 2, 3]  # four layers fed, three in the decoder
    with pytest.raises(ValueError, match=r"deepstack_visual_indexes=\[0, 1, 2, 3\] feeds more decoder layers"):
        spec_from_hf_config(bad)


def test_released_mtp_tensors_are_not_read_and_other_extras_refused(work):
    """Qwen3.5's (and Qwen3-Next's) released folders carry the MTP layer as ``mtp.*``, which transformers ignores
    on load: not trained here either (logged; the exports write them back as read: the fixture's dense folder holds
    two, checked by the round trip above), while any other unknown tensor is still refused by name."""
    from rlhf.models.hf_llama import check_hf_names, expected_hf_names
    from rlhf.models.spec import load_hf_config, spec_from_hf_config

    spec = spec_from_hf_config(load_hf_config(str(work / "qwen3_5")))
    names = expected_hf_names(spec)
    assert "lm_head.weight" in names and any(n.startswith("visual.") for n in names)
    check_hf_names(names | {"mtp.fc.weight", "mtp.layers.0.mlp.gate_proj.weight"}, spec, "folder")
    with pytest.raises(ValueError, match="unknown checkpoint key.*model.extra.weight"):
        check_hf_names(names | {"model.extra.weight"}, spec, "folder")
    with pytest.raises(ValueError, match="missing checkpoint key"):
        check_hf_names(names - {"visual.merger.linear_fc1.weight"}, spec, "folder")
