"""--transformer_impl and the Transformer Engine layer spec's names, on CPU (TE cannot be imported here).

Under TE's spec each layer's norms are fused into the linear after them (``self_attention.linear_qkv.
layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``) and TE adds ``_extra_state``. A TE-named parameter
set built by hand from a real HF checkpoint must map to the same HF tensors as the local spec's names, in both
directions and at TP2; checkpoints must not depend on the spec; asking for TE where it cannot run must fail
before any model loads."""
import pytest
import torch

from rlhf.models import gpt
from rlhf.models.hf_llama import full_from_tp_shards, hf_from_megatron, megatron_shard_from_hf

TE_RENAME = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight")
ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf(request, tmp_path_factory):
    """A tiny random HF checkpoint (GQA; qwen2 has q/k/v biases) and a lazy getter over its tensors."""
    from rlhf.models.hf_io import HFCheckpointReader
    from rlhf.models.spec import load_hf_config, padded_vocab_size, spec_from_hf_config
    from rlhf.models.tiny import make_tiny_hf

    d = str(tmp_path_factory.mktemp(request.param))
    make_tiny_hf(d, request.param, seed=3, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 num_key_value_heads=2)
    spec = spec_from_hf_config(load_hf_config(d))
    return spec, HFCheckpointReader(d), padded_vocab_size(spec.vocab_size)


def _local_names(spec) -> list[str]:
    per_layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                 "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    if spec.qkv_bias:
        per_layer.append("self_attention.linear_qkv.bias")
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    names += [f"decoder.layers.{i}.{n}" for i in range(spec.num_layers) for n in per_layer]
    return names + ([] if spec.tie_word_embeddings else ["output_layer.weight"])


def _te_name(name: str) -> str:
    for local, te in TE_RENAME.items():
        if name.endswith("." + local):
            return name[: -len(local)] + te
    return name


def _partition_dim(name: str) -> int | None:
    if name.endswith(COLUMN) or name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    return 1 if name.endswith(ROW) else None


def test_te_and_local_names_map_to_the_same_hf_tensors(hf):
    spec, reader, padded = hf
    names = _local_names(spec)
    assert sum(_te_name(n) != n for n in names) == 2 * spec.num_layers  # both norms of every layer
    for tp in (1, 2):
        hf_local, hf_te = {}, {}
        for name in names:
            # HF -> megatron: each TP rank's shard, read lazily, under both names
            shards = [megatron_shard_from_hf(name, reader.get, spec, tp_rank=r, tp=tp, layer_offset=0,
                                             padded_vocab=padded) for r in range(tp)]
            te_shards = [megatron_shard_from_hf(_te_name(name), reader.get, spec, tp_rank=r, tp=tp, layer_offset=0,
                                                padded_vocab=padded) for r in range(tp)]
            assert all(torch.equal(a, b) for a, b in zip(shards, te_shards)), name
            # megatron -> HF from the gathered tensor (as the weight sync and the export do)
            full = full_from_tp_shards(name, shards, _partition_dim(name))
            hf_local.update(hf_from_megatron(name, full, spec))
            hf_te.update(hf_from_megatron(_te_name(name), full, spec))
        tied = {"lm_head.weight"} if spec.tie_word_embeddings else set()
        assert hf_local.keys() == hf_te.keys() == set(reader.keys()) - tied
        for k in hf_local:
            assert torch.equal(hf_local[k], hf_te[k]) and torch.equal(hf_local[k], reader.get(k)), (tp, k)


def test_unknown_names_still_raise(hf):
    spec, reader, padded = hf
    for name in ("decoder.layers.0.self_attention.linear_qkv.layer_norm_bias", "decoder.layers.0.mlp.linear_fc1.x"):
        with pytest.raises(ValueError, match="unknown megatron parameter"):
            megatron_shard_from_hf(name, reader.get, spec, tp_rank=0, tp=1, layer_offset=0, padded_vocab=padded)
        with pytest.raises(ValueError, match="unknown megatron parameter"):
            list(hf_from_megatron(name, torch.zeros(4), spec))


