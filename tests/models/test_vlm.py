"""Vision-language models (rlhf.models.vlm, rlhf.data.vision; docs/vlm.md) on a tiny random Qwen2.5-VL.

The model checks run in one 2-rank job (tests/models/_vlm_worker.py, about 25 s: the megatron model at TP1 and TP2,
transformers' reference, one backward each and the HF round trip; every check of it reads the same job)."""
from __future__ import annotations

import base64
import io
import json
import os

import pytest
import torch

from helpers import REPO, run_torchrun, tail


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny Qwen2.5-VL HF folder and two images of different sizes (16 and 24 image tokens)."""
    from PIL import Image

    from rlhf.models.tiny import make_tiny_vlm

    work = tmp_path_factory.mktemp("vlm")
    make_tiny_vlm(str(work / "hf"), seed=1)
    os.makedirs(work / "images")
    g = torch.Generator().manual_seed(0)
    for name, (h, w) in (("a.png", (112, 112)), ("b.png", (84, 140))):
        px = (torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(px).save(work / "images" / name)
    return work


# ------------------------------------------------------------------------------------------------ positions
def test_mrope_positions_equal_transformers_rope_index(vlm):
    """rlhf.models.vlm.mrope_positions against transformers' Qwen2_5_VLModel.get_rope_index (5.19): two images of
    different grids in one row, an image first, text only; and an image token past the row's images is text
    (transformers would take it for an image, so that row is checked by hand)."""
    import transformers

    from rlhf.models.vlm import image_token_count, mrope_positions

    cfg = transformers.AutoConfig.from_pretrained(vlm / "hf")
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).model
    pad, merge = cfg.image_token_id, cfg.vision_config.spatial_merge_size
    grids = [[1, 8, 8], [1, 6, 10], [1, 4, 12]]
    layouts = [[5, 6, "img0", 7, "img1", 8, 9], ["img2", 3, 4], [3, 4, 5, 6]]
    for lay in layouts:
        ids, used = [], []
        for t in lay:
            if isinstance(t, str):
                g = grids[int(t[3:])]
                ids += [pad] * image_token_count(g, merge)
                used.append(g)
            else:
                ids.append(t)
        x = torch.tensor([ids])
        ref, _ = model.get_rope_index(x, (x == pad).int(), torch.tensor(used) if used else None)
        ours = mrope_positions(ids, used, pad, merge)
        assert torch.equal(ours, ref[:, 0]), lay
        if used:  # the control: plain positions are not these
            assert not torch.equal(ours, torch.arange(len(ids)).expand(3, -1))
    # a generated image token after the last image: text, one position after the previous token
    ids = [5] + [pad] * 16 + [6, pad, 7]
    mask = torch.zeros(len(ids), dtype=torch.bool)
    pos = mrope_positions(ids, [[1, 8, 8]], pad, merge, mask=mask)
    assert mask.tolist() == [False] + [True] * 16 + [False] * 3
    assert pos[:, -3:].tolist() == [[5, 6, 7]] * 3  # the image took positions 1 .. 4 (4 x 4 merged patches)


# --------------------------------------------------------------------------------------------------- model
def test_megatron_vlm_equals_transformers_at_tp1_tp2_grads_and_round_trip(vlm):
    """One 2-rank job (_vlm_worker.py): logits at TP1 and TP2 equal transformers' (fp32: 1e-5, measured 2e-7 at a
    logit scale of 0.7 on Intel Xeon AMX); zeroing the pixels or dropping the 3-D positions moves them by far more
    (the controls); one step's gradients at DP2 and TP2, the vision tower's included, equal one unsharded model's
    (relative 1e-5); the HF folder written from the TP2 shards is the source, bit for bit."""
    proc = run_torchrun(os.path.join(REPO, "tests", "models", "_vlm_worker.py"), 2, [str(vlm)], timeout=300)
    assert proc.returncode == 0, tail(proc)
    r = json.load(open(vlm / "result-hf.json"))
    assert r["image_tokens"] == 16 + 15, r  # 112x112 -> 8x8 patches; 84x140 -> 6x10 -> 15 merged
    for tp in (1, 2):
        assert r[f"logits/tp{tp}"] <= 1e-5, r
        assert r[f"grads/tp{tp}/names_match"], r
        assert r[f"grads/tp{tp}/max_rel_diff"] <= 1e-5, r
    assert r["control/pixels_zeroed"] > 100 * max(r["logits/tp1"], 1e-7), r
    assert r["control/plain_positions"] > 100 * max(r["logits/tp1"], 1e-7), r
    assert r["grads/vision_tensors"] > 20 and r["grads/vision_grad_norm"] > 0, r
    assert r["round_trip/names_match"] and r["round_trip/max_abs_diff"] == 0.0, r
    assert r["round_trip/vision_tensors"] == r["grads/vision_tensors"], r


def test_vlm_layouts_refused_by_name(vlm):
    from rlhf.models.spec import load_hf_config, spec_from_hf_config
    from rlhf.models.vlm import check_vlm_layout

    spec = spec_from_hf_config(load_hf_config(str(vlm / "hf")))
    assert spec.model_type == "qwen2_5_vl" and spec.mrope_section == (4, 6, 6) and spec.qkv_bias
    check_vlm_layout(spec)  # TP and DP: fine
    for kw, flag in ((dict(pp=2), "--pp 2"), (dict(cp=2), "--context_parallel_size 2"),
                     (dict(packing=True), "--packing_samples"), (dict(lora=True), "--lora_rank")):
        with pytest.raises(ValueError, match=flag):
            check_vlm_layout(spec, **kw)
    bad = load_hf_config(str(vlm / "hf"))
    bad["text_config"]["rope_parameters"]["mrope_section"] = [4, 6, 8]
    with pytest.raises(ValueError, match="mrope_section"):
        spec_from_hf_config(bad)


# ---------------------------------------------------------------------------------------------------- data
def _records(vlm, tmp_path, rows):
    path = tmp_path / "data.jsonl"
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _build(vlm, path, **kw):
    from transformers import AutoTokenizer

    from rlhf.data import DataConfig, build_prompt_dataset
    from rlhf.data.vision import VisionPart, vision_data
    from rlhf.models.spec import load_hf_config, spec_from_hf_config

    hf = str(vlm / "hf")
    vd = vision_data(spec_from_hf_config(load_hf_config(hf)), hf, VisionPart(**kw))
    cfg = DataConfig(dataset=path, input_key="prompt", apply_chat_template=True, prompt_max_len=128, vision=vd)
    samples = build_prompt_dataset(cfg, AutoTokenizer.from_pretrained(hf))[0]  # shuffled: back to file order
    return sorted(samples, key=lambda s: int(s.origin.rsplit(" ", 1)[1])), vd


def test_image_formats_and_placeholders(vlm, tmp_path):
    """The peers' image forms all give the same pixels: a relative path, an absolute path, raw bytes (in a dict, as
    parquet holds HF's Image column), a data: URI; ``<image>`` in a string or an image content item; each image's
    placeholder expanded to its token count; a text-only record has none."""
    a = vlm / "images" / "a.png"
    raw = a.read_bytes()
    uri = "data:image/png;base64," + base64.b64encode(raw).decode()
    os.symlink(vlm / "images", tmp_path / "images")
    rows = [{"prompt": "<image>what is it", "images": ["images/a.png"]},
            {"prompt": "<image>what is it", "images": [str(a)]},
            {"prompt": "<image>what is it", "images": [{"bytes": None, "path": str(a)}]},
            {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]}],
             "images": uri},
            {"prompt": "no image here", "images": []}]
    samples, vd = _build(vlm, _records(vlm, tmp_path, rows))
    assert len(samples) == 5
    first = samples[0]
    assert first.mm["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert int((first.prompt_ids == vd.image_token_id).sum()) == 16
    for s in samples[1:4]:
        assert torch.equal(s.prompt_ids, first.prompt_ids)
        assert torch.equal(s.mm["pixel_values"], first.mm["pixel_values"])
        assert s.images[0].size == (112, 112)
    assert samples[4].mm is None and int((samples[4].prompt_ids == vd.image_token_id).sum()) == 0
    # --max_pixels smaller: fewer patches (and the flag wins over preprocessor_config.json)
    small, _ = _build(vlm, _records(vlm, tmp_path, rows[:1]), max_pixels=56 * 56)
    assert small[0].mm["image_grid_thw"].tolist() == [[1, 4, 4]]


@pytest.mark.parametrize("row,message", [
    ({"prompt": "<image>q", "images": ["images/missing.png"]}, "image 0: image file not found"),
    ({"prompt": "<image>q", "images": [{"bytes": base64.b64encode(b"not a png").decode()}]}, "unreadable image"),
    ({"prompt": "<image>q", "images": ["images/a.png", "images/a.png"]}, "2 image\\(s\\) in key 'images' but 1"),
    ({"prompt": "<image><image>q", "images": ["images/a.png"]}, "1 image\\(s\\) in key 'images' but 2"),
    ({"prompt": "<image>q", "images": ["https://example.com/a.png"]}, "image URLs are not fetched"),
])
def test_bad_images_name_the_record_before_any_model(vlm, tmp_path, row, message):
    """A missing file, an unreadable image, more images than placeholders (and fewer), a URL: ValueError naming the
    file and line, raised by the data layer (no model is built here)."""
    os.symlink(vlm / "images", tmp_path / "images")
    with pytest.raises(ValueError, match=f"data.jsonl: line 1: .*{message}"):
        _build(vlm, _records(vlm, tmp_path, [row]))


def test_more_images_than_the_flag_allows_and_a_prompt_too_long(vlm, tmp_path):
    os.symlink(vlm / "images", tmp_path / "images")
    two = {"prompt": "<image><image>q", "images": ["images/a.png", "images/b.png"]}
    with pytest.raises(ValueError, match="more than --max_images_per_prompt 1"):
        _build(vlm, _records(vlm, tmp_path, [two]))
    assert len(_build(vlm, _records(vlm, tmp_path, [two]), max_images_per_prompt=2)[0][0].images) == 2
    from transformers import AutoTokenizer

    from rlhf.data import DataConfig, build_prompt_dataset
    from rlhf.data.vision import VisionPart, vision_data
    from rlhf.models.spec import load_hf_config, spec_from_hf_config

    hf = str(vlm / "hf")
    vd = vision_data(spec_from_hf_config(load_hf_config(hf)), hf, VisionPart())
    cfg = DataConfig(dataset=_records(vlm, tmp_path, [{"prompt": "<image>q", "images": ["images/a.png"]}]),
                     input_key="prompt", apply_chat_template=True, prompt_max_len=12, vision=vd)
    with pytest.raises(ValueError, match="an image cannot be cut"):
        build_prompt_dataset(cfg, AutoTokenizer.from_pretrained(hf))


def test_vllm_gets_one_placeholder_per_image():
    from rlhf.data.vision import collapse_placeholders

    assert collapse_placeholders([1, 9, 9, 9, 2, 3, 9, 9, 4], 9) == [1, 9, 2, 3, 9, 4]


def test_vllm_with_images_equals_the_trainer_and_syncs_the_tower(vlm):
    """2 ranks (_vlm_vllm_worker.py; megatron TP 2, vLLM TP 2 from dummy weights, as the PPO job runs them; about
    60 s, two vLLM TP-2 engines starting is most of it): vLLM's log-probs of its own replies to image prompts equal the trainer's forward with the same images
    (fp32: 1e-5; measured 9.5e-7 on Intel Xeon AMX; pixels zeroed 0.07, tower not synced 1.2), and not with the pixels zeroed (the control); after an update a
    sync without the vision tower leaves the engine off, a full sync brings it back."""
    proc = run_torchrun(os.path.join(REPO, "tests", "models", "_vlm_vllm_worker.py"), 2, [str(vlm)], timeout=300)
    assert proc.returncode == 0, tail(proc)
    r = json.load(open(vlm / "vllm_result.json"))
    assert r["synced"] <= 1e-5 and r["resynced"] <= 1e-5, r
    assert r["pixels_zeroed"] > 1e-3, r
    assert r["tower_not_synced"] > 1e-3, r
