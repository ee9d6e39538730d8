"""megatron-core 0.16.1 settings of the families beyond the Llama layout (``rlhf.models.spec_families`` reads their
configs): multi-latent attention, the sigmoid router with expert bias and group-limited top-k, shared experts, dense
first layers, partial rotary, attention sinks, per-layer sliding windows, biased linears and GPT-OSS's clamped SwiGLU.
Each setting is named by its ``TransformerConfig`` / ``MLATransformerConfig`` field; the equivalence with
transformers' own classes is tested in tests/models/test_families_equivalence.py.

The expert bias (DeepSeek's ``e_score_correction_bias``) is megatron's ``router.expert_bias``: it shifts the scores
the top-k is taken on, never the weights. megatron updates it after every step by ``moe_router_bias_update_rate``
times the sign of each expert's load deficit (``_update_router_expert_bias`` in ``finalize_model_grads``). RL keeps it
frozen by default (``expert_bias_update_rate=0``; ``--moe_router_bias_update_rate`` sets it), as slime's model
scripts do (``--moe-router-bias-update-rate 0`` in scripts/models/deepseek-v3.sh, glm4.5-355B-A32B.sh, kimi-k2.sh at
624b824a); verl's converter updates it at megatron's default rate, 1e-3 (``moe_router_bias_update_rate=0.001`` in ``hf_to_mcore_config_dpskv3``,
verl/models/mcore/config_converter.py at b178a3cd).
"""
from __future__ import annotations

import functools
import math

import torch

from rlhf.models.spec import ModelSpec


def _sigmoid_gate(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """GPT-OSS's gate activation ``x * sigmoid(alpha x)`` (megatron's ``glu`` clamps first, then multiplies by
    ``up + glu_linear_offset``)."""
    return x * torch.sigmoid(alpha * x)


def is_family(spec: ModelSpec) -> bool:
    return spec.mla is not None or spec.router is not None or spec.linear_attention is not None


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_config(spec: ModelSpec) -> dict:
    """MLATransformerConfig fields. transformers' DeepSeek-V3 scales cos/sin by YaRN's attention factor A (from
    mscale / mscale_all_dim, or given) and the softmax by mscale(factor, mscale_all_dim)**2; megatron's MLA scales the
    softmax the same way and cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim), so its ``mscale``
    is solved from A."""
    m = spec.mla
    out = dict(multi_latent_attention=True, q_lora_rank=m["q_lora_rank"], kv_lora_rank=m["kv_lora_rank"],
               qk_head_dim=m["qk_nope_head_dim"], qk_pos_emb_head_dim=m["qk_rope_head_dim"],
               v_head_dim=m["v_head_dim"], rotary_base=spec.rope_theta, rope_type="rope")
    s = spec.rope_scaling
    if s is None:
        return out
    from rlhf.models import rope

    factor, all_dim = float(s["factor"]), float(s.get("mscale_all_dim") or 0.0)
    target = rope.attention_factor(s) * _yarn_mscale(factor, all_dim)  # mscale(factor, megatron's mscale)
    mscale = (target - 1.0) / (0.1 * math.log(factor)) if factor > 1 else 1.0
    out.update(rope_type="yarn", rotary_scaling_factor=factor,
               original_max_position_embeddings=int(s["original_max_position_embeddings"]),
               beta_fast=float(s["beta_fast"]), beta_slow=float(s["beta_slow"]), mscale=mscale,
               mscale_all_dim=all_dim)
    return out


def router_config(spec: ModelSpec, expert_bias_update_rate: float = 0.0) -> dict:
    """The router's TransformerConfig fields (sigmoid scores, expert bias, groups, scaling; or softmax over the top-k
    logits with a biased linear, gpt_oss), shared experts and the dense-layer pattern."""
    r = spec.router
    out = dict(moe_router_score_function=r["score"], moe_router_topk_scaling_factor=r["scaling"]
               if r["scaling"] != 1.0 else None)
    if r["expert_bias"]:
        out.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=float(expert_bias_update_rate))
    if r["num_groups"]:
        out.update(moe_router_num_groups=r["num_groups"], moe_router_group_topk=r["group_topk"])
    if spec.shared_expert_size:
        out.update(moe_shared_expert_intermediate_size=spec.shared_expert_size, moe_shared_expert_overlap=False)
    if spec.dense_layers:
        out["moe_layer_freq"] = [0] * spec.dense_layers + [1] * (spec.num_layers - spec.dense_layers)
    return out


def family_config(spec: ModelSpec, expert_bias_update_rate: float = 0.0) -> dict:
    """Every TransformerConfig field a family sets beyond the Llama layout's (``rlhf.models.gpt``), including the
    ones it changes (``add_bias_linear``, ``activation_func``)."""
    out: dict = {}
    if spec.mla is not None:
        out.update(mla_config(spec))
    if spec.router is not None:
        out.update(router_config(spec, expert_bias_update_rate))
    if spec.linear_bias:
        out["add_bias_linear"] = True
    if spec.attention_sinks:
        out["softmax_type"] = "learnable"
    if spec.window_layers is not None and spec.sliding_window is not None:
        out["window_attn_skip_freq"] = [int(w) for w in spec.window_layers]  # 1: the window, 0: full attention
    if spec.linear_attention is not None:
        from rlhf.models.hybrid import hybrid_config

        out.update(hybrid_config(spec))
    if spec.swiglu is not None:
        alpha, limit = spec.swiglu
        out.update(activation_func=functools.partial(_sigmoid_gate, alpha=alpha), glu_linear_offset=1.0,
                   activation_func_clamp_value=limit)
    return out


def config_class(spec: ModelSpec):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return MLATransformerConfig if spec.mla is not None else TransformerConfig


def mark_tp_params(model: torch.nn.Module) -> None:
    """TP attributes of the family parameters megatron does not mark: the sinks (``softmax_offset``, one per head of
    this rank's partition) are split over TP on dim 0."""
    from megatron.core import tensor_parallel as mtp

    for name, p in model.named_parameters():
        if name.endswith("core_attention.softmax_offset") and not hasattr(p, "tensor_model_parallel"):
            mtp.set_tensor_model_parallel_attributes(p, True, 0, 1)
        # megatron-core 0.16.1's GatedDeltaNet marks these tensor_model_parallel without a partition dim
        if name.endswith(("self_attention.dt_bias", "self_attention.A_log", "self_attention.conv1d.weight",
                          "self_attention.conv1d.bias")) and not hasattr(p, "partition_dim"):
            p.partition_dim, p.partition_stride = 0, 1


def check_family_layout(spec: ModelSpec, cp: int) -> None:
    """Layouts the families do not run in yet, refused by name before any weight is read."""
    if is_family(spec) and cp > 1:
        raise ValueError(f"--context_parallel_size {cp} with {spec.model_type}: context parallelism is not wired for "
                         "its attention yet (MLA's latent keys, GPT-OSS's sinks and windows); use "
                         "--context_parallel_size 1")
