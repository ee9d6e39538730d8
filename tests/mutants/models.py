"""Planted bugs of the 2026 families and of MoE at TP > 1 (rlhf/models: spec_families, families, hf_families,
layer_specs, sequence_parallel, mxfp4, mtp): each removes one term the equivalence with transformers relies on, or one
refusal; and of the weight gradients accumulated into megatron's main_grad (rlhf/compat/main_grad.py). The
equivalence tests run one 4-rank job (tests/models/test_families_equivalence.py, about 2 minutes a mutant); the rest
are in-process."""
from tests.mutants import Mutant

EQ = "tests/models/test_families_equivalence.py::"
SPEC = "tests/models/test_spec_families.py::"
PACK = "tests/models/test_families_packing.py::"
MX = "tests/models/test_families_mxfp4.py::"
TE = "tests/models/test_te_names.py::"
MG = "tests/models/test_main_grad.py::"
MGF = "rlhf/compat/main_grad.py"
MG_STEP = MG + "test_a_bf16_step_through_megatrons_ddp_matches_its_own_weight_gradients"


def _logits(model, layout="tp1pp1"):
    return f"{EQ}test_logits_match_transformers[{model}-{layout}]"


def _grads(model, layout):
    return f"{EQ}test_loss_and_grads_match_transformers_backward[{model}-{layout}]"


GRPO_OSS_TP2 = "tests/ppo/test_families_moe.py::test_grpo_with_each_moe_family[gpt_oss-tp2]"

