"""Build a megatron-core GPTModel for Llama-family architectures (llama, qwen2, qwen3, mistral; the MoE ones
mixtral and qwen3_moe on megatron's MoE layer).

The same class serves the policy/reference (vocab-parallel logits, or final hidden states for the fused
log-prob kernel) and the critic/reward (a scalar ``score`` head, laid out like HF ``*ForSequenceClassification``).
"""
from __future__ import annotations

import logging
import math
from typing import Literal

import torch
import torch.nn.functional as F

from rlhf.models import rope
from rlhf.models.spec import ModelSpec, check_parallel_fit, padded_vocab_size

log = logging.getLogger(__name__)
_SPEC_LOGGED = False

# Padded vocab columns get this logit: exp() underflows to exactly 0 in fp32 (so softmax ignores them), yet
# p * log p stays 0 * finite = 0, which -inf would turn into nan. It also fits in fp16/bf16.
PAD_LOGIT = -1.0e4


TRANSFORMER_IMPLS = ("local", "transformer_engine")
TE_INSTALL = ("pip install 'transformer-engine[pytorch]>=2.9.0a0,<2.12.0' --no-build-isolation "
              "(RLHF_WITH_TE=1 bash tools/setup_env.sh)")
_TE_WARNED = False
_FAMILY_LOGGED: set[str] = set()


def te_import_error() -> str | None:
    """None if Transformer Engine's PyTorch part imports, else why not (one line)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # a missing package, or a build against another torch (undefined symbols)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def te_available() -> bool:
    return torch.cuda.is_available() and te_import_error() is None


def refuse_te_for_family(spec: ModelSpec) -> None:
    """ValueError for TE layers on a 2026 family (MLA, the sigmoid routers, DeltaNet): their TE layer names are not
    mapped, so they run megatron's local spec."""
    from rlhf.models.families import is_family

    if is_family(spec):
        raise ValueError(f"--transformer_impl transformer_engine with {spec.model_type}: its layers run megatron's "
                         "local spec here (their TE layer names are not mapped yet); use --transformer_impl local")


def resolve_transformer_impl(impl: str | None, *, lora: bool = False, cp: int = 1,
                             spec: ModelSpec | None = None) -> str:
    """``--transformer_impl`` (megatron's name): ``local`` (torch layers), ``transformer_engine``, or None (auto:
    TE when it imports and CUDA is there, else local; local for LoRA, context parallelism and the 2026 families of
    ``spec``, whose TE layer names are not mapped). Raises ValueError, before any model loads, when TE is asked
    for and cannot run. A TE that is installed but fails to import is never hidden: auto logs it once."""
    global _TE_WARNED
    from rlhf.models.families import is_family

    if impl not in (None, *TRANSFORMER_IMPLS):
        raise ValueError(f"--transformer_impl {impl!r}: expected one of {', '.join(TRANSFORMER_IMPLS)}")
    if impl == "local":
        return "local"
    if impl == "transformer_engine":
        if spec is not None:
            refuse_te_for_family(spec)
        if cp > 1:
            raise ValueError(f"--transformer_impl transformer_engine with --context_parallel_size {cp}: context "
                             "parallelism runs megatron's local layers here (TE's own CP attention is not wired "
                             "yet); use --transformer_impl local")
        if lora:
            raise ValueError("--transformer_impl transformer_engine with --lora_rank: LoRA wraps megatron's local "
                             "linears; use --transformer_impl local")
        if not torch.cuda.is_available():
            raise ValueError("--transformer_impl transformer_engine needs CUDA, and this process has none; use "
                             "--transformer_impl local")
        err = te_import_error()
        if err is not None:
            raise ValueError(f"--transformer_impl transformer_engine: Transformer Engine does not import ({err}). "
                             f"Fix: {TE_INSTALL}, or --transformer_impl local")
        return impl
    family = spec is not None and is_family(spec)
    if family and spec.model_type not in _FAMILY_LOGGED and torch.cuda.is_available() and te_import_error() is None:
        _FAMILY_LOGGED.add(spec.model_type)
        log.info("%s runs megatron's local layer spec (its TE layer names are not mapped yet)", spec.model_type)
    if lora or cp > 1 or family or not torch.cuda.is_available():
        return "local"
    err = te_import_error()
    if err is not None and not err.startswith("ModuleNotFoundError") and not _TE_WARNED:
        _TE_WARNED = True
        log.warning("Transformer Engine is installed but does not import (%s): the local layer spec runs. Fix: %s",
                    err, TE_INSTALL)
    return "transformer_engine" if err is None else "local"


