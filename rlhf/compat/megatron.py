"""Workarounds of megatron-core 0.16.1 internals, and one of torch 2.13's (the process-group registry); both are
checked against the installed releases at import."""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from rlhf.compat import check_versions

check_versions(("megatron-core", "torch"))


def inner_optimizers(optimizer) -> list:
    """The optimizers inside a megatron ``ChainedOptimizer`` (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


# megatron-core 0.16.1: the memory-efficient checkpoint gather runs over `data_parallel_group_gloo`.
def host_groups_for_distributed_optimizer(optimizer) -> None:
    """Give each ``DistributedOptimizer`` its DP group as ``data_parallel_group_gloo``.

    megatron gathers the optimizer state for a checkpoint (``distrib_optim_fully_reshardable_mem_efficient``)
    as host tensors over ``data_parallel_group_gloo``, a separate gloo copy of the DP group that
    ``use_gloo_process_groups=False`` leaves as None. Our groups already carry gloo for host tensors (CPU: gloo;
    CUDA: ``cpu:gloo,cuda:nccl``), so the DP group itself serves."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in inner_optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer) and getattr(opt, "data_parallel_group_gloo", None) is None:
            opt.data_parallel_group_gloo = opt.data_parallel_group


# megatron-core 0.16.1: optimizer state exists only after the first step; a load needs tensors to load into.
def init_optimizer_state(optimizer) -> None:
    """Create Adam's state with dummy values (megatron's private initialisers), before a checkpoint load."""
    for opt in inner_optimizers(optimizer):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            opt._init_optimizer_states_with_dummy_values()
        elif hasattr(opt, "init_state_fn") and opt.init_state_fn is not None:
            opt.init_state_fn(opt.optimizer, getattr(opt, "config", None))


# megatron-core 0.16.1: a loaded optimizer may share one ``step`` tensor between all parameters.
def unshare_adam_steps(optimizer) -> None:
    """After a load, megatron may give every parameter the *same* ``step`` tensor; torch's Adam then bumps it
    once per parameter per step and bias correction goes wrong silently. One tensor each."""
    for opt in inner_optimizers(optimizer):
        torch_opt = getattr(opt, "optimizer", None)
        if torch_opt is None:
            continue
        for state in torch_opt.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


