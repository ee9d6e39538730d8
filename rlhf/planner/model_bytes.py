"""Pre-flight memory planner for the colocated PPO schedule: bytes per role and phase on one device.

Pure functions: model specs and flags in, numbers out (no process group, no device, no I/O). What is resident
in each phase comes from ``rlhf.runtime.offload.plan_residency``, the same function the trainer's ``MemoryScheduler``
applies, so the planner cannot drift from the schedule. ``tools/plan_memory.py`` is the command line.

Per rank, at the pipeline stage that needs most:

* parameters: bf16 (2 B) with ``--bf16``, else fp32; the exact per-rank tensor list of the megatron model (TP
  shards, replicated norms, vocab padded to 128, embedding on the first stage, LM or score head on the last),
  laid out in megatron DDP's buffer (64-element aligned, padded to lcm(DP, 128) under the distributed optimizer).
* gradients: megatron DDP's grad buffer, fp32 (``grad_reduce_in_fp32``) whatever the parameter dtype.
* optimizer: Adam's two fp32 moments, plus an fp32 master copy when the parameters are bf16; all of it sharded
  over DP with ``--zero_stage >= 1`` (megatron's distributed optimizer).
* activations: saved-for-backward bytes per token per layer of the layer implementation (``te``: transformer-
  engine with flash attention, the GPU path; ``local``: megatron's torch layers with unfused attention, the CPU
  path and the GPU path without transformer-engine), times the tokens of a micro-batch and the micro-batches a
  1F1B pipeline stage holds; only each layer's input with ``--gradient_checkpointing`` (plus one layer being
  recomputed). Plus a backward working set and the head: the fused log-prob kernel never holds
  ``[tokens, vocab]`` fp32 logits, only one chunk. Forward-only phases hold a working set, nothing saved. A hybrid's
  Gated DeltaNet layers count their own (``deltanet_kernel``: fla's saved tensors on CUDA, the torch twin's).
* vLLM: weights at ``--vllm_tensor_parallel_size``; its memory pool is ``--vllm_gpu_memory_utilization`` of the
  device (weights + profiled activations + KV cache, KV = 2 x layers x KV heads x head_dim x bytes per token).
  Sleep mode releases all of it outside rollout; weight sync wakes the weights only.
* ``--reserved_gib`` per device for what no tensor accounts for: CUDA context, NCCL buffers, fragmentation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from rlhf.models.spec import ModelSpec, padded_vocab_size

GiB = 2 ** 30
LAYER_IMPLS = ("te", "local")
SCHEDULE = ("rollout", "weight_sync", "make_experience", "critic_update", "actor_update")
# Chunk of fp32 logits the fused log-prob kernel holds (rlhf/kernels/logprobs.py: FUSED_CUDA/CPU_CHUNK_ELEMS).
LOGIT_CHUNK_ELEMS = {"te": 1 << 25, "local": 1 << 23}
LOGIT_CHUNK_MIN_ROWS = 256


@dataclass(frozen=True)
class PlanConfig:
    """The flags that change device memory, with the PPO trainer's names and defaults."""

    actor: ModelSpec
    reward: ModelSpec
    critic: ModelSpec | None = None
    """The critic's architecture (``--critic_pretrain``, default the reward model); None: no critic (GRPO...)."""
    with_ref: bool = True
    """A reference model exists (``--init_kl_coef > 0``)."""
    teacher: ModelSpec | None = None
    """The on-policy distillation teacher's architecture (``--teacher_pretrain``; frozen, forward only)."""
    teacher_offload: bool = False
    """(--teacher_offload) the teacher's params on host outside make_experience."""
    tp: int = 1
    pp: int = 1
    ep: int = 1
    """Expert parallelism of MoE roles (carved out of DP; dense roles ignore it)."""
    cp: int = 1
    """Context parallelism (carved out of DP): each sequence split over ``cp`` ranks (rlhf.models.context_parallel;
    megatron's local layers only)."""
    nnodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0
    host_memory_gib: float = 2048.0
    """Host RAM per node: colocation keeps every offloaded role's state in (pinned) host buffers."""
    micro_train_batch_size: int = 8
    micro_rollout_batch_size: int = 8
    train_batch_size: int = 128
    rollout_batch_size: int = 512
    n_samples_per_prompt: int = 1
    prompt_max_len: int = 1024
    generate_max_len: int = 1024
    bf16: bool = False
    gradient_checkpointing: bool = False
    zero_stage: int = 0
    colocate_all: bool = True
    ref_reward_offload: bool = False
    adam_offload: bool = False
    vllm_gpu_memory_utilization: float = 0.95
    vllm_tensor_parallel_size: int = 1
    vllm_max_num_seqs: int = 256
    """vLLM's default cap on concurrent sequences per engine (the trainer does not change it)."""
    vllm_max_num_batched_tokens: int = 8192
    """vLLM's default token budget per scheduler step, which its start-up profile run uses."""
    weight_sync_bucket_mb: int = 512
    layer_impl: str = "te"
    deltanet_kernel: str = "fla"
    """The hybrids' delta rule: ``fla`` (CUDA) or ``torch`` (the twin a CPU runs): what its layers save differs."""
    reserved_gib: float = 3.0

    def __post_init__(self) -> None:
        world = self.nnodes * self.gpus_per_node
        if self.layer_impl not in LAYER_IMPLS:
            raise ValueError(f"--layer_impl must be one of {LAYER_IMPLS}, got {self.layer_impl!r}")
        if self.deltanet_kernel not in ("fla", "torch"):
            raise ValueError(f"deltanet_kernel must be fla or torch, got {self.deltanet_kernel!r}")
        if self.cp < 1 or world % (self.tp * self.pp * self.cp):
            raise ValueError(f"--tp {self.tp} x --pp {self.pp}" + (f" x --cp {self.cp}" if self.cp != 1 else "") +
                             f" does not divide the {world} GPUs (--nnodes {self.nnodes} x --gpus_per_node "
                             f"{self.gpus_per_node})")
        if self.cp > 1 and self.layer_impl != "local":
            raise ValueError(f"--cp {self.cp} runs megatron's local layers: use --layer_impl local")
        if world % self.vllm_tensor_parallel_size:
            raise ValueError(f"--vllm_tensor_parallel_size {self.vllm_tensor_parallel_size} does not divide the "
                             f"{world} GPUs")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(f"--vllm_gpu_memory_utilization must be in (0, 1], got "
                             f"{self.vllm_gpu_memory_utilization}")
        for name in ("micro_train_batch_size", "micro_rollout_batch_size", "train_batch_size", "rollout_batch_size",
                     "n_samples_per_prompt", "prompt_max_len", "generate_max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for spec in (self.actor, self.reward) + ((self.critic,) if self.critic else ()):
            if spec.num_attention_heads % self.tp or (spec.num_kv_heads % self.tp and self.tp % spec.num_kv_heads):
                raise ValueError(f"--tp {self.tp} does not divide num_attention_heads={spec.num_attention_heads} "
                                 f"and num_key_value_heads={spec.num_kv_heads} (nor is it a multiple of the latter)")
            if spec.num_layers % self.pp:
                raise ValueError(f"--pp {self.pp} does not divide num_hidden_layers={spec.num_layers}")
            if spec.num_experts and spec.num_experts % self.ep:
                raise ValueError(f"--expert_model_parallel_size {self.ep} does not divide num_experts="
                                 f"{spec.num_experts}")
        if self.ep < 1 or (world // (self.tp * self.pp * self.cp)) % self.ep:
            raise ValueError(f"--expert_model_parallel_size {self.ep} must divide the data-parallel size "
                             f"{world // (self.tp * self.pp * self.cp)}")

    @property
    def world(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def dp_cp(self) -> int:
        """The ranks a gradient is reduced over and ZeRO shards over (megatron's DP x CP group)."""
        return self.dp * self.cp

    @property
    def seq_len(self) -> int:
        return self.prompt_max_len + self.generate_max_len

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def roles(self) -> dict[str, tuple[ModelSpec, bool, bool]]:
        """role -> (spec, value head, trainable), in the trainer's order."""
        out = {"actor": (self.actor, False, True)}
        if self.critic is not None:
            out["critic"] = (self.critic, True, True)
        if self.with_ref:
            out["ref"] = (self.actor, False, False)
        if self.teacher is not None:
            out["teacher"] = (self.teacher, False, False)
        out["reward"] = (self.reward, True, False)
        return out


# ------------------------------------------------------------------------------------------ model state
def mlp_width(spec: ModelSpec) -> int:
    """The MLP intermediate width one token passes through: an MoE token goes through ``top-k`` experts (and the
    shared experts, DeepSeek's and GLM's)."""
    if not spec.num_experts:
        return spec.intermediate_size
    return spec.moe_ffn_hidden_size * spec.moe_topk + spec.shared_expert_size


def stage_param_numels(spec: ModelSpec, tp: int, pp: int, stage: int, value_head: bool,
                       ep: int = 1) -> list[int]:
    """Elements of each parameter tensor one TP rank of pipeline ``stage`` holds, in megatron's module order
    (MoE: the router, then this EP rank's ``num_experts / ep`` experts, each TP-sharded like a dense MLP)."""
    h, d = spec.hidden_size, spec.head_dim
    qkv = (spec.num_attention_heads + 2 * spec.num_kv_heads) * d // tp
    vocab = padded_vocab_size(spec.vocab_size) // tp
    out: list[int] = []
    if stage == 0:
        out.append(vocab * h)  # word embeddings (vocab-parallel)
    for i in range(spec.num_layers // pp):
        if spec.mla is not None or spec.router is not None:  # deepseek_v3, glm4_moe, gpt_oss
            from rlhf.models.spec_families import layer_numels

            out += layer_numels(spec, tp, ep, stage * (spec.num_layers // pp) + i)
            continue
        if spec.linear_attention is not None:  # qwen3_next, qwen3_5_text
            from rlhf.models.hybrid import layer_numels as hybrid_numels

            out += hybrid_numels(spec, tp, ep, stage * (spec.num_layers // pp) + i)
            continue
        out += [h, qkv * h] + ([qkv] if spec.qkv_bias else []) + [spec.num_attention_heads * d // tp * h]
        out += [d, d] if spec.qk_norm else []  # qwen3's q/k norms, replicated over TP
        if spec.num_experts:
            f = spec.moe_ffn_hidden_size // tp
            out += [h, spec.num_experts * h] + [2 * f * h, f * h] * (spec.num_experts // ep)
        else:
            out += [h, 2 * spec.intermediate_size // tp * h, spec.intermediate_size // tp * h]
    if stage == pp - 1:
        out.append(h)  # final norm
        if value_head:
            out.append(h)  # score head, replicated over TP
        elif not spec.tie_word_embeddings or pp > 1:
            out.append(vocab * h)  # LM head (with tied embeddings and PP, the last stage keeps its own copy)
    return out


def ddp_buffer_numel(numels: Iterable[int], dp: int, distributed_optimizer: bool) -> int:
    """Elements of megatron DDP's param/grad buffer: one bucket (overlap_grad_reduce is off); under the
    distributed optimizer every parameter starts 64-aligned and the bucket is padded to lcm(DP, 128)."""
    if not distributed_optimizer:
        return sum(numels)
    n = 0
    for k in numels:
        n = -(-n // 64) * 64 + k
    div = math.lcm(dp, 128)
    return -(-n // div) * div


@dataclass(frozen=True)
class RoleState:
    params: int
    grads: int
    optimizer: int


def role_state(spec: ModelSpec, cfg: PlanConfig, stage: int, value_head: bool, trainable: bool) -> RoleState:
    """Bytes of one role's parameters, gradients and optimizer states on one rank of ``stage``."""
    numels = stage_param_numels(spec, cfg.tp, cfg.pp, stage, value_head, cfg.ep if spec.num_experts else 1)
    n = sum(numels)
    e = cfg.dtype_bytes
    if not trainable:
        return RoleState(n * e, 0, 0)
    dist_opt = cfg.zero_stage >= 1
    buf = ddp_buffer_numel(numels, cfg.dp_cp, dist_opt)
    params = (buf if dist_opt else n) * e  # the distributed optimizer re-maps the params into DDP's buffer
    grads = buf * 4
    per_elem = 8 + (4 if cfg.bf16 else 0)  # exp_avg + exp_avg_sq (+ fp32 master params for bf16 params)
    if dist_opt and spec.num_experts and cfg.ep > 1:  # experts are sharded over the expert-DP group (DP / EP)
        experts = spec.num_layers // cfg.pp * spec.num_experts // cfg.ep * 3 * (spec.moe_ffn_hidden_size // cfg.tp) \
            * spec.hidden_size
        return RoleState(params, grads, per_elem * ((n - experts) // cfg.dp + experts // (cfg.dp // cfg.ep)))
    optimizer = per_elem * (n // cfg.dp_cp if dist_opt else n)
    return RoleState(params, grads, optimizer)


# ------------------------------------------------------------------------------------------- activations
def _attention_widths(spec: ModelSpec, tp: int) -> tuple[float, float]:
    """(q, kv) widths per token on one TP rank: GQA's KV heads replicated past TP; MLA's (rlhf.models.spec_families)."""
    if spec.mla is not None:
        from rlhf.models.spec_families import attention_widths

        return attention_widths(spec, tp)
    return spec.num_attention_heads * spec.head_dim / tp, max(spec.num_kv_heads / tp, 1) * spec.head_dim



def _deltanet_layer(spec: ModelSpec, layer: int | None) -> bool:
    return layer is not None and spec.linear_attention is not None and bool(spec.linear_attention["layers"][layer])


def layer_saved_bytes_per_token(spec: ModelSpec, tp: int, seq_len: int, dtype_bytes: int, impl: str,
                                layer: int | None = None, deltanet_kernel: str = "fla") -> float:
    """Bytes one transformer layer saves for backward per token (no sequence parallelism: the h-wide tensors
    are whole on every TP rank). ``layer``: the hybrids' layer (a Gated DeltaNet mixer in place of the attention:
    ``rlhf.models.hybrid.deltanet_saved_bytes_per_token``; the gated attention also keeps its gate, twice q wide).

    te:    norm input + normed output for attention and MLP (TE's fused LayerNormLinear keeps both), the QKV
           projection output (V is a view of it), rotated Q and K, the attention output (flash attention keeps
           no [S, S] scores), fc1 output (2I), SiLU output and gated product (I each); fp32 softmax statistics.
    local: torch RMSNorm keeps an fp32 input and normalised copy plus its output (per norm); the QKV output,
           Q, the GQA-expanded K and V and the attention output; the [S, S] probabilities per head (in the
           parameter dtype: megatron's softmax sees the model before ``Float16Module`` and does not upcast);
           the same MLP tensors.
    """
    h, i = spec.hidden_size, mlp_width(spec) / tp
    q, kv = _attention_widths(spec, tp)
    heads = spec.num_attention_heads / tp
    e = dtype_bytes
    norms = e * 4 * h if impl == "te" else 2 * (2 * 4 * h + e * h)
    if _deltanet_layer(spec, layer):
        from rlhf.models.hybrid import deltanet_saved_bytes_per_token

        return norms + deltanet_saved_bytes_per_token(spec, tp, e, deltanet_kernel) + e * 4 * i + 8
    gate = e * 2 * q if spec.attention_gate else 0
    if impl == "te":
        return norms + e * ((q + 2 * kv) + q + kv + q + 4 * i) + gate + 4 * heads + 8
    return norms + e * ((q + 2 * kv) + 4 * q + 4 * i + heads * seq_len) + gate + 8


def layer_working_bytes_per_token(spec: ModelSpec, tp: int, seq_len: int, dtype_bytes: int, impl: str,
                                  layer: int | None = None, deltanet_kernel: str = "fla") -> float:
    """Bytes alive at the peak of one layer's forward without autograd (also the estimate of one layer's backward
    temporaries): the largest of the attention block (layer input, normed copies, QKV output, rotated Q and K,
    GQA-expanded K and V; with ``local`` the [S, S] scores and probabilities per head), the MLP block (with
    ``local`` five h-wide tensors the layer still references: input, attention output, residual sum, normed
    copies; then fc1 output, SiLU output, gated product) and, with ``local``, an RMSNorm computing in fp32. A hybrid's
    DeltaNet ``layer``: its mixer's (``rlhf.models.hybrid.deltanet_working_bytes_per_token``) in place of the
    attention block."""
    h, i = spec.hidden_size, mlp_width(spec) / tp
    q, kv = _attention_widths(spec, tp)
    heads = spec.num_attention_heads / tp
    e = dtype_bytes
    if _deltanet_layer(spec, layer):
        from rlhf.models.hybrid import deltanet_working_bytes_per_token

        mixer = e * 3 * h + deltanet_working_bytes_per_token(spec, tp, e, deltanet_kernel)
        return max(mixer, e * (5 * h + 4 * i), 3 * 4 * h + 3 * e * h)
    if impl == "te":
        return e * max(2 * h + (q + 2 * kv) + q + kv + q, 4 * h + 4 * i) + 4 * heads
    attn = e * (3 * h + (q + 2 * kv) + q + kv + 2 * q + 2 * heads * seq_len)
    return max(attn, e * (5 * h + 4 * i), 3 * 4 * h + 3 * e * h)


def scores_buffer_bytes(spec: ModelSpec, tp: int, batch: int, seq_len: int, dtype_bytes: int, impl: str) -> int:
    """megatron's unfused attention writes scores into one process-wide buffer [B x heads, S, S] that lives
    for the rest of the job (``local`` only)."""
    if impl != "local":
        return 0
    return int(batch * spec.num_attention_heads / tp * seq_len * seq_len * dtype_bytes)


def head_bytes(spec: ModelSpec, cfg: PlanConfig, tokens: int, response_tokens: int, value_head: bool,
               train: bool) -> float:
    """The last stage's head: final norm, the (B, T, H) response hidden states and one fp32 logits chunk of
    the fused log-prob kernel (x3: logits, exp, gradient) for an LM; values only for a value head."""
    e, h = cfg.dtype_bytes, spec.hidden_size
    norm = (3 if cfg.layer_impl == "local" else 2) * h * e * tokens if train else 2 * h * e * tokens
    if value_head:
        return norm + 4 * tokens
    v_local = padded_vocab_size(spec.vocab_size) / cfg.tp
    rows = min(response_tokens, max(LOGIT_CHUNK_MIN_ROWS, int(LOGIT_CHUNK_ELEMS[cfg.layer_impl] // v_local)))
    return norm + response_tokens * h * e + 3 * rows * v_local * 4


def cp_layer_bytes(spec: ModelSpec, cfg: PlanConfig, batch: int, saved: bool, backward: bool = False) -> float:
    """One layer's bytes on one rank for ``batch`` sequences under context parallelism
    (``rlhf.models.context_parallel.cp_attention``, local layers), S/CP local tokens each.

    saved: the norms and MLP tensors of the local formula; of the attention, Q stacked per KV head and the output
    (q-wide each), the softmax probabilities (fp32, plus a cast in bf16) of a local query's keys, on average
    (2CP+1)S/(4CP) (chunk a of 2CP sees a+1 chunks), and the gathered K and V of the whole sequence.
    working (no autograd): the attention's q- and h-wide tensors, the gathered K and V, and the largest block's
    scores and probabilities (the last chunk's S/(2CP) queries against all S keys; in bf16 also the scores'
    fp32 copy), one block alive at a time; or the MLP block, whichever is larger.
    backward (the working set of one layer's backward, on top of what is saved): the largest block's gradients of
    its probabilities and scores (fp32), the gradients of the local Q and of the gathered K and V; or the MLP
    block. (Measured on CPU: what a CP2 forward saves matches ``saved`` within 4%; the backward frees each
    block's saved probabilities as it goes, so its peak is far below the forward's working set on top of them.)"""
    h, d, i = spec.hidden_size, spec.head_dim, mlp_width(spec) / cfg.tp
    q, kv = spec.num_attention_heads * d / cfg.tp, max(spec.num_kv_heads / cfg.tp, 1) * d
    heads, e, cp, s = spec.num_attention_heads / cfg.tp, cfg.dtype_bytes, cfg.cp, cfg.seq_len
    local = batch * s / cp
    gathered = 2 * kv * batch * s * e
    if saved:
        keys = s * (2 * cp + 1) / (4 * cp)
        probs = heads * keys * (4 + (e if e != 4 else 0))
        norms = 2 * (2 * 4 * h + e * h)
        return (norms + e * (2 * q + 4 * i) + probs + 8) * local + gathered
    if backward:
        block = 2 * batch * heads * (s / (2 * cp)) * s * 4
        return max(block + e * 2 * q * local + gathered, e * (5 * h + 4 * i) * local)
    block = (2 * 4 + (e if e != 4 else 0)) * batch * heads * (s / (2 * cp)) * s
    attn = e * (3 * h + (q + 2 * kv) + 2 * q + kv) * local + gathered + block
    return max(attn, e * (5 * h + 4 * i) * local, (3 * 4 * h + 3 * e * h) * local)


def activation_bytes(spec: ModelSpec, cfg: PlanConfig, stage: int, value_head: bool, train: bool) -> float:
    """Peak activation bytes of one role on one rank of ``stage``: a training step (``--micro_train_batch_size``
    micro-batches, 1F1B in flight) or a forward-only pass (``--micro_rollout_batch_size``).

    The head (last stage) and a layer's working set are never alive at once: the head runs after the last
    layer's forward and before the first layer's backward, so the peak takes the larger of the two on top of
    what is saved."""
    impl, e, s = cfg.layer_impl, cfg.dtype_bytes, cfg.seq_len
    b = cfg.micro_train_batch_size if train else cfg.micro_rollout_batch_size
    tokens, resp = b * s, b * cfg.generate_max_len
    local = tokens / cfg.cp  # a rank's share of the tokens, in the layers and the head
    layers = spec.num_layers // cfg.pp
    # the stage's layers: a hybrid's differ by kind (rlhf.models.hybrid), the others' are alike
    kinds = list(range(stage * layers, (stage + 1) * layers)) if spec.linear_attention is not None else [None] * layers
    kernel = cfg.deltanet_kernel
    if cfg.cp > 1:
        # a training step's peak: a layer's backward on top of everything saved; with recompute the recomputed
        # forward's working set is alive there too
        work = cp_layer_bytes(spec, cfg, b, saved=False, backward=train and not cfg.gradient_checkpointing)
        scores = 0  # megatron's score buffer is not used by the CP attention
    else:
        work = max(layer_working_bytes_per_token(spec, cfg.tp, s, e, impl, k, kernel) for k in kinds) * tokens
        attention = [k for k in kinds if k is None or not spec.linear_attention["layers"][k]]
        scores = scores_buffer_bytes(spec, cfg.tp, b, s, e, impl) if attention else 0
    head = head_bytes(spec, cfg, local, resp / cfg.cp, value_head, train) if stage == cfg.pp - 1 else 0.0
    if not train:
        return scores + max(work, head)
    n_micro = max(1, cfg.train_batch_size // cfg.dp // b)
    in_flight = min(cfg.pp - stage, n_micro)
    if cfg.cp > 1:
        per_layer = [cp_layer_bytes(spec, cfg, b, saved=True)] * layers
    else:
        per_layer = [layer_saved_bytes_per_token(spec, cfg.tp, s, e, impl, k, kernel) * tokens for k in kinds]
    if cfg.gradient_checkpointing:  # layer inputs + one recomputed layer
        saved = layers * spec.hidden_size * e * local * in_flight + max(per_layer)
    else:
        saved = sum(per_layer) * in_flight
    return saved + scores + max(work, head)


# ---------------------------------------------------------------------------------------------------- vLLM
@dataclass(frozen=True)
class VLLMMemory:
    weights: int
    pool: int
    """--vllm_gpu_memory_utilization x device: weights + profiled activations + KV cache."""
    activations: int
    kv_cache: int
    kv_bytes_per_token: int
    kv_tokens: int
    """KV-cache capacity of one engine shard, in tokens."""
    kv_tokens_wanted: int
    """Tokens of all sequences one engine runs at once (its share of the rollout, at most max_num_seqs)."""


def vllm_memory(cfg: PlanConfig) -> VLLMMemory:
    spec, vtp = cfg.actor, cfg.vllm_tensor_parallel_size
    e = cfg.dtype_bytes
    numels = stage_param_numels(spec, vtp, 1, 0, False)
    weights = sum(numels) * e
    h, i = spec.hidden_size, mlp_width(spec) / vtp
    qkv = (spec.num_attention_heads + 2 * spec.num_kv_heads) * spec.head_dim / vtp
    # vLLM's start-up profile: one forward of max_num_batched_tokens tokens, then fp32 logits of max_num_seqs rows.
    acts = int(cfg.vllm_max_num_batched_tokens * e * (2 * h + max(qkv + spec.num_attention_heads * spec.head_dim
                                                                  / vtp, 3 * i))
               + 3 * cfg.vllm_max_num_seqs * padded_vocab_size(spec.vocab_size) / vtp * 4)
    pool = int(cfg.vllm_gpu_memory_utilization * cfg.gpu_memory_gib * GiB)
    kv_heads = max(1, spec.num_kv_heads // vtp)  # fewer KV heads than ranks: vLLM replicates them
    per_token = 2 * spec.num_layers * kv_heads * spec.head_dim * e
    kv = max(0, pool - weights - acts)
    engines = cfg.world // vtp
    seqs = min(cfg.vllm_max_num_seqs, -(-cfg.rollout_batch_size * cfg.n_samples_per_prompt // engines))
    return VLLMMemory(weights, pool, acts, kv, per_token, kv // per_token, seqs * cfg.seq_len)