def without_extra_state(sharded_state_dict: dict) -> dict:
    """A model's sharded state dict without Transformer Engine's ``_extra_state`` entries (FP8 metadata): our
    checkpoints hold the same keys under either layer spec (megatron's local spec already names its norms as
    TE's fused ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``), so one saved under one
    spec loads under the other, and nothing of TE's is ever exported."""
    return {k: v for k, v in sharded_state_dict.items() if "_extra_state" not in k}


def layer_spec(config, spec: ModelSpec, use_te: bool | None = None):
    """transformer-engine spec when TE and CUDA are there, megatron's local (torch) layers otherwise
    (``rlhf.models.layer_specs``: one spec per layer, sequence-parallel norms, the packed/CP core attention)."""
    global _SPEC_LOGGED
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    if use_te is None:  # auto (tools/compare_logits.py): as --transformer_impl's default picks for this spec
        use_te = resolve_transformer_impl(None, spec=spec) == "transformer_engine"
    if not _SPEC_LOGGED:
        log.info("layer spec: %s", "transformer-engine" if use_te else "local (torch; transformer-engine absent "
                 "or no CUDA; packed THD batches via kernels.varlen_attention; megatron-core's warnings that TE "
                 "and Apex are absent are not shown: its local layers, torch's norms and optimizers run)")
        _SPEC_LOGGED = True
    if use_te:
        refuse_te_for_family(spec)
        # MoE: TE's grouped GEMM (TEGroupedMLP; its experts are linear_fc1.weightJ, see rlhf.models.hf_llama)
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm,
                                                          num_experts=spec.num_experts or None,
                                                          moe_grouped_gemm=bool(spec.num_experts))
    if spec.linear_attention is not None:  # qwen3_next: DeltaNet and gated attention layers
        from rlhf.models.hybrid import hybrid_block_spec

        return hybrid_block_spec(config, spec)
    from rlhf.models.layer_specs import local_block_spec

    return local_block_spec(config)


def sequence_parallel(spec: ModelSpec, tp: int) -> bool:
    """Sequence parallelism: MoE models at TP > 1 (megatron's MoE layer refuses to train at TP > 1 without it, and
    its token dispatcher and aux loss expect each TP rank to hold its own slice of the sequence); dense models keep
    whole sequences on every TP rank."""
    return tp > 1 and bool(spec.num_experts)


def moe_config(spec: ModelSpec, tp: int, ep: int, aux_loss_coef: float = 0.0, grouped_gemm: bool = False,
               routing_replay: bool = False) -> dict:
    """megatron's MoE settings equal to HF's routing: softmax over the experts, top-k, renormalised (mixtral;
    qwen3_moe with ``norm_topk_prob``) or not. megatron's ``pre_softmax=False`` takes the top-k logits and then
    a softmax over those k, which is the renormalised HF weight; ``pre_softmax=True`` the plain softmax. Dropless
    (no capacity factor), as HF. ``aux_loss_coef`` (``--aux_loss_coef``): megatron's load-balancing loss, per
    layer, added to the gradients by the router; 0 turns it off. Tokens reach their experts by the alltoall
    dispatcher, which lets the ranks of an EP group hold different numbers of tokens (their micro-batches are
    trimmed to their own lengths); the ranks must still run the same number of forwards. ``grouped_gemm``: TE's
    grouped GEMM (the TE layer spec); the local spec runs megatron's SequentialMLP.

    Context parallelism: routing is per token, so the experts see each token as without CP; megatron's router
    sums the tokens per expert over the TP x CP group and each CP rank adds the part of the load-balancing loss of
    its own tokens, which gives CP1's gradients as they are (tests/models/test_context_parallel.py; multiplying
    the coefficient by CP, tried, missed by (CP - 1) times the loss's share). The tokens a sequence is padded with
    for the CP split (fewer than 2 x CP) are routed and counted, as the pad tokens of a padded batch are."""
    if not spec.num_experts:
        return {}
    return dict(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk,
                moe_ffn_hidden_size=spec.moe_ffn_hidden_size, moe_router_score_function="softmax",
                moe_router_pre_softmax=not spec.moe_norm_topk, moe_router_dtype="fp32",
                moe_router_load_balancing_type="aux_loss" if aux_loss_coef > 0 else "none",
                moe_aux_loss_coeff=float(aux_loss_coef), moe_token_dispatcher_type="alltoall",
                moe_grouped_gemm=grouped_gemm, moe_permute_fusion=False, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=expert_tp_coords(0, tp)[1], moe_enable_routing_replay=routing_replay)


