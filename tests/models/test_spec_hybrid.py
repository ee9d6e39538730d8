"""qwen3_next's config.json: every field used or refused by name, and the layouts and job features it does not run
with refused before any weight is read (rlhf.models.hybrid)."""
import pytest
import torch

from rlhf.models.hybrid import check_hybrid_job, check_hybrid_layout
from rlhf.models.spec import check_parallel_fit, spec_from_hf_config
from rlhf.models.tiny import TINY_HYBRIDS


def _config(**changes):
    import transformers

    cfg = transformers.Qwen3NextConfig(vocab_size=300, **TINY_HYBRIDS["qwen3_next"][1]).to_dict()
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None or k in changes}


def test_the_tiny_config_reads_as_transformers_builds_it():
    import transformers

    cfg = _config()
    spec = spec_from_hf_config(cfg)
    assert spec.linear_attention == {"conv_kernel_dim": 4, "key_head_dim": 16, "value_head_dim": 8,
                                     "num_key_heads": 2, "num_value_heads": 4, "layers": (True, True, True, False),
                                     "split_in_proj": False}
    assert spec.attention_gate and spec.zero_centered_norm and spec.qk_norm and spec.rotary_percent == 0.25
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3NextConfig(**cfg))
    assert spec.num_params == sum(p.numel() for p in hf.parameters())


def test_moe_layers_read_as_transformers_builds_them():
    import transformers

    cfg = _config(**{k: v for k, v in TINY_HYBRIDS["qwen3_next-moe"][1].items()})
    spec = spec_from_hf_config(cfg)
    assert spec.moe_layers == (True, False, True, True) and spec.num_experts == 4 and spec.moe_topk == 2
    assert spec.shared_expert_size == 48 and spec.shared_expert_gate and spec.moe_norm_topk
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3NextConfig(**cfg))
    assert spec.num_params == sum(p.numel() for p in hf.parameters())
    moe = _config(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2)
    assert spec_from_hf_config(moe).moe_layers == (False, True, False, True)


def test_qwen3_5_text_reads_as_transformers_builds_it():
    """Qwen3.5's text model: the same layers, its DeltaNet's projections apart, the multimodal rotary (plain on
    text)."""
    import transformers

    kw = dict(TINY_HYBRIDS["qwen3_5_text"][1])
    cfg = transformers.Qwen3_5TextConfig(vocab_size=300, **kw).to_dict()
    spec = spec_from_hf_config(cfg)
    assert spec.linear_attention["split_in_proj"] and spec.rotary_percent == 0.25 and spec.rope_scaling is None
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5TextConfig(**cfg))
    assert spec.num_params == sum(p.numel() for p in hf.parameters())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "mrope_interleaved": False}
    with pytest.raises(ValueError, match="mrope_interleaved=False"):
        spec_from_hf_config(cfg)


def test_qwen3_5_moe_text_reads_as_transformers_builds_it():
    """Qwen3.5's MoE text model: every layer MoE (transformers reads no mlp_only_layers, decoder_sparse_step or
    norm_topk_prob for it: given, they are refused by name), the projections apart, no dense intermediate_size."""
    import transformers

    cfg = transformers.Qwen3_5MoeTextConfig(vocab_size=300, **TINY_HYBRIDS["qwen3_5_moe_text"][1]).to_dict()
    cfg = {k: v for k, v in cfg.items() if v is not None and k != "intermediate_size"}
    spec = spec_from_hf_config(cfg)
    assert spec.moe_layers == (True,) * 4 and spec.linear_attention["split_in_proj"] and spec.moe_norm_topk
    assert (spec.num_experts, spec.moe_topk, spec.shared_expert_size, spec.rotary_percent) == (4, 2, 48, 0.25)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5MoeTextConfig(**cfg))
    assert type(hf).__name__ == "Qwen3_5MoeForCausalLM"
    assert spec.num_params == sum(p.numel() for p in hf.parameters())
    for changes in (dict(mlp_only_layers=[1]), dict(decoder_sparse_step=2), dict(norm_topk_prob=False)):
        key = next(iter(changes))
        with pytest.raises(ValueError, match=f"{key}="):
            spec_from_hf_config({**cfg, **changes})


def test_full_attention_interval_gives_the_layer_pattern():
    cfg = _config(full_attention_interval=2)
    del cfg["layer_types"]
    assert spec_from_hf_config(cfg).linear_attention["layers"] == (True, False, True, False)