def test_checkpoints_do_not_depend_on_the_spec():
    """megatron's local spec already stores its norms under TE's fused names, and TE's _extra_state (FP8
    metadata) is dropped from every sharded state dict we save or load: the keys are the same under both."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    keys_map = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map
    assert keys_map == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    te_sd = {"decoder.layers.0.self_attention.linear_qkv.weight": 1,
             "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": 2,
             "decoder.layers.0.self_attention.linear_qkv._extra_state": 3,
             "decoder.layers.0.mlp.linear_fc1._extra_state": 4, "embedding.word_embeddings.weight": 5}
    assert gpt.without_extra_state(te_sd) == {k: v for k, v in te_sd.items() if v in (1, 2, 5)}


def test_transformer_impl_resolution(monkeypatch):
    assert gpt.resolve_transformer_impl(None) == "local"  # no CUDA here
    assert gpt.resolve_transformer_impl("local") == "local"
    with pytest.raises(ValueError, match="--transformer_impl 'tensorrt'"):
        gpt.resolve_transformer_impl("tensorrt")
    with pytest.raises(ValueError, match="--transformer_impl transformer_engine needs CUDA.*--transformer_impl local"):
        gpt.resolve_transformer_impl("transformer_engine")
    with pytest.raises(ValueError, match="with --lora_rank"):
        gpt.resolve_transformer_impl("transformer_engine", lora=True)
    # a CUDA machine: TE missing, TE broken (built against another torch), TE fine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpt, "te_import_error", lambda: "ModuleNotFoundError: No module named 'transformer_engine'")
    assert gpt.resolve_transformer_impl(None) == "local"
    with pytest.raises(ValueError, match=r"does not import \(ModuleNotFoundError.*--no-build-isolation"):
        gpt.resolve_transformer_impl("transformer_engine")
    monkeypatch.setattr(gpt, "te_import_error", lambda: "ImportError: undefined symbol: _ZN3c10")
    monkeypatch.setattr(gpt, "_TE_WARNED", False)
    warnings = []
    monkeypatch.setattr(gpt.log, "warning", lambda msg, *a: warnings.append(msg % a))
    assert gpt.resolve_transformer_impl(None) == "local"
    assert len(warnings) == 1 and "installed but does not import (ImportError: undefined symbol" in warnings[0]
    monkeypatch.setattr(gpt, "te_import_error", lambda: None)
    assert gpt.resolve_transformer_impl(None) == "transformer_engine"
    assert gpt.resolve_transformer_impl(None, lora=True) == "local"  # LoRA wraps the local linears


def test_the_2026_families_run_local_layers_by_default_and_refuse_te_by_name(monkeypatch):
    """On a CUDA machine with TE, auto picks TE for a Llama and the local spec for a family whose TE layer names
    are not mapped (DeepSeek-V3's MLA, Qwen3-Next's DeltaNet); asking for TE there is a ValueError naming both."""
    import transformers

    from rlhf.models.spec import spec_from_hf_config
    from rlhf.models.tiny import DEFAULT_DIMS, TINY_FAMILIES, TINY_HYBRIDS

    llama = spec_from_hf_config(transformers.LlamaConfig(vocab_size=300, hidden_size=64, num_attention_heads=2,
                                                         intermediate_size=96, num_hidden_layers=2).to_dict())
    mla = spec_from_hf_config(transformers.DeepseekV3Config(
        **{**DEFAULT_DIMS, "vocab_size": 300, "num_attention_heads": 2, **TINY_FAMILIES["deepseek_v3"][1]}).to_dict())
    hybrid = spec_from_hf_config(transformers.Qwen3NextConfig(vocab_size=300, **TINY_HYBRIDS["qwen3_next"][1])
                                 .to_dict())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpt, "te_import_error", lambda: None)
    assert gpt.resolve_transformer_impl(None, spec=llama) == "transformer_engine"
    assert gpt.resolve_transformer_impl("transformer_engine", spec=llama) == "transformer_engine"
    for spec in (mla, hybrid):
        assert gpt.resolve_transformer_impl(None, spec=spec) == "local"
        with pytest.raises(ValueError, match=f"--transformer_impl transformer_engine with {spec.model_type}: .*"
                                             "use --transformer_impl local"):
            gpt.resolve_transformer_impl("transformer_engine", spec=spec)


def test_the_flag_fails_before_any_model_loads(tmp_path, capsys):
    """The SFT entry point's body in this process: exit 2 and one error line naming the flag, nothing built."""
    from rlhf.supervised import sft
    from rlhf.supervised.loop import main

    argv = ["--pretrain", str(tmp_path / "absent"), "--dataset", str(tmp_path / "absent.jsonl"), "--save_path",
            str(tmp_path / "out"), "--transformer_impl", "transformer_engine"]
    assert main(sft, argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert err and "--transformer_impl transformer_engine needs CUDA" in err[0], err


def test_te_grouped_expert_names_map_like_sequential_mlp(tmp_path):
    """Under TE the experts run as a grouped GEMM (TEGroupedMLP): ``mlp.experts.linear_fc1.weightJ`` instead of
    the local spec's ``mlp.experts.local_experts.J.linear_fc1.weight``. Both names must read and write the same HF
    tensors at TP2 x EP2, and TP shards of a grouped fc1 must rebuild as ``[gate; up]``."""
    from rlhf.models.hf_io import HFCheckpointReader
    from rlhf.models.spec import load_hf_config, padded_vocab_size, spec_from_hf_config
    from rlhf.models.tiny import make_tiny_hf
    from rlhf.rollout.weight_sync import _Param

    d = str(tmp_path / "mixtral")
    make_tiny_hf(d, "mixtral", seed=3, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    spec = spec_from_hf_config(load_hf_config(d))
    get, vocab = HFCheckpointReader(d).get, padded_vocab_size(spec.vocab_size)
    for layer in range(2):
        for j in range(2):  # local experts of each of the 2 EP ranks
            for fc, dim in (("linear_fc1", 0), ("linear_fc2", 1)):
                local = f"decoder.layers.{layer}.mlp.experts.local_experts.{j}.{fc}.weight"
                te = f"decoder.layers.{layer}.mlp.experts.{fc}.weight{j}"
                assert _Param(te, (1,), torch.float32, dim).expert and _Param(local, (1,), torch.float32, dim).expert
                for ep_rank in range(2):
                    shards = []
                    for tp_rank in range(2):
                        kw = dict(tp_rank=tp_rank, tp=2, layer_offset=0, padded_vocab=vocab, ep_rank=ep_rank, ep=2)
                        b = megatron_shard_from_hf(te, get, spec, **kw)
                        assert torch.equal(megatron_shard_from_hf(local, get, spec, **kw), b)
                        shards.append(b)
                    full = full_from_tp_shards(te, shards, dim)
                    assert torch.equal(full, full_from_tp_shards(local, shards, dim))
                    mine = dict(hf_from_megatron(te, full, spec, expert_offset=2 * ep_rank))
                    assert mine.keys() == dict(hf_from_megatron(local, full, spec, expert_offset=2 * ep_rank)).keys()
                    for name, t in mine.items():  # the whole HF tensor of global expert 2 * ep_rank + j
                        assert f"experts.{2 * ep_rank + j}." in name and torch.equal(t, get(name)), name