def expert_tp_coords(tp_rank: int, tp: int) -> tuple[int, int]:
    """(rank, size) of this rank in the experts' TP group: the mesh's (``initialize_mesh(etp=...)``), else TP's."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return tp_rank, tp
    return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()


def fused_swiglu(spec: ModelSpec, use_te: bool) -> bool:
    """Whether the MLP activation runs ``kernels.swiglu`` (``rlhf.compat.megatron.swiglu_function``): dense models of
    the local spec, unless ``RLHF_SWIGLU_IMPL=megatron``. TE's spec and MoE experts keep megatron's activation."""
    from rlhf.compat.megatron import swiglu_choice

    return swiglu_choice() == "swiglu" and not use_te and not spec.num_experts


def transformer_config(spec: ModelSpec, tp: int, pp: int, *, params_dtype: torch.dtype = torch.float32,
                       bf16: bool = False, init_weights: bool = False, recompute: bool = False, ep: int = 1,
                       aux_loss_coef: float = 0.0, use_te: bool = False, routing_replay: bool = False,
                       expert_bias_update_rate: float = 0.0):
    """The megatron ``TransformerConfig`` equivalent to an HF config (MoE: ``moe_config``; the families of
    ``rlhf.models.families``: their own fields, and ``MLATransformerConfig`` for multi-latent attention)."""
    from rlhf.models import families

    kwargs = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps, gated_linear_unit=True,
        qk_layernorm=spec.qk_norm,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=spec.qkv_bias, hidden_dropout=0.0,
        attention_dropout=spec.attention_dropout, init_method_std=spec.initializer_range,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=params_dtype,
        pipeline_dtype=params_dtype, bf16=bf16, use_cpu_initialization=True, perform_initialization=init_weights,
        bias_activation_fusion=fused_swiglu(spec, use_te), masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False,
        sequence_parallel=sequence_parallel(spec, tp),
        cuda_graph_scope=[])  # megatron's default "full" warns that it is deprecated; [] is what it becomes
    if spec.sliding_window is not None:
        # HF: query i sees keys j with i - j < W; megatron's window (left, right) allows i - j <= left.
        kwargs["window_size"] = (spec.sliding_window - 1, 0)
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    factor = rope.attention_factor(spec.rope_scaling)
    if factor != 1.0 and spec.mla is None:  # YaRN scales cos and sin, i.e. q and k: the scores by factor**2
        kwargs["softmax_scale"] = factor * factor / math.sqrt(spec.head_dim)  # (rlhf.models.rope; MLA: its own)
    kwargs.update(moe_config(spec, tp, ep, aux_loss_coef, grouped_gemm=use_te, routing_replay=routing_replay))
    if spec.mrope_section is not None:  # vision-language models: megatron's MultimodalRotaryEmbedding
        kwargs["mrope_section"] = list(spec.mrope_section)
    kwargs.update(families.family_config(spec, expert_bias_update_rate))
    return families.config_class(spec)(**kwargs)


class ScoreHead(torch.nn.Module):
    """HF ``score`` head: ``Linear(hidden, 1, bias=False)``, replicated over TP ranks.

    It stands in for GPTModel's ``output_layer`` (same call signature) so that megatron's pipeline and checkpoint
    code treat it like any last-stage layer.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, std: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        torch.nn.init.normal_(self.weight, std=std)

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        return F.linear(hidden_states, self.weight if weight is None else weight), None  # (S, B, 1)