@pytest.mark.parametrize("changes,field", [
    (dict(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=32), "num_experts_per_tok=5"),
    (dict(num_experts=4, num_experts_per_tok=1, norm_topk_prob=True), "num_experts_per_tok=1 with norm_topk_prob"),
    (dict(num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=0),
     "shared_expert_intermediate_size=0"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads=3"),
    (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "layer_types="),
    (dict(layer_types=["linear_attention"] * 3), "layer_types="),
    (dict(full_attention_interval=2), "full_attention_interval=2"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(sliding_window=8), "sliding_window"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(brand_new_field=1), "brand_new_field"),
    (dict(linear_key_head_dim=None), "linear_key_head_dim"),
])
def test_each_unsupported_field_is_refused_by_name(changes, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("(", r"\(")):
        spec_from_hf_config(_config(**changes))


def test_tp_must_split_whole_key_heads_and_kv_groups():
    spec = spec_from_hf_config(_config())
    check_parallel_fit(spec, 2, 1)
    with pytest.raises(ValueError, match="linear_num_key_heads=2"):
        check_parallel_fit(spec, 4, 1)
    with pytest.raises(ValueError, match="num_key_value_heads=1"):
        check_parallel_fit(spec_from_hf_config(_config(num_key_value_heads=1)), 2, 1)


@pytest.mark.parametrize("kw,flag", [(dict(cp=2), "--context_parallel_size 2"), (dict(value_head=True), "value head"),
                                     (dict(use_te=True), "--transformer_impl local")])
def test_layouts_not_wired_are_refused_by_name(kw, flag):
    spec = spec_from_hf_config(_config())
    args = {**dict(pp=1, ep=1, cp=1, value_head=False, use_te=False), **kw}
    with pytest.raises(ValueError, match=flag):
        check_hybrid_layout(spec, **args)
    check_hybrid_layout(spec, pp=2, ep=1, cp=1, value_head=False, use_te=False)  # PP runs (test_hybrid_equivalence)


def test_lora_and_vllm_are_refused_by_name():
    """LoRA, and vLLM as the generator (the megatron generator runs the family: tests/ppo/test_families_hybrid.py)."""
    spec = spec_from_hf_config(_config())
    with pytest.raises(ValueError, match="--lora_rank"):
        check_hybrid_job(spec, lora=True)
    check_hybrid_job(spec)
    from rlhf.models.spec_families import vllm_refusal

    assert "qwen3_next" in vllm_refusal(spec, 1, "float32", False)
    assert "--rollout_backend megatron" in vllm_refusal(spec, 1, "float32", False)


def test_ppo_refuses_lora_on_the_family_by_name(tmp_path):
    """launch/ppo.py's checks, before any process group or model: LoRA refused; the megatron generator taken."""
    import argparse

    from rlhf.models.tiny import make_tiny_hybrid
    from rlhf.ppo.args import add_args, validate

    make_tiny_hybrid(str(tmp_path / "q3n"))
    p = argparse.ArgumentParser()
    add_args(p)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    args = p.parse_args(["--pretrain", str(tmp_path / "q3n"), "--prompt_data", str(prompts), "--reward_fn",
                         "rlhf.rewards.verifiers:math_reward", "--advantage_estimator", "group_norm",
                         "--n_samples_per_prompt", "2",
                         "--save_path", str(tmp_path / "out"), "--rollout_backend", "megatron"])
    validate(argparse.Namespace(**vars(args)), world_size=1)
    args.lora_rank = 4
    with pytest.raises(ValueError, match=r"qwen3_next\) with --lora_rank"):
        validate(args, world_size=1)


def test_lora_is_refused_on_the_built_model(tmp_path):
    """apply_lora, where SFT/DPO jobs add adapters: its targets would miss the DeltaNet's projections."""
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.env import free_port
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.models.gpt import build_model
    from rlhf.models.lora import LoraConfig, apply_lora

    spec = spec_from_hf_config(_config())
    initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"), device="cpu")
    try:
        model = build_model(spec, tp=1, pp=1, pp_rank=0, use_te=False, init_weights=True)
        with pytest.raises(ValueError, match="--lora_rank"):
            apply_lora(model, LoraConfig(), tp=1, tp_rank=0)
    finally:
        destroy_mesh()


@pytest.mark.parametrize("name", list(TINY_HYBRIDS))
def test_memory_planner_counts_the_models_parameters(name):
    """The planner's per-rank tensors (rlhf.planner.stage_param_numels) are the megatron model's, one by one; at EP 2
    half the experts; at TP 2 half of every split tensor (the norms, q/k norms, the router and the shared expert's
    gate whole)."""
    import transformers

    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.env import free_port
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.models.gpt import build_model
    from rlhf.planner import stage_param_numels

    model_type, kw = TINY_HYBRIDS[name]
    cls = transformers.Qwen3_5TextConfig if model_type == "qwen3_5_text" else transformers.Qwen3NextConfig
    spec = spec_from_hf_config(cls(vocab_size=256, **kw).to_dict())
    initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"), device="cpu")
    try:
        model = build_model(spec, tp=1, pp=1, pp_rank=0, use_te=False)
        ours = [p.numel() for p in model.parameters()]
        experts = sum(p.numel() for n, p in model.named_parameters() if ".local_experts." in n)
        replicated = sum(p.numel() for n, p in model.named_parameters()
                         if n.endswith(("norm.weight", "layernorm.weight", "gate_weight", "router.weight")))
    finally:
        destroy_mesh()
    assert sorted(stage_param_numels(spec, 1, 1, 0, False)) == sorted(ours)
    assert sum(stage_param_numels(spec, 1, 1, 0, False, ep=2)) == sum(ours) - experts // 2
    assert sum(stage_param_numels(spec, 2, 1, 0, False)) == replicated + (sum(ours) - replicated) // 2


WIDE_HEADS = dict(hidden_size=128, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_value_heads=2)


def _measure_layers(spec, dtype, seq, batch):
    """Per decoder layer: the bytes of the distinct non-parameter storages its forward saves for backward
    (``saved_tensors_hooks``), and the peak of live allocations of its forward without autograd."""
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.distributed.env import free_port
    from rlhf.distributed.mesh import destroy_mesh
    from rlhf.models.gpt import build_model
    from rlhf.planner.measure import allocation_peak

    initialize_mesh(1, 1, DistEnv(0, 1, 0, "127.0.0.1", free_port(), "single"), device="cpu")
    try:
        # built in fp32 and cast, as the trainer builds its engines (rlhf.runtime.role: the attention's softmax
        # then runs in the model's dtype)
        model = build_model(spec, tp=1, pp=1, pp_rank=0, use_te=False, init_weights=True).to(dtype)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        out = []
        for layer in model.decoder.layers:
            seen, held = {}, []

            def pack(t):
                st = t.untyped_storage()
                held.append(t)  # alive until counted: no freed address is reused for another storage
                if st.data_ptr() not in params:
                    seen[st.data_ptr()] = st.nbytes()
                return t

            x = torch.randn(seq, batch, spec.hidden_size, dtype=dtype, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = layer(x, attention_mask=None)
            del y, held
            with torch.no_grad():
                work = allocation_peak(lambda: layer(x.detach(), attention_mask=None))
            out.append((sum(seen.values()), work))
        return out
    finally:
        destroy_mesh()


@pytest.mark.parametrize("name,changes", [("qwen3_next", {}), ("qwen3_next", WIDE_HEADS), ("qwen3_5_text", {})],
                         ids=["tiny", "wide-heads", "qwen3_5_text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_memory_planner_knows_the_deltanet_activations(name, changes, dtype):
    """What each layer of a hybrid saves for backward (within 20%), and its forward's working peak (the planner's
    30%), against the planner's per-layer estimate (the torch twin's delta rule, as a CPU runs it): the DeltaNet layers
    (their chunk matrices, state and convolution) and the gated attention alike, in fp32 and bf16. The planner's
    training activations of the stack sum the layers by kind."""
    import transformers

    from rlhf.planner import PlanConfig, activation_bytes, head_bytes, scores_buffer_bytes
    from rlhf.planner.model_bytes import layer_saved_bytes_per_token, layer_working_bytes_per_token

    model_type, kw = TINY_HYBRIDS[name]
    cls = transformers.Qwen3NextConfig if model_type == "qwen3_next" else transformers.Qwen3_5TextConfig
    spec = spec_from_hf_config({k: v for k, v in cls(vocab_size=300, **{**kw, **changes}).to_dict().items()
                                if v is not None})
    seq, batch, e = 256, 2, 2 if dtype == torch.bfloat16 else 4
    report = []
    for i, (saved, work) in enumerate(_measure_layers(spec, dtype, seq, batch)):
        plan_saved = layer_saved_bytes_per_token(spec, 1, seq, e, "local", i, "torch") * seq * batch
        plan_work = layer_working_bytes_per_token(spec, 1, seq, e, "local", i, "torch") * seq * batch
        report.append((i, saved, plan_saved, work, plan_work))
    for i, saved, plan_saved, work, plan_work in report:  # measured here: saved within 8.4%, working within 12%
        assert abs(plan_saved - saved) <= 0.20 * saved, report  # storage sizes: the same on every CPU kind
        assert abs(plan_work - work) <= 0.30 * work, report  # the peak: also the matmul kernels' scratch
    cfg = PlanConfig(actor=spec, reward=spec, nnodes=1, gpus_per_node=1, layer_impl="local", reserved_gib=0.0,
                     bf16=dtype == torch.bfloat16, prompt_max_len=128, generate_max_len=128,
                     micro_train_batch_size=batch, train_batch_size=batch, deltanet_kernel="torch")
    layers = sum(layer_saved_bytes_per_token(spec, 1, seq, e, "local", i, "torch") for i in range(spec.num_layers))
    work = max(layer_working_bytes_per_token(spec, 1, seq, e, "local", i, "torch") for i in range(spec.num_layers))
    rest = scores_buffer_bytes(spec, 1, batch, seq, e, "local") + max(work * seq * batch, head_bytes(
        spec, cfg, seq * batch, 128 * batch, False, True))
    assert activation_bytes(spec, cfg, 0, False, True) == pytest.approx(layers * seq * batch + rest)
