"""Pre-flight memory planner for the colocated PPO schedule: bytes per role and phase on one device.

Pure functions: model specs and flags in, numbers out (no process group, no device, no I/O). What is resident
in each phase comes from ``rlhf.offload.plan_residency``, the same function the trainer's ``MemoryScheduler``
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
  ``[tokens, vocab]`` fp32 logits, only one chunk. Forward-only phases hold a working set, nothing saved.
* vLLM: weights at ``--vllm_tensor_parallel_size``; its memory pool is ``--vllm_gpu_memory_utilization`` of the
  device (weights + profiled activations + KV cache, KV = 2 x layers x KV heads x head_dim x bytes per token).
  Sleep mode releases all of it outside rollout; weight sync wakes the weights only.
* ``--reserved_gib`` per device for what no tensor accounts for: CUDA context, NCCL buffers, fragmentation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable

from rlhf.models.spec import ModelSpec, padded_vocab_size

GiB = 2 ** 30
LAYER_IMPLS = ("te", "local")
SCHEDULE = ("rollout", "weight_sync", "make_experience", "critic_update", "actor_update")
# Chunk of fp32 logits the fused log-prob kernel holds (kernels/logprobs.py: FUSED_CUDA/CPU_CHUNK_ELEMS).
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
    tp: int = 1
    pp: int = 1
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
    reserved_gib: float = 3.0

    def __post_init__(self) -> None:
        world = self.nnodes * self.gpus_per_node
        if self.layer_impl not in LAYER_IMPLS:
            raise ValueError(f"--layer_impl must be one of {LAYER_IMPLS}, got {self.layer_impl!r}")
        if world % (self.tp * self.pp):
            raise ValueError(f"--tp {self.tp} x --pp {self.pp} does not divide the {world} GPUs "
                             f"(--nnodes {self.nnodes} x --gpus_per_node {self.gpus_per_node})")
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
            if spec.num_attention_heads % self.tp or spec.num_kv_heads % self.tp:
                raise ValueError(f"--tp {self.tp} does not divide num_attention_heads={spec.num_attention_heads} "
                                 f"and num_key_value_heads={spec.num_kv_heads}")
            if spec.num_layers % self.pp:
                raise ValueError(f"--pp {self.pp} does not divide num_hidden_layers={spec.num_layers}")

    @property
    def world(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

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
        out["reward"] = (self.reward, True, False)
        return out


# ------------------------------------------------------------------------------------------ model state
def stage_param_numels(spec: ModelSpec, tp: int, pp: int, stage: int, value_head: bool) -> list[int]:
    """Elements of each parameter tensor one TP rank of pipeline ``stage`` holds, in megatron's module order."""
    h, d = spec.hidden_size, spec.head_dim
    qkv = (spec.num_attention_heads + 2 * spec.num_kv_heads) * d // tp
    vocab = padded_vocab_size(spec.vocab_size) // tp
    out: list[int] = []
    if stage == 0:
        out.append(vocab * h)  # word embeddings (vocab-parallel)
    for _ in range(spec.num_layers // pp):
        out += [h, qkv * h] + ([qkv] if spec.qkv_bias else []) + [spec.num_attention_heads * d // tp * h]
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
    numels = stage_param_numels(spec, cfg.tp, cfg.pp, stage, value_head)
    n = sum(numels)
    e = cfg.dtype_bytes
    if not trainable:
        return RoleState(n * e, 0, 0)
    dist_opt = cfg.zero_stage >= 1
    buf = ddp_buffer_numel(numels, cfg.dp, dist_opt)
    params = (buf if dist_opt else n) * e  # the distributed optimizer re-maps the params into DDP's buffer
    grads = buf * 4
    per_elem = 8 + (4 if cfg.bf16 else 0)  # exp_avg + exp_avg_sq (+ fp32 master params for bf16 params)
    optimizer = per_elem * (n // cfg.dp if dist_opt else n)
    return RoleState(params, grads, optimizer)


# ------------------------------------------------------------------------------------------- activations
def layer_saved_bytes_per_token(spec: ModelSpec, tp: int, seq_len: int, dtype_bytes: int, impl: str) -> float:
    """Bytes one transformer layer saves for backward per token (no sequence parallelism: the h-wide tensors
    are whole on every TP rank).

    te:    norm input + normed output for attention and MLP (TE's fused LayerNormLinear keeps both), the QKV
           projection output (V is a view of it), rotated Q and K, the attention output (flash attention keeps
           no [S, S] scores), fc1 output (2I), SiLU output and gated product (I each); fp32 softmax statistics.
    local: torch RMSNorm keeps an fp32 input and normalised copy plus its output (per norm); the QKV output,
           Q, the GQA-expanded K and V and the attention output; the [S, S] probabilities per head (in the
           parameter dtype: megatron's softmax sees the model before ``Float16Module`` and does not upcast);
           the same MLP tensors.
    """
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size / tp
    q, kv = spec.num_attention_heads * d / tp, spec.num_kv_heads * d / tp
    heads = spec.num_attention_heads / tp
    e = dtype_bytes
    if impl == "te":
        return e * (4 * h + (q + 2 * kv) + q + kv + q + 4 * i) + 4 * heads + 8
    norms = 2 * (2 * 4 * h + e * h)
    return norms + e * ((q + 2 * kv) + 4 * q + 4 * i + heads * seq_len) + 8


def layer_working_bytes_per_token(spec: ModelSpec, tp: int, seq_len: int, dtype_bytes: int, impl: str) -> float:
    """Bytes alive at the peak of one layer's forward without autograd (also the estimate of one layer's backward
    temporaries): the largest of the attention block (layer input, normed copies, QKV output, rotated Q and K,
    GQA-expanded K and V; with ``local`` the [S, S] scores and probabilities per head), the MLP block (with
    ``local`` five h-wide tensors the layer still references: input, attention output, residual sum, normed
    copies; then fc1 output, SiLU output, gated product) and, with ``local``, an RMSNorm computing in fp32."""
    h, d, i = spec.hidden_size, spec.head_dim, spec.intermediate_size / tp
    q, kv = spec.num_attention_heads * d / tp, spec.num_kv_heads * d / tp
    heads = spec.num_attention_heads / tp
    e = dtype_bytes
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


def activation_bytes(spec: ModelSpec, cfg: PlanConfig, stage: int, value_head: bool, train: bool) -> float:
    """Peak activation bytes of one role on one rank of ``stage``: a training step (``--micro_train_batch_size``
    micro-batches, 1F1B in flight) or a forward-only pass (``--micro_rollout_batch_size``).

    The head (last stage) and a layer's working set are never alive at once: the head runs after the last
    layer's forward and before the first layer's backward, so the peak takes the larger of the two on top of
    what is saved."""
    impl, e, s = cfg.layer_impl, cfg.dtype_bytes, cfg.seq_len
    b = cfg.micro_train_batch_size if train else cfg.micro_rollout_batch_size
    tokens, resp = b * s, b * cfg.generate_max_len
    layers = spec.num_layers // cfg.pp
    work = layer_working_bytes_per_token(spec, cfg.tp, s, e, impl) * tokens
    scores = scores_buffer_bytes(spec, cfg.tp, b, s, e, impl)
    head = head_bytes(spec, cfg, tokens, resp, value_head, train) if stage == cfg.pp - 1 else 0.0
    if not train:
        return scores + max(work, head)
    n_micro = max(1, cfg.train_batch_size // cfg.dp // b)
    in_flight = min(cfg.pp - stage, n_micro)
    full = layer_saved_bytes_per_token(spec, cfg.tp, s, e, impl) * tokens
    if cfg.gradient_checkpointing:
        saved = layers * spec.hidden_size * e * tokens * in_flight + full  # layer inputs + one recomputed layer
    else:
        saved = layers * full * in_flight
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
    h, i = spec.hidden_size, spec.intermediate_size / vtp
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


# ------------------------------------------------------------------------------------------------- phases
@dataclass
class PhasePlan:
    phase: str
    stage: int
    rows: dict[str, dict[str, float]]
    """role -> {params, grads, optimizer, activations} bytes on the device."""
    vllm: dict[str, float]
    other: dict[str, float]
    capacity: float

    @property
    def total(self) -> float:
        return (sum(sum(r.values()) for r in self.rows.values()) + sum(self.vllm.values())
                + sum(self.other.values()))

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass
class Plan:
    cfg: PlanConfig
    phases: list[PhasePlan]
    vllm: VLLMMemory
    host_per_node: float
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> PhasePlan:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.phases) and not self.problems

    @property
    def problems(self) -> list[str]:
        out = [f"{p.phase}: needs {p.total / GiB:.1f} GiB of {p.capacity / GiB:.0f} GiB" for p in self.phases
               if not p.fits]
        if self.vllm.kv_tokens < self.cfg.seq_len:
            out.append(f"vLLM KV cache holds {self.vllm.kv_tokens} tokens, less than one sequence "
                       f"(--prompt_max_len + --generate_max_len = {self.cfg.seq_len}): vLLM refuses to start")
        if self.host_per_node > self.cfg.host_memory_gib * GiB:
            out.append(f"host memory: offloaded states need {self.host_per_node / GiB:.0f} GiB per node, more "
                       f"than --host_memory_gib {self.cfg.host_memory_gib:g}")
        return out


def _phase(cfg: PlanConfig, phase: str, stage: int, vm: VLLMMemory) -> PhasePlan:
    from rlhf.offload import plan_residency

    roles = cfg.roles
    # The trainer builds every engine, then vLLM: at vLLM's start-up all four are fully resident.
    startup = phase == "vllm_startup"
    residency = None if startup else plan_residency(phase, roles, colocate_all=cfg.colocate_all,
                                                    ref_reward_offload=cfg.ref_reward_offload,
                                                    adam_offload=cfg.adam_offload)
    rows: dict[str, dict[str, float]] = {}
    for role, (spec, value_head, trainable) in roles.items():
        st = role_state(spec, cfg, stage, value_head, trainable)
        if startup:
            master = 4 * (st.optimizer // 12) if cfg.bf16 else 0  # fp32 master params exist; Adam moments are lazy
            rows[role] = {"params": st.params, "grads": st.grads, "optimizer": master, "activations": 0.0}
            continue
        r = residency[role]
        act = 0.0
        if phase == "make_experience":
            act = activation_bytes(spec, cfg, stage, value_head, train=False)
        elif phase == f"{role}_update":
            act = activation_bytes(spec, cfg, stage, value_head, train=True)
        rows[role] = {"params": st.params * r.params, "grads": st.grads * r.grads,
                      "optimizer": st.optimizer * r.optimizer, "activations": act}
    if phase == "make_experience":  # the four forwards run one after another: only the largest working set counts
        biggest = max(rows, key=lambda k: rows[k]["activations"])
        for k in rows:
            if k != biggest:
                rows[k]["activations"] = 0.0
    vllm: dict[str, float] = {}
    other = {"reserved": cfg.reserved_gib * GiB}
    if phase == "rollout":
        vllm = {"weights": vm.weights, "activations": vm.activations, "kv_cache": vm.kv_cache}
    elif phase == "weight_sync":
        vllm = {"weights": vm.weights}
        bucket = min(cfg.weight_sync_bucket_mb << 20, sum(stage_param_numels(cfg.actor, 1, 1, 0, False))
                     * cfg.dtype_bytes)
        other["sync_buckets"] = 3 * bucket  # local flat shard, the TP-gathered bucket, the HF-layout copies
    elif startup:
        vllm = {"pool": vm.pool}
    return PhasePlan(phase, stage, rows, vllm, other, cfg.gpu_memory_gib * GiB)


def plan(cfg: PlanConfig) -> Plan:
    """Every phase of the colocated schedule (plus vLLM's start-up check), at the stage that needs most."""
    vm = vllm_memory(cfg)
    phases = []
    for phase in ("vllm_startup",) + SCHEDULE:
        phases.append(max((_phase(cfg, phase, s, vm) for s in range(cfg.pp)), key=lambda p: p.total))
    host = 0.0
    for role, (spec, value_head, trainable) in cfg.roles.items():
        st = max((role_state(spec, cfg, s, value_head, trainable) for s in range(cfg.pp)),
                 key=lambda x: x.params + x.grads + x.optimizer)
        host += st.params + st.grads + st.optimizer  # OffloadManager keeps one host buffer per device storage
    notes = []
    if vm.kv_tokens < vm.kv_tokens_wanted:
        notes.append(f"vLLM KV cache: {vm.kv_tokens} tokens per engine shard, {vm.kv_tokens_wanted} wanted for "
                     f"{vm.kv_tokens_wanted // cfg.seq_len} concurrent sequences: generation runs in waves "
                     "(slower, not an OOM)")
    return Plan(cfg, phases, vm, host * cfg.gpus_per_node, notes)


# ----------------------------------------------------------------------------------------------- advice
def candidate_changes(cfg: PlanConfig) -> list[list[tuple[str, dict]]]:
    """Changes worth trying, as groups of alternatives for one setting (at most one per group is applied),
    cheapest groups first: the offload flags, ZeRO-1, recompute, then sharding, smaller micro-batches, nodes."""
    specs = [cfg.actor, cfg.reward] + ([cfg.critic] if cfg.critic else [])

    def divides_heads(n: int) -> bool:
        return all(s.num_attention_heads % n == 0 and s.num_kv_heads % n == 0 for s in specs)

    groups: list[list[tuple[str, dict]]] = []
    for flag in ("ref_reward_offload", "adam_offload", "gradient_checkpointing"):
        if not getattr(cfg, flag):
            groups.append([(f"--{flag}", {flag: True})])
    if cfg.zero_stage < 1:
        groups.append([("--zero_stage 1", {"zero_stage": 1})])
    tps = [t for t in (2, 4, 8, 16) if cfg.tp < t <= cfg.gpus_per_node and divides_heads(t)]
    groups.append([(f"--tp {t}", {"tp": t}) for t in tps])
    pps = [p for p in (2, 4, 8) if p > cfg.pp and all(s.num_layers % p == 0 for s in specs)]
    groups.append([(f"--pp {p}", {"pp": p}) for p in pps])
    vtps = [t for t in (2, 4, 8, 16) if cfg.vllm_tensor_parallel_size < t <= cfg.gpus_per_node
            and cfg.actor.num_attention_heads % t == 0]
    groups.append([(f"--vllm_tensor_parallel_size {t}", {"vllm_tensor_parallel_size": t}) for t in vtps])
    mbs = [m for m in (cfg.micro_train_batch_size // 2, 1) if 0 < m < cfg.micro_train_batch_size]
    groups.append([(f"--micro_train_batch_size {m}", {"micro_train_batch_size": m}) for m in dict.fromkeys(mbs)])
    groups.append([(f"--nnodes {cfg.nnodes * k}", {"nnodes": cfg.nnodes * k}) for k in (2, 4)])
    return [g for g in groups if g]


def max_vllm_utilization(p: Plan) -> float:
    """The largest --vllm_gpu_memory_utilization that passes vLLM's start-up check (free memory >= its pool)."""
    start = next(ph for ph in p.phases if ph.phase == "vllm_startup")
    used = start.total - start.vllm["pool"]
    return max(0.0, math.floor((start.capacity - used) / start.capacity * 100) / 100)


def _with_feasible_utilization(cfg: PlanConfig) -> PlanConfig:
    """Lower --vllm_gpu_memory_utilization just enough to pass vLLM's start-up check (never raise it)."""
    util = max_vllm_utilization(plan(cfg))
    if 0 < util < cfg.vllm_gpu_memory_utilization:
        return replace(cfg, vllm_gpu_memory_utilization=util)
    return cfg


def advise(cfg: PlanConfig, max_changes: int = 3, max_lines: int = 3) -> list[str]:
    """What would make ``cfg`` fit (fewest changes first), and why a flag would not help. Empty when it fits.

    A layout whose only problem is vLLM's start-up check also gets the largest --vllm_gpu_memory_utilization
    that passes it (the KV cache shrinks accordingly)."""
    import itertools

    base = plan(cfg)
    if base.fits:
        return []
    lines: list[str] = []
    groups = candidate_changes(cfg)
    offload = ("--ref_reward_offload", "--adam_offload")
    if cfg.colocate_all:
        for label in (g[0][0] for g in groups if g[0][0] in offload):
            lines.append(f"{label}: no effect under --colocate_all, which already keeps ref/reward parameters and "
                         "optimizer states off the device outside their own phase")
        groups = [g for g in groups if g[0][0] not in offload]
    start = next(ph for ph in base.phases if ph.phase == "vllm_startup")
    if not start.fits:
        lines.append(f"vLLM starts after the four models are built: at most --vllm_gpu_memory_utilization "
                     f"{max_vllm_utilization(base):.2f} passes its start-up check on this layout "
                     f"(asked: {cfg.vllm_gpu_memory_utilization:g})")
    for k in range(0, max_changes + 1):
        found = []
        for chosen in itertools.combinations(groups, k):
            for combo in itertools.product(*chosen):
                changes: dict = {}
                for _, ch in combo:
                    changes.update(ch)
                try:
                    trial = _with_feasible_utilization(replace(cfg, **changes))
                except ValueError:  # e.g. a TP x PP that does not divide the GPUs
                    continue
                p = plan(trial)
                if p.fits:
                    util = (f"--vllm_gpu_memory_utilization {trial.vllm_gpu_memory_utilization:g}"
                            if trial.vllm_gpu_memory_utilization != cfg.vllm_gpu_memory_utilization else "")
                    what = " ".join([lb for lb, _ in combo] + ([util] if util else []))
                    found.append(f"fits with {what} (peak {p.peak.total / GiB:.1f} GiB in {p.peak.phase}; vLLM KV "
                                 f"cache {p.vllm.kv_tokens} tokens per engine shard)")
        if found:
            return lines + found[:max_lines]
    labels = ", ".join(lb for g in groups for lb, _ in g)
    lines.append(f"no combination of up to {max_changes} of {labels} fits: shorten sequences or use a smaller model")
    return lines


# ---------------------------------------------------------------------------------------------- printing
def _gib(x: float, width: int = 8) -> str:
    return f"{x / GiB:{width}.2f}"


def format_plan(p: Plan) -> str:
    """The per-phase tables, as printed by tools/plan_memory.py (GiB per device)."""
    c = p.cfg
    lines = [f"layout: {c.nnodes} node(s) x {c.gpus_per_node} GPUs of {c.gpu_memory_gib:g} GiB; tp={c.tp} pp={c.pp} "
             f"dp={c.dp}; vLLM {c.world // c.vllm_tensor_parallel_size} engine(s) x TP {c.vllm_tensor_parallel_size}"
             f"; {'bf16' if c.bf16 else 'fp32'}; layers={c.layer_impl}; seq {c.seq_len} tokens "
             f"(prompt {c.prompt_max_len} + generate {c.generate_max_len})",
             f"flags: zero_stage={c.zero_stage} gradient_checkpointing={c.gradient_checkpointing} colocate_all="
             f"{c.colocate_all} ref_reward_offload={c.ref_reward_offload} adam_offload={c.adam_offload} "
             f"micro_train={c.micro_train_batch_size} micro_rollout={c.micro_rollout_batch_size} vllm_util="
             f"{c.vllm_gpu_memory_utilization:g}", ""]
    header = f"{'phase':<21}{'role':<17}{'params':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'total':>9}"
    lines += [header + "   (GiB per GPU)", "-" * len(header)]
    for ph in p.phases:
        name = ph.phase + (f" [pp{ph.stage}]" if c.pp > 1 else "")
        first = True
        for role, r in ph.rows.items():
            if not any(r.values()):
                continue
            lines.append(f"{name if first else '':<21}{role:<17}{_gib(r['params'])}{_gib(r['grads'])}"
                         f"{_gib(r['optimizer'])}{_gib(r['activations'])}{_gib(sum(r.values()), 9)}")
            first = False
        for k, v in list(ph.vllm.items()) + list(ph.other.items()):
            label = f"vLLM {k}" if k in ph.vllm else k
            lines.append(f"{name if first else '':<21}{label:<17}{'':>32}{_gib(v, 9)}")
            first = False
        verdict = "fits" if ph.fits else f"OOM by {(ph.total - ph.capacity) / GiB:.1f} GiB"
        lines.append(f"{'':<21}{'= total':<17}{'':>32}{_gib(ph.total, 9)}  of {ph.capacity / GiB:.0f}: {verdict}")
        lines.append("")
    vm = p.vllm
    lines.append(f"vLLM: weights {vm.weights / GiB:.2f} GiB, KV cache {vm.kv_cache / GiB:.2f} GiB = {vm.kv_tokens} "
                 f"tokens per engine shard ({vm.kv_bytes_per_token} B/token), {vm.kv_tokens_wanted} wanted")
    lines.append(f"host memory for offloaded states: {p.host_per_node / GiB:.0f} GiB per node")
    lines += p.notes
    lines.append(f"peak: {p.peak.total / GiB:.1f} GiB in {p.peak.phase}: "
                 + ("FITS" if p.fits else "DOES NOT FIT (" + "; ".join(p.problems) + ")"))
    return "\n".join(lines)


def format_markdown(p: Plan) -> str:
    """One row per phase (GiB per GPU at its worst pipeline stage), for documentation."""
    out = ["| phase | actor | critic | ref | reward | vLLM | other | total | fits |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for ph in p.phases:
        cells = [f"{sum(ph.rows[r].values()) / GiB:.1f}" if r in ph.rows and any(ph.rows[r].values()) else "-"
                 for r in ("actor", "critic", "ref", "reward")]
        vllm = f"{sum(ph.vllm.values()) / GiB:.1f}" if ph.vllm else "-"
        out.append(f"| {ph.phase} | " + " | ".join(cells) + f" | {vllm} | {sum(ph.other.values()) / GiB:.1f} | "
                   f"{ph.total / GiB:.1f} | {'yes' if ph.fits else 'no'} |")
    return "\n".join(out)