def _model_head(self, hidden, output, seq: int | None = None):
    """hidden (S, B, H); under context parallelism this rank's tokens only (S_local), and so is what the
    head returns (rlhf.models.context_parallel); under sequence parallelism this rank's S_pad / TP positions,
    and the head returns the first ``seq`` of the whole sequence."""
    if not self.post_process:
        return hidden
    if self.config.sequence_parallel and (output == "hidden" or self.value_head):
        from rlhf.models.sequence_parallel import gather_sequence

        hidden = gather_sequence(hidden)  # (S_pad, B, H); the LM head's own linear gathers its input
    if output == "hidden":
        return hidden[:seq].transpose(0, 1)  # (B, S, H)
    if self.value_head:
        values, _ = self.output_layer(hidden[:seq])
        return values.squeeze(-1).transpose(0, 1).contiguous()  # (B, S)
    weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
    logits, _ = self.output_layer(hidden, weight=weight)
    # Mask in megatron's (S, B, V) layout, then transpose: every TP rank returns the same memory layout.
    return mask_padded_vocab(logits[:seq], self.true_vocab_size).transpose(0, 1)  # (B, S, V_local)


def _gpt_model_class():
    from megatron.core.models.gpt import GPTModel

    class LlamaGPT(GPTModel):
        """GPTModel with padded-vocab masking, a hidden-state output and an optional scalar head."""

        def __init__(self, spec: ModelSpec, config, padded_vocab: int, pre_process: bool, post_process: bool,
                     value_head: bool, use_te: bool | None = None, position_embedding_type: str = "rope"):
            super().__init__(config=config, vocab_size=padded_vocab,
                             transformer_layer_spec=layer_spec(config, spec, use_te),
                             max_sequence_length=spec.max_position_embeddings, pre_process=pre_process,
                             post_process=post_process, parallel_output=True,
                             share_embeddings_and_output_weights=spec.tie_word_embeddings and not value_head,
                             position_embedding_type=position_embedding_type, rotary_base=spec.rope_theta,
                             rotary_percent=spec.rotary_percent)
            if spec.rope_scaling is not None and spec.mla is None:  # megatron's own inv_freq is plain RoPE
                self.rotary_pos_emb.inv_freq = rope.inv_freq(int(spec.head_dim * spec.rotary_percent),  # (rope.py;
                                                             spec.rope_theta, spec.rope_scaling)  # MLA: its own)
            self.spec = spec
            self.value_head = value_head
            self.true_vocab_size = spec.vocab_size
            if value_head and post_process:
                # The LM head is never used by a critic/reward model: drop it (and its vocab x hidden memory).
                del self.output_layer
                self.output_layer = ScoreHead(spec.hidden_size, config.params_dtype, spec.initializer_range)

        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None, *, packed_seq_params=None,
                    output: Literal["head", "hidden"] = "head", inference_context=None) -> torch.Tensor:
            """input_ids (B, S). Returns, on the last stage, with ``output="head"`` the head's output: logits
            (B, S, V_local) for a causal LM with padded vocab columns at ``PAD_LOGIT``, values (B, S) for a value
            head; with ``output="hidden"`` the final hidden states (B, S, H).
            On other stages: the hidden states (S, B, H) for the next stage. ``inference_context``: the megatron
            generator's decode cache (``rlhf.rollout.decode_cache``): ``input_ids`` are the tokens after the ones
            it holds, at positions from its ``sequence_len_offset``."""
            if position_ids is None and input_ids is not None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            from rlhf.models import context_parallel as cpm

            layout = cpm.layout_for_batch(input_ids, packed_seq_params)
            if layout is not None:
                return self._head(cpm.decoder_forward(self, input_ids, attention_mask, layout), output)
            seq = input_ids.shape[1]
            if self.config.sequence_parallel:  # each TP rank holds S / TP positions (rlhf.models.sequence_parallel)
                from rlhf.models.sequence_parallel import pad_inputs

                input_ids, position_ids, packed_seq_params = pad_inputs(
                    input_ids, position_ids, packed_seq_params, self.config.tensor_model_parallel_size)
            pre = self._preprocess(input_ids=input_ids, position_ids=position_ids,
                                   packed_seq_params=packed_seq_params, inference_context=inference_context)
            decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset = pre[:5]
            hidden = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                  rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                                  rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
                                  sequence_len_offset=sequence_len_offset, inference_context=inference_context)
            return self._head(hidden, output, seq)

        _head = _model_head

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            return without_extra_state(super().sharded_state_dict(prefix, sharded_offsets, metadata))

        def output_weight(self) -> torch.Tensor:
            """The (vocab-parallel) LM head weight [V_local, H], for the fused linear log-prob kernel."""
            if self.share_embeddings_and_output_weights:
                return self.shared_embedding_or_output_weight()
            return self.output_layer.weight

    return LlamaGPT