# megatron-core 0.16.1: ``optimizer.step()`` has no hook between the grad norm and the update; its parts are used.
def step_if_finite(opt, loss: float, loss_key: str) -> tuple[bool, float, str]:
    """megatron's optimizer step (prepare grads, global grad norm, clip, step), with the norm measured first:
    a non-finite loss or grad norm leaves parameters and optimizer states untouched.
    Returns (stepped, grad norm, what was non-finite)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    found_inf = opt.prepare_grads()  # fp16 loss scaling only; copies the grads to the fp32 main params
    grad_norm = float(opt.get_grad_norm())  # over every rank that holds a part of the model: the same everywhere
    bad = [f"{k}={v}" for k, v in ((loss_key, loss), ("grad_norm", grad_norm)) if not math.isfinite(v)]
    if found_inf or bad:
        return False, grad_norm, ", ".join(bad) or "inf/nan gradients (loss scaler)"
    for inner in inner_optimizers(opt):  # as megatron's ChainedOptimizer.step clips: one global norm
        params = inner.get_parameters()
        if not params or inner.config.clip_grad <= 0.0 or getattr(inner, "is_stub_optimizer", False):
            continue
        if inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:  # grads in `decoupled_grad`
            clip_grad_by_total_norm_fp32(params, inner.config.clip_grad, grad_norm, True)
        else:
            clip_grads_by_total_norm(params, inner.config.clip_grad, grad_norm)
    if not opt.step_with_ready_grads():
        return False, grad_norm, "optimizer step failed"
    return True, grad_norm, ""


def clip_grads_by_total_norm(params, max_norm: float, total_norm: float) -> None:
    """megatron's ``clip_grad_by_total_norm_fp32`` (same coefficient, same single multiply per element, so the
    same bits) as one ``_foreach_mul_``: without apex, megatron's fallback scales tensor by tensor through a
    temporary (``dst.copy_(src * scale)``), 4x slower on CPU (0.08 against 0.02 s for 135M fp32 gradients)."""
    from megatron.core.utils import to_local_if_dtensor

    grads = [to_local_if_dtensor(p.grad).detach() for p in params if p.grad is not None]
    coeff = max_norm / (total_norm + 1.0e-6)
    if grads and coeff < 1.0:
        torch._foreach_mul_(grads, coeff)


# megatron-core 0.16.1: without TE or apex, the optimizer is torch's Adam/AdamW with torch's defaults.
def fuse_cpu_adam(optimizer) -> int:
    """Switch each inner torch Adam/AdamW whose parameters all live on the CPU to torch's fused kernel, before it
    has any state. torch's default there is the per-tensor loop, about a dozen passes over memory per tensor;
    the fused kernel makes one (0.064 against 0.39 s per step for 135M fp32 parameters, one thread). The update
    is the same up to rounding. CUDA is left as megatron sets it up (TE's or apex's FusedAdam where installed).
    Returns how many optimizers were switched."""
    switched = 0
    for inner in inner_optimizers(optimizer):
        adam = getattr(inner, "optimizer", None)
        if type(adam) not in (torch.optim.Adam, torch.optim.AdamW) or adam.state:
            continue
        params = [p for g in adam.param_groups for p in g["params"]]
        if not params or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
            continue
        for group in (*adam.param_groups, adam.defaults):
            group["foreach"], group["fused"] = False, True
        switched += 1
    return switched


# megatron-core 0.16.1: DistributedOptimizer loading with torch Adam raises KeyError: 'step'.
def fix_torch_adam_step_load() -> None:
    """Work around a megatron-core 0.16 bug in loading the distributed optimizer's 'fully_reshardable' state.

    With torch's Adam (no apex/TE), ``DistributedOptimizer.load_state_dict`` first gives every parameter's
    state a ``step`` (from the param groups), then ``_set_main_param_and_optimizer_states`` copies *every*
    destination key from a source that deliberately has no ``step``: ``KeyError: 'step'``. Here the copy skips
    ``step`` and leaves megatron's value in place (which ``unshare_adam_steps`` then unshares). Idempotent.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(orig, "_rlhf_step_fix", False):
        return

    def set_states(self, model_param, tensors):
        if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return orig(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            return orig(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    set_states._rlhf_step_fix = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


# megatron-core 0.16.1: TP attributes are set only by its weight initialiser (missing when weights are loaded).
def ensure_tp_attributes(model: torch.nn.Module, with_te: bool) -> None:
    """megatron-core 0.16 sets ``tensor_model_parallel``/``partition_dim`` inside its CPU weight initialiser, so
    with ``perform_initialization=False`` (weights about to be loaded) they are missing, and grad-norm, the
    distributed optimizer and our TP gathers would treat sharded weights as replicated. Set them here."""
    from megatron.core import tensor_parallel as mtp

    def mark(param, dim):
        if param is not None and not hasattr(param, "tensor_model_parallel"):
            mtp.set_tensor_model_parallel_attributes(param, True, dim, 1)

    column, row = (mtp.ColumnParallelLinear,), (mtp.RowParallelLinear,)
    grouped: dict = {}
    if with_te:  # megatron's TE wrappers (their fused norm weights stay replicated)
        from megatron.core.extensions import transformer_engine as mte

        column += (mte.TEColumnParallelLinear, mte.TELayerNormColumnParallelLinear)
        row += (mte.TERowParallelLinear,)
        grouped = {getattr(mte, "TEColumnParallelGroupedLinear", None): 0,  # MoE experts: weight0 .. weightN-1
                   getattr(mte, "TERowParallelGroupedLinear", None): 1}
        grouped.pop(None, None)
    for module in model.modules():
        if isinstance(module, column):
            mark(module.weight, 0)
            mark(getattr(module, "bias", None), 0)
        elif isinstance(module, row):
            mark(module.weight, 1)
        elif grouped and isinstance(module, tuple(grouped)):
            dim = next(d for cls, d in grouped.items() if isinstance(module, cls))
            for name, param in module.named_parameters(recurse=False):
                if name.startswith("weight"):
                    mark(param, dim)
        elif isinstance(module, mtp.VocabParallelEmbedding):
            mark(module.weight, 0)


# torch 2.13 / megatron-core 0.16.1: no public list of process groups; megatron forgets its groups undestroyed.
def live_process_groups() -> list:
    """Every process group of this process but the default one (torch's private registry)."""
    return [g for g in dist.distributed_c10d._world.pg_map if g is not dist.group.WORLD]


# megatron-core 0.16.1: the schedule reads ``variable_seq_lengths`` from the model config on every call.
def fixed_seq_lengths(model: torch.nn.Module) -> None:
    """Our micro-batches of one schedule call share one shape (padded, or packed to one length with PP), so
    megatron need not exchange shapes between stages; set on the config megatron's schedule reads."""
    model.config.variable_seq_lengths = False


# megatron-core 0.16.1: full recompute (``tensor_parallel.checkpoint``) runs a layer's forward again inside the
# backward, outside the context the forward ran in.
def recompute_in_forward_context() -> None:
    """Each checkpointed call runs in a copy of its caller's context (``contextvars``) and its recompute in that
    same copy: the context-parallel split that ``rlhf.models.context_parallel`` keeps in a ContextVar is there
    when the backward recomputes the attention. Without it the recompute attended each rank's own tokens only and
    CP 2 with --gradient_checkpointing gave gradients 2.2x (Llama) to 3.7x (Mixtral) off CP 1's."""
    import contextvars
    import functools

    from megatron.core import tensor_parallel

    if hasattr(tensor_parallel.checkpoint, "rlhf_original"):
        return
    original = tensor_parallel.checkpoint

    def checkpoint(function, distribute_saved_activations, *args):
        return original(functools.partial(contextvars.copy_context().run, function), distribute_saved_activations,
                        *args)
    checkpoint.rlhf_original = original  # the tests' negative control restores it
    tensor_parallel.checkpoint = checkpoint


# megatron-core 0.16.1: its unfused RoPE (no TE) is six autograd ops per call (chunk, neg, cat, two mul, add).
def rotary_half_rope() -> None:
    """Route megatron's unfused ``_apply_rotary_pos_emb_bshd`` (which its THD path calls too) through
    ``kernels.rope.rotary_half``, one autograd function, for the plain (non-interleaved, non-MLA) layout;
    everything else stays megatron's. ``RLHF_ROPE_IMPL=megatron`` keeps megatron's own."""
    import os

    from megatron.core.models.common.embeddings import rope_utils

    choice = os.environ.get("RLHF_ROPE_IMPL", "rotary_half")
    if choice not in ("rotary_half", "megatron"):
        raise ValueError(f"RLHF_ROPE_IMPL must be 'rotary_half' or 'megatron', got {choice!r}")
    orig = getattr(rope_utils._apply_rotary_pos_emb_bshd, "__wrapped__", rope_utils._apply_rotary_pos_emb_bshd)
    if choice == "megatron":
        rope_utils._apply_rotary_pos_emb_bshd = orig
        rope_utils._apply_rotary_pos_emb_thd = getattr(rope_utils._apply_rotary_pos_emb_thd, "__wrapped__",
                                                       rope_utils._apply_rotary_pos_emb_thd)
        return
    from rlhf.kernels.rope import rotary_half
    from rlhf.models import fused

    def bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        if rotary_interleaved or multi_latent_attention:
            return orig(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        rot = freqs.shape[-1]
        if fused.active_for(t, "rope") and t.dim() == 4 and rot == t.shape[-1] and freqs.shape[0] == t.shape[0] \
                and freqs[0].numel() == rot:  # --use_liger_kernel on CUDA (rlhf.models.fused)
            from rlhf.kernels import rope_triton

            return rope_triton.rope_triton(t, freqs, mscale)
        cos, sin = ((f(freqs) * mscale).to(t.dtype) for f in (torch.cos, torch.sin))  # as megatron computes them
        if rot == t.shape[-1]:
            return rotary_half(t, cos, sin)
        return torch.cat((rotary_half(t[..., :rot], cos, sin), t[..., rot:]), dim=-1)

    bshd.__wrapped__ = orig
    rope_utils._apply_rotary_pos_emb_bshd = bshd
    orig_thd = getattr(rope_utils._apply_rotary_pos_emb_thd, "__wrapped__", rope_utils._apply_rotary_pos_emb_thd)
    cache: list = [None, None, None]  # (cu_seqlens, freqs, their packed angles): the layers of one micro-batch

    def thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
            cp_group=None):
        """megatron 0.16.1's THD RoPE at CP 1 without its host sync (``.tolist()``) and per-sequence slicing on
        every call: the same angles (each sequence's positions from 0, or, where ``freqs`` holds exactly one row
        per packed token, those rows: megatron's two cases), gathered once per micro-batch."""
        if not fused.active_for(t, "rope") or cp_group is None or cp_group.size() != 1 or rotary_interleaved \
                or multi_latent_attention:
            return orig_thd(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        if cache[0] is not cu_seqlens or cache[1] is not freqs:
            from rlhf.kernels.packing import position_ids_from_cu_seqlens

            packed = freqs[:t.shape[0]] if freqs.size(0) == t.shape[0] else \
                freqs[position_ids_from_cu_seqlens(cu_seqlens, t.shape[0])]
            cache[:] = [cu_seqlens, freqs, packed]
        return bshd(t.unsqueeze(1), cache[2], mscale=mscale).squeeze(1)

    thd.__wrapped__ = orig_thd
    rope_utils._apply_rotary_pos_emb_thd = thd


SWIGLU_ENV = "RLHF_SWIGLU_IMPL"
"""``swiglu`` (the default): dense MLPs of the local spec run ``kernels.swiglu``; ``megatron``: megatron's unfused
activation."""


def swiglu_choice() -> str:
    choice = os.environ.get(SWIGLU_ENV, "swiglu")
    if choice not in ("swiglu", "megatron"):
        raise ValueError(f"{SWIGLU_ENV} must be 'swiglu' or 'megatron', got {choice!r}")
    return choice


# megatron-core 0.16.1: with bias_activation_fusion, MLP.forward calls mlp.bias_swiglu_impl, whose kernels are
# megatron's jit_fuser functions (torch.compile, which on CPU needs a C++ toolchain and a compile per shape).
def swiglu_function() -> None:
    """Route ``megatron.core.transformer.mlp.bias_swiglu_impl`` through ``kernels.swiglu`` (plain torch ops, any
    device: the same bits as megatron's unfused activation, two passes fewer). ``transformer_config`` turns
    ``bias_activation_fusion`` on for the dense MLPs of the local spec only (``RLHF_SWIGLU_IMPL=megatron`` leaves it
    off); FP8 input stores and activation offload go to megatron's own."""
    from megatron.core.transformer import mlp

    from rlhf.kernels.swiglu import swiglu

    orig = getattr(mlp.bias_swiglu_impl, "__wrapped__", mlp.bias_swiglu_impl)

    from rlhf.models import fused

    def impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
        if fp8_input_store or cpu_offload_input:
            return orig(input, bias, fp8_input_store, cpu_offload_input)
        y = input if bias is None else input + bias
        if fused.active_for(y, "swiglu"):  # --use_liger_kernel on CUDA (rlhf.models.fused): a Triton kernel each way
            from rlhf.kernels.swiglu_triton import swiglu_triton

            return swiglu_triton(y)
        return swiglu(y)

    impl.__wrapped__ = orig
    mlp.bias_swiglu_impl = impl


# megatron-core 0.16.1: TopKRouter.routing calls self._apply_expert_bias on every MoE forward, a jit_fuser
# (torch.compile) method whose body does nothing unless moe_router_enable_expert_bias is on.
def expert_bias_only_when_enabled() -> None:
    """Skip ``TopKRouter._apply_expert_bias`` where the router has no expert bias, as its own body does (``if
    self.enable_expert_bias and torch.is_grad_enabled(): ...``), without calling the compiled method: its first call
    traced it with dynamo and imported inductor in every MoE process, 2-9 s of CPU a process for nothing (measured on
    a 2-core AMD EPYC). Routers with expert bias call megatron's compiled method as before."""
    from megatron.core.transformer.moe import router

    current = router.TopKRouter._apply_expert_bias
    if getattr(current, "__rlhf_skips_without_bias__", False):
        return

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if not self.enable_expert_bias:
            return None
        return current(self, routing_map, padding_mask)

    _apply_expert_bias.__rlhf_skips_without_bias__ = True
    _apply_expert_bias.__wrapped__ = current
    router.TopKRouter._apply_expert_bias = _apply_expert_bias


# megatron-core 0.16.1: moe_utils defines te_general_gemm only when TE imports, but its router reads it always.
def moe_without_te() -> None:
    """Without Transformer Engine the MoE router's linear raises NameError (``te_general_gemm``); megatron's own
    check ``te_general_gemm is not None`` then takes its torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# megatron-core 0.16.1: without TE, megatron.core.extensions.transformer_engine exports MagicMock placeholders, so
# multi_latent_attention sets HAVE_TE = True and MLA's __init__ fails on isinstance(linear_proj, TELinear).
def mla_without_te() -> None:
    """Tell megatron's MLA module that TE is absent when it is (its own ``except ImportError`` branch): its only TE
    use is an FP8/FP4 input-saving hint on TE's linears, which the local layers do not have."""
    from megatron.core.transformer import multi_latent_attention as mla

    if mla.HAVE_TE and not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False


# megatron-core 0.16.1: each torch_dist save hands its write results over a multiprocessing.Manager queue.
def local_save_results_queue() -> None:
    """``filesystem_async._get_write_results_queue`` starts a *spawned* ``multiprocessing.Manager`` at the first
    save: a whole interpreter per rank that re-imports the launch script (about 0.2 GB, measured at 0.17-0.21 GB
    PSS) and lives until the job ends. Only an asynchronous save, whose writer runs in another process, needs a
    queue between processes; ours are synchronous (``dist_checkpointing.save`` runs the write in this process, its
    forked writers report through their own queue), so a process-local queue serves. Idempotent."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    if getattr(fsa._get_write_results_queue, "_rlhf_local", False):
        return
    results: queue.Queue = queue.Queue()

    def _get_write_results_queue():
        return results

    _get_write_results_queue._rlhf_local = True
    fsa._get_write_results_queue = _get_write_results_queue