MUTANTS = [
    Mutant("models-biased-experts-split-over-tp", "rlhf/models/spec_families.py",
           find='''    return 1 if any(s is not None and s.linear_bias and s.num_experts for s in specs) else tp''',
           replace='''    return tp''',
           claim="gpt_oss trains at TP 2: its biased experts at expert-TP 1 (megatron takes them there only)",
           tests=(_logits("gpt_oss", "tp2pp1"),)),
    Mutant("models-biased-expert-grads-not-reduced-once", "rlhf/compat/megatron_moe.py",
           find='''                p.allreduce, p.sequence_parallel = False, False''', replace='''                pass''',
           claim="gpt_oss at TP 2: its experts' gradients summed once over the TP ranks' tokens (expert-DP)",
           tests=(_grads("gpt_oss", "tp2pp2"), _grads("gpt_oss", "tp2pp1ep2"))),
    Mutant("models-whole-experts-read-as-tp-shards", "rlhf/models/convert.py",
           find='''                                           ep=ep, etp=etp)''', replace='''                                           ep=ep)''',
           claim="an HF checkpoint loads gpt_oss's experts whole on each TP rank (expert-TP 1)",
           tests=(_logits("gpt_oss", "tp2pp1"),)),
    Mutant("models-whole-experts-gathered-over-tp", "rlhf/rollout/weight_sync.py",
           find='''        tp, tp_group = (self.etp, self.etp_group) if params[0].expert else (mesh.tp, mesh.tp_group)''',
           replace='''        tp, tp_group = mesh.tp, mesh.tp_group''',
           claim="the export (and weight sync) of gpt_oss at TP 2 takes each rank's whole experts once",
           tests=(GRPO_OSS_TP2,)),
    Mutant("models-sp-norm-grads-not-summed", "rlhf/models/layer_specs.py",
           find='''            self.weight.sequence_parallel = True''', replace='''            pass''',
           claim="under sequence parallelism the norms' weight gradients are summed over TP",
           tests=(_grads("mixtral", "tp2pp1ep2"), _grads("deepseek_v3", "tp2pp1ep2"))),
    Mutant("models-mla-column-parallel-down-projections", "rlhf/models/layer_specs.py",
           find='''        changes.update(linear_q_down_proj=Linear, linear_kv_down_proj=Linear)''',
           replace='''        pass''',
           claim="MLA's down projections are replicated over TP (the rotary key's gradient summed over TP)",
           tests=(_grads("deepseek_v3", "tp2pp1ep2"),)),
    Mutant("models-expert-bias-correction-dropped", "rlhf/models/families.py",
           find='''        out.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=float(expert_bias_update_rate))''',
           replace='''        pass''',
           claim="DeepSeek's e_score_correction_bias shifts the scores the top-k is taken on",
           tests=(_logits("deepseek_v3"), _logits("glm4_moe"))),
    Mutant("models-expert-bias-rate-flag-dropped", "rlhf/config/parts.py",
           find='''expert_bias_update_rate=self.moe_router_bias_update_rate)''',
           replace='''expert_bias_update_rate=0.0)''',
           claim="--moe_router_bias_update_rate reaches the trained model: its expert bias moves at that rate",
           tests=("tests/ppo/test_families_moe.py::test_grpo_with_each_moe_family[glm4_moe]",)),
    Mutant("models-group-limited-routing-off", "rlhf/models/families.py",
           find='''    if r["num_groups"]:''', replace='''    if False:''',
           claim="DeepSeek's group-limited top-k (n_group, topk_group)",
           tests=(_logits("deepseek_v3"),)),
    Mutant("models-routed-scaling-dropped", "rlhf/models/families.py",
           find='''    out = dict(moe_router_score_function=r["score"], moe_router_topk_scaling_factor=r["scaling"]
               if r["scaling"] != 1.0 else None)''',
           replace='''    out = dict(moe_router_score_function=r["score"])''',
           claim="the routed experts' weights are scaled by routed_scaling_factor",
           tests=(_logits("deepseek_v3"), _logits("glm4_moe"))),
    Mutant("models-shared-experts-dropped", "rlhf/models/families.py",
           find='''        out.update(moe_shared_expert_intermediate_size=spec.shared_expert_size, moe_shared_expert_overlap=False)''',
           replace='''        pass''',
           claim="the shared experts (n_shared_experts) run beside the routed ones",
           tests=(_logits("deepseek_v3"), _logits("glm4_moe"))),
    Mutant("models-mla-yarn-softmax-mscale-dropped", "rlhf/models/families.py",
           find='''               mscale_all_dim=all_dim)''', replace='''               mscale_all_dim=0.0)''',
           claim="MLA's softmax is scaled by YaRN's mscale(factor, mscale_all_dim) squared, as transformers scales it",
           tests=(_logits("deepseek_v3"),)),
    Mutant("models-partial-rotary-ignored", "rlhf/models/gpt.py",
           find='''                             rotary_percent=spec.rotary_percent)''',
           replace='''                             rotary_percent=1.0)''',
           claim="GLM's RoPE turns only the first partial_rotary_factor of each head",
           tests=(_logits("glm4_moe"),)),
    Mutant("models-sinks-dropped", "rlhf/models/families.py",
           find='''        out["softmax_type"] = "learnable"''', replace='''        pass''',
           claim="GPT-OSS's sinks enter every softmax's denominator",
           tests=(_logits("gpt_oss"),)),
    Mutant("models-every-layer-windowed", "rlhf/models/families.py",
           find='''        out["window_attn_skip_freq"] = [int(w) for w in spec.window_layers]  # 1: the window, 0: full attention''',
           replace='''        pass''',
           claim="GPT-OSS's full_attention layers attend to the whole context, its sliding ones to the window",
           tests=(_logits("gpt_oss"),)),
    Mutant("models-swiglu-clamp-dropped", "rlhf/models/families.py",
           find='''                   activation_func_clamp_value=limit)''', replace='''                   activation_func_clamp_value=None)''',
           claim="GPT-OSS's SwiGLU clamps gate and up at swiglu_limit",
           tests=(_logits("gpt_oss"),)),
    Mutant("models-gpt-oss-gate-up-swapped", "rlhf/models/hf_families.py",
           find='''        gate, up = t[..., 0::2], t[..., 1::2]''', replace='''        gate, up = t[..., 1::2], t[..., 0::2]''',
           claim="GPT-OSS's experts interleave gate (even) and up (odd) columns",
           tests=(_logits("gpt_oss"),)),
    Mutant("models-mtp-tensors-not-kept", "rlhf/models/mtp.py",
           find='''    return {n: reader.get(n) for n in sorted(reader.keys()) if is_mtp_name(n, spec)}''',
           replace='''    return {}''',
           claim="DeepSeek's MTP layers' tensors survive the HF -> megatron -> HF round trip",
           tests=(f"{EQ}test_hf_round_trip_is_bit_exact_from_any_layout",)),
    Mutant("models-mxfp4-nibbles-swapped", "rlhf/models/mxfp4.py",
           find='''    values = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # (..., R, G, 32), low nibble first''',
           replace='''    values = torch.stack([lut[b >> 4], lut[b & 0x0F]], dim=-1).flatten(-2)''',
           claim="MXFP4 blocks hold two E2M1 values a byte, the low nibble first",
           tests=(f"{MX}test_dequantize_equals_transformers", f"{MX}test_mxfp4_checkpoint_loads_as_transformers_dequantizes_it")),
    Mutant("models-sigmoid-renormalisation-unchecked", "rlhf/models/spec_families.py",
           find='''    if norm != (topk > 1):''', replace='''    if False:''',
           claim="norm_topk_prob=False with k > 1 is refused (megatron's sigmoid router always renormalises then)",
           tests=(f"{SPEC}test_unsupported_fields_raise_naming_them",)),
    Mutant("models-group-score-width-unchecked", "rlhf/models/spec_families.py",
           find='''        if topk % group_topk or topk // group_topk != 2:''', replace='''        if topk % group_topk:''',
           claim="groups are refused unless k / topk_group = 2 (transformers scores a group by its top 2)",
           tests=(f"{SPEC}test_unsupported_fields_raise_naming_them",)),
    Mutant("models-vllm-gpt-oss-allowed", "rlhf/models/spec_families.py",
           find='''    if spec.model_type == "gpt_oss":
        return ("vLLM 0.32''', replace='''    if False:
        return ("vLLM 0.32''',
           claim="vLLM, whose weight sync keeps gpt_oss's first experts and sinks, is refused for gpt_oss",
           tests=(f"{SPEC}test_what_vllm_cannot_generate_is_refused_by_name",)),
    Mutant("models-families-cp-allowed", "rlhf/models/families.py",
           find='''    if is_family(spec) and cp > 1:''', replace='''    if is_family(spec) and cp > 99:''',
           claim="context parallelism is refused for the 2026 families before any weight is read",
           tests=(f"{PACK}test_gpt_oss_packed_and_families_under_cp_are_refused",)),
    Mutant("models-family-auto-picks-te", "rlhf/models/gpt.py",
           find="    if lora or cp > 1 or family or not torch.cuda.is_available():\n",
           replace="    if lora or cp > 1 or not torch.cuda.is_available():\n",
           claim="by default a 2026 family runs megatron's local layers on a CUDA machine with TE, not a TE spec "
                 "that then refuses it",
           tests=(f"{TE}test_the_2026_families_run_local_layers_by_default_and_refuse_te_by_name",)),
    Mutant("models-family-te-accepted", "rlhf/models/gpt.py",
           find='        if spec is not None:\n            refuse_te_for_family(spec)\n',
           replace='        if False:\n            refuse_te_for_family(spec)\n',
           claim="--transformer_impl transformer_engine with a 2026 family is refused by name before any weight is "
                 "read",
           tests=(f"{TE}test_the_2026_families_run_local_layers_by_default_and_refuse_te_by_name",)),
    Mutant("models-wgrad-ddp-adds-again", MGF,
           find="    w.grad_added_to_main_grad = True\n", replace="",
           claim="a weight gradient accumulated into main_grad in the GEMM is not added again by DDP's hook",
           tests=(MG_STEP,
                  "tests/models/test_onednn.py::test_weight_grad_accumulates_into_main_grad[MainGradLinear-dtype0]")),
    Mutant("models-wgrad-rounded-to-bf16", MGF,
           find="        torch.addmm(mg, g2.t(), x2, out_dtype=torch.float32, out=mg)",
           replace="        mg.add_(torch.mm(g2.t(), x2).float())",
           claim="bf16 weight gradients go into main_grad unrounded (fp32 output of the bf16 GEMM), checked before use",
           tests=(MG + "test_the_check_before_use_and_its_named_fallback", MG_STEP)),
    Mutant("models-wgrad-check-skipped", MGF,
           find="    if not bf16_accumulation_works(device):\n        return 0\n", replace="",
           claim="where torch's fp32-output bf16 GEMM is missing or wrong, megatron's own layers stay (logged once)",
           tests=(MG + "test_the_check_before_use_and_its_named_fallback",)),
    Mutant("models-wgrad-comm-call-routed", MGF,
           find='    return not (got.get("allreduce_dgrad") or got.get("sequence_parallel")',
           replace='    return not (got.get("sequence_parallel")',
           claim="a layer call that all-reduces its input gradient inside the layer (column-parallel at TP > 1) keeps "
                 "megatron's own path",
           tests=(MG + "test_only_calls_without_communication_on_trained_weights_are_routed[call2-False]",)),
]