def mask_padded_vocab(logits: torch.Tensor, true_vocab: int) -> torch.Tensor:
    """Set the logits of padded vocab columns on this TP rank to ``PAD_LOGIT``. logits (..., V_local)."""
    from megatron.core import parallel_state as ps

    v_local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * v_local
    n_valid = max(0, min(v_local, true_vocab - start))
    if n_valid == v_local:
        return logits
    keep = torch.arange(v_local, device=logits.device) < n_valid
    return logits.masked_fill(~keep, PAD_LOGIT)


def build_model(spec: ModelSpec, *, tp: int, pp: int, pp_rank: int, value_head: bool | None = None,
                params_dtype: torch.dtype = torch.float32, bf16: bool = False, init_weights: bool = False,
                recompute: bool = False, padded_vocab: int | None = None, use_te: bool | None = None, ep: int = 1,
                aux_loss_coef: float = 0.0, routing_replay: bool = False, expert_bias_update_rate: float = 0.0):
    """One pipeline stage of the model for the current rank (megatron's parallel state must be initialised).

    ``init_weights=False`` leaves parameters uninitialised (they are about to be loaded from a checkpoint);
    True gives megatron's CPU initialisation, identical for every TP size. ``routing_replay``: an MoE model's
    routers get megatron's ``RouterReplay`` (``rlhf.models.routing_replay``).
    """
    value_head = spec.is_seq_cls if value_head is None else value_head
    padded_vocab = padded_vocab or padded_vocab_size(spec.vocab_size)
    check_parallel_fit(spec, tp, pp, padded_vocab, ep)
    use_te = te_available() if use_te is None else use_te
    from rlhf.models.context_parallel import cp_group_of_job

    if use_te and cp_group_of_job() is not None:
        raise ValueError("context parallelism runs megatron's local layers (TE's CP attention is not wired yet)")
    from rlhf.models.families import check_family_layout

    check_family_layout(spec, 1 if cp_group_of_job() is None else cp_group_of_job().size())
    if spec.linear_attention is not None:
        from rlhf.models.hybrid import check_hybrid_layout

        check_hybrid_layout(spec, pp=pp, ep=ep, cp=1 if cp_group_of_job() is None else cp_group_of_job().size(),
                            value_head=value_head, use_te=use_te)
    if cp_group_of_job() is not None and sequence_parallel(spec, tp):
        raise ValueError(f"context parallelism with an MoE model ({spec.model_type}) at --tp {tp}: sequence "
                         "parallelism and the context-parallel split are not combined yet; use --tp 1 with CP")
    config = transformer_config(spec, tp, pp, params_dtype=params_dtype, bf16=bf16, init_weights=init_weights,
                                recompute=recompute, ep=ep, aux_loss_coef=aux_loss_coef, use_te=use_te,
                                expert_bias_update_rate=expert_bias_update_rate,
                                routing_replay=routing_replay)
    if spec.num_experts:
        from rlhf.compat.megatron import expert_bias_only_when_enabled, moe_without_te

        moe_without_te()
        expert_bias_only_when_enabled()
        if sequence_parallel(spec, tp):
            from rlhf.compat.megatron_moe import uneven_gather_on_cpu

            uneven_gather_on_cpu()
    if spec.mla is not None:
        from rlhf.compat.megatron import mla_without_te

        mla_without_te()
    cls = _gpt_model_class()
    if spec.vision is not None:
        from rlhf.models.vlm import check_vlm_layout, vlm_model_class

        group = cp_group_of_job()
        check_vlm_layout(spec, tp=tp, pp=pp, cp=1 if group is None else group.size())
        if value_head:
            raise ValueError(f"a value head on {spec.model_type} (a critic or reward model) is not supported; use "
                             "a group estimator (--advantage_estimator group_norm, rloo, reinforce_baseline)")
        cls = vlm_model_class(cls)
    model = cls(spec, config, padded_vocab, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                value_head=value_head, use_te=use_te)
    from rlhf.compat.megatron import (ensure_tp_attributes, recompute_in_forward_context, rotary_half_rope,
                                      swiglu_function)

    ensure_tp_attributes(model, te_available())
    from rlhf.models.families import mark_tp_params

    mark_tp_params(model)
    if spec.linear_bias and spec.num_experts:
        from rlhf.compat.megatron_moe import expert_fc2_bias

        expert_fc2_bias(model)
    recompute_in_forward_context()
    rotary_half_rope()
    swiglu_function()
    return model


