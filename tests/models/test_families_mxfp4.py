"""GPT-OSS's MXFP4 experts (rlhf.models.mxfp4): our dequantization equals transformers' own
(``transformers.integrations.mxfp4.convert_moe_packed_tensors``) bit for bit, and a tiny GPT-OSS folder stored as the
released checkpoints are (``experts.*_blocks`` / ``*_scales``, ``quantization_config.quant_method=mxfp4``) loads into
megatron with the logits of transformers' dequantized load (``Mxfp4Config(dequantize=True)``, cast to fp32: on CPU
transformers dequantizes to bf16, whose values are the same, E2M1 times a power of two). One in-process rank."""
import json
import os
import shutil

import pytest
import torch


def _random_mxfp4(shape_in_out, generator):
    """blocks (E, out, in / 32, 16) uint8 and scales (E, out, in / 32) near 2**-6 .. 2**-1 (exponent + 127)."""
    e, fan_in, fan_out = shape_in_out
    blocks = torch.randint(0, 256, (e, fan_out, fan_in // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(118, 124, (e, fan_out, fan_in // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from rlhf.models.mxfp4 import dequantize

    g = torch.Generator().manual_seed(0)
    blocks, scales = _random_mxfp4((3, 128, 96), g)
    scales[0, 0, 0] = 127 + 5  # a large scale too
    ours = dequantize(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert ours.shape == theirs.shape == (3, 128, 96)
    assert torch.equal(ours, theirs)


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """The tiny GPT-OSS with its experts replaced by random MXFP4 blocks and scales, as the hub's checkpoints."""
    from safetensors.torch import load_file, save_file

    from rlhf.models.tiny import make_tiny_family

    work = tmp_path_factory.mktemp("mxfp4")
    src = make_tiny_family(str(work / "bf16"), "gpt_oss", seed=5)
    dst = str(work / "mxfp4")
    shutil.copytree(src, dst)
    sd = load_file(os.path.join(dst, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        sd[k + "_blocks"], sd[k + "_scales"] = _random_mxfp4(tuple(sd.pop(k).shape), g)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)
    return dst


def test_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(mxfp4_folder):
    import transformers

    from helpers import free_port
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.models.convert import fill_from_hf
    from rlhf.models.gpt import build_model
    from rlhf.models.spec import load_hf_config, padded_vocab_size, spec_from_hf_config

    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        mxfp4_folder, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).float().eval()
    ids = torch.randint(0, ref_model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = ref_model(input_ids=ids).logits
    spec = spec_from_hf_config(load_hf_config(mxfp4_folder))
    assert spec.mxfp4
    initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"))
    try:
        pv = padded_vocab_size(spec.vocab_size)
        model = build_model(spec, tp=1, pp=1, pp_rank=0, padded_vocab=pv)
        fill_from_hf(model, mxfp4_folder, spec, pv, tp=1, pp=1, tp_rank=0, pp_rank=0)
        model.eval()
        with torch.no_grad():
            ours = model(ids)[..., : spec.vocab_size]
        down = ref_model.model.layers[1].mlp.experts.down_proj[2]  # (I, H) of expert 2
        fc2 = dict(model.named_parameters())["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"]
        assert torch.equal(fc2.t(), down)  # the dequantized values themselves
    finally:
        destroy_mesh()
    assert (ours - ref).abs().max().item() <= 1e-5
