"""Plain data types of the rollout phase."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


CPU_KV_CACHE_BYTES = 256 << 20
"""vLLM's KV cache per rank on CPU when --vllm_kv_cache_mb is not given and the batch is unknown."""
MIN_CPU_KV_CACHE_BYTES = 16 << 20


def generator_dtype(bf16: bool, on_cuda: bool) -> tuple[str, str]:
    """vLLM's dtype, and why: ``float32`` without ``--bf16``; with it ``bfloat16``, but on a CPU whose bf16
    products are slower than fp32's (``rlhf.compat.onednn.choose_cpu_gemms``, ``RLHF_CPU_BF16_GEMM``) the engine
    runs ``float32`` on the synced bf16 weights (converted exactly: the same model, activations not rounded to
    bf16). On the 2-core Intel Xeon without AMX, vLLM's bf16 decode of the bench's 32 x 32 tokens took 1.03-1.09 s
    at 25M against 0.90-0.95 s in fp32, 3.7-4.3 s against 3.2-3.5 s at SmolLM2-135M."""
    if not bf16:
        return "float32", "fp32 training"
    if on_cuda:
        return "bfloat16", "--bf16"
    from rlhf.compat.onednn import choose_cpu_gemms

    if choose_cpu_gemms()[1] == "bf16":
        return "bfloat16", "--bf16, and this CPU multiplies bf16 fast"
    return "float32", "--bf16 on a CPU whose bf16 products are slower than fp32's (RLHF_CPU_BF16_GEMM=bf16 keeps bf16)"


def kv_cache_bytes_for_batch(spec, tensor_parallel_size: int, seqs_per_engine: int, max_model_len: int,
                             dtype_bytes: int, block: int = 128) -> int:
    """KV-cache bytes one rank needs to hold every sequence its engine generates at once: ``seqs_per_engine``
    sequences of up to ``max_model_len`` tokens (rounded up to ``block``-token pages), K and V of every layer for
    this rank's KV heads (replicated when TP exceeds them), plus a quarter for vLLM's own rounding; at least
    ``MIN_CPU_KV_CACHE_BYTES``."""
    kv_heads = max(spec.num_kv_heads // tensor_parallel_size, 1)
    per_token = 2 * spec.num_layers * kv_heads * spec.head_dim * dtype_bytes
    tokens = seqs_per_engine * -(-max_model_len // block) * block
    return max(MIN_CPU_KV_CACHE_BYTES, int(tokens * per_token * 1.25))


def heads_allow_tp(spec, tp: int) -> bool:
    """vLLM shards the attention heads over TP and replicates KV heads when TP exceeds them."""
    return spec.num_attention_heads % tp == 0 and (spec.num_kv_heads % tp == 0 or tp % spec.num_kv_heads == 0)


def choose_tensor_parallel_size(spec, world_size: int, local_world_size: int, *, cuda: bool, device_bytes: int = 0,
                                dtype_bytes: int = 4, gpu_memory_utilization: float = 0.5) -> tuple[int, str]:
    """``--vllm_tensor_parallel_size`` when it is not given: ``(tp, why)``. Candidates divide the ranks of a node
    (an engine never spans nodes) and fit the heads (``heads_allow_tp``).

    - CPU: the largest candidate. One engine over the node's ranks generated faster than one engine per rank at
      every size measured on a 2-core machine (``bench/rollout.py``, 32 prompts x 32 tokens, eager: 4M
      0.28 vs 0.34 s, 25M 1.16 vs 1.48 s): the ranks share every decode step's weight reads and per-step
      overhead instead of each paying it for half the batch.
    - CUDA: the smallest candidate whose weight shard takes at most half of vLLM's memory share
      (``gpu_memory_utilization`` x device memory), so the rest holds the KV cache: more engines and no TP
      all-reduce per layer, the seed systems' usual choice (TP 1 for 7B on 80 GB, more for 70B).
    """
    from rlhf.planner.model_bytes import stage_param_numels

    cands = [tp for tp in range(1, max(local_world_size, 1) + 1)
             if local_world_size % tp == 0 and world_size % tp == 0 and heads_allow_tp(spec, tp)]
    heads = f"{spec.num_attention_heads} heads / {spec.num_kv_heads} KV heads"
    if not cuda:
        tp = cands[-1]
        if tp > 1:
            return tp, (f"CPU: one engine of TP {tp} over the node's {local_world_size} ranks ({heads}); on CPU one "
                        "TP engine generated faster than one engine per rank at every size measured")
        return 1, (f"CPU: one engine per rank; {heads} allow no TP > 1 within the node's {local_world_size} ranks"
                   if local_world_size > 1 else "one rank per node")
    weights = sum(stage_param_numels(spec, 1, 1, 0, False)) * dtype_bytes
    budget = 0.5 * gpu_memory_utilization * device_bytes
    for tp in cands:
        if weights / tp <= budget:
            return tp, (f"CUDA: the smallest TP whose weight shard ({weights / tp / 2**30:.1f} GiB) is at most half "
                        f"of vLLM's share ({gpu_memory_utilization:g} x {device_bytes / 2**30:.0f} GiB); {heads}")
    return cands[-1], (f"CUDA: the weights ({weights / 2**30:.1f} GiB) need more than the node's ranks allow; TP "
                       f"{cands[-1]}, the largest {heads} allow within {local_world_size} ranks")


@dataclass
class RolloutConfig:
    """How responses are generated (``launch/ppo.py`` flags in parentheses)."""

    tensor_parallel_size: int = 1
    """(--vllm_tensor_parallel_size) TP of each vLLM engine; engines = world size / this. The trainer chooses it
    when the flag is not given (``choose_tensor_parallel_size``)."""
    num_engines: int | None = None
    """(--vllm_num_engines) must equal world size / vLLM TP when given (every rank hosts an engine shard)."""
    gpu_memory_utilization: float = 0.5
    """(--vllm_gpu_memory_utilization) fraction of device memory for vLLM weights + KV cache on CUDA."""
    kv_cache_bytes: int | None = None
    """(--vllm_kv_cache_mb) KV cache size per rank, vLLM's ``kv_cache_memory_bytes``. None: ``CPU_KV_CACHE_BYTES`` on
    CPU (where vLLM would otherwise reserve 90% of RAM), ``gpu_memory_utilization`` on CUDA. Given on CUDA, it
    replaces ``gpu_memory_utilization`` (vLLM then sizes the cache to exactly this)."""
    cpu_kv_cache_bytes: int | None = None
    """The CPU KV cache when ``kv_cache_bytes`` is None: sized to the rollout batch by the trainer
    (``kv_cache_bytes_for_batch``); None: ``CPU_KV_CACHE_BYTES``."""
    max_model_len: int = 2048
    """prompt_max_len + generate_max_len."""
    dtype: str = "float32"
    """float32, or bfloat16 with --bf16 (``generator_dtype``)."""
    dtype_reason: str = ""
    """why this dtype (logged with the engine)"""
    seed: int = 42
    enforce_eager: bool = True
    """(--vllm_enforce_eager / --no-vllm_enforce_eager) CUDA graphs / torch.compile cost 17-22 s per start on CPU."""
    enable_sleep_mode: bool = True
    """vLLM sleep mode between rollouts; only on CUDA (vLLM rejects it on CPU, and sleep/wake are no-ops)."""
    backend: str = "auto"
    """auto | vllm | megatron (the fallback: the actor's own model with a decode cache; for machines without vLLM)."""
    weight_sync_bucket_mb: int = 512
    """(--weight_sync_bucket_mb) TP-gathered weights are sent to the engine in buckets of about this size."""
    enable_prefix_caching: bool = False
    """(--vllm_enable_prefix_caching) vLLM's automatic prefix caching; every weight sync resets the cache, so no
    KV block computed with the previous weights is reused (OpenRLHF resets it at each broadcast too)."""
    lora_adapter_rank: int = 0
    """(--lora_sync adapter) the actor's LoRA rank: vLLM serves its adapters through its LoRA path, the base synced
    once (``rlhf.rollout.lora_sync``); 0: merged weights are synced"""
    lora_adapter_keep: int = 1
    """adapter versions each rank keeps (--max_staleness + 1 with partial rollouts)"""
    vision: dict | None = None
    """a vision-language actor (``rlhf.models.vlm``): ``image_token_id``, ``max_images`` (vLLM's
    ``limit_mm_per_prompt``), ``min_pixels``, ``max_pixels``, ``image_mean``, ``image_std`` and ``rescale_factor``
    (the trainer's own image processor's)"""
    return_routed_experts: bool = False
    """(--moe_router_replay rollout) vLLM's ``enable_return_routed_experts``: each sample carries the experts of its
    tokens (vLLM 0.32: its V2 model runner only, which needs Triton: GPU)."""

    def __post_init__(self) -> None:
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"--vllm_kv_cache_mb must be > 0, got {self.kv_cache_bytes >> 20}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--vllm_tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--vllm_gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.backend not in ("auto", "vllm", "megatron"):
            raise ValueError(f"--rollout_backend must be auto, vllm or megatron, got {self.backend!r}")
        if self.weight_sync_bucket_mb < 1:
            raise ValueError(f"--weight_sync_bucket_mb must be >= 1, got {self.weight_sync_bucket_mb}")


def engine_share(n_items: int, engines: int, e: int) -> tuple[int, int]:
    """Engine ``e``'s contiguous share ``[lo, hi)`` of ``n_items`` over ``engines`` (sizes differ by at most 1)."""
    return n_items * e // engines, n_items * (e + 1) // engines


def mb_to_bytes(mb: int | None) -> int | None:
    """``--vllm_kv_cache_mb`` -> bytes (None stays None: the device's default)."""
    return None if mb is None else int(mb) << 20


class ImagePrompt(list):
    """A prompt's token ids (each image's placeholders expanded, as the trainer sees them) with its images:
    ``mm`` (processed, for the trainer) and ``images`` (PIL, for the generator)."""

    def __init__(self, ids, mm: dict, images: list):
        super().__init__(ids)
        self.mm, self.images = mm, images


def generation_prompt(p):
    """What a generator takes for a dataset's ``PromptSample``: its ids, or an ``ImagePrompt`` when it has images."""
    ids = p.prompt_ids.tolist()
    return ImagePrompt(ids, p.mm, p.images) if getattr(p, "mm", None) is not None else ids


@dataclass
class Sample:
    """One generated response. ``logprobs[i]`` is the engine's log-prob (at the sampling temperature) of
    ``response_ids[i]``; ``finished`` is True when it ended with EOS rather than at the length limit.
    A multi-turn trajectory (``rlhf.agents``): ``response_ids`` hold every token after the prompt, the model's
    and the environment's; ``action_mask`` marks the model's (the only ones with loss), ``agent`` is its
    ``rlhf.agents.rollout.AgentOutcome``."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finished: bool
    action_mask: list[bool] | None = None
    agent: object = None
    versions: list[int] | None = None
    """partial rollouts (``rlhf.rollout.partial``): the policy version that produced each response token"""
    mm: dict | None = None
    """a vision-language prompt's images as the trainer takes them (``rlhf.data.vision.process``)"""
    routed_experts: object = None
    """an MoE generator's experts of each prompt and response token it fed forward, ``(tokens, layers, top_k)``
    ids (vLLM's ``CompletionOutput.routed_experts``; the megatron fallback records its own); None: not recorded"""


@dataclass
class AgentOutcome:
    """What a trajectory's environment said (``Sample.agent``)."""

    reward: float | None
    """the sum of its step rewards (None: a single-turn executor; the trainer's reward sources score it)"""
    score: float | None
    turns: int
    env_seconds: float
    cut: bool
    """ended by the token budget or --max_turns, not by ``done``"""
    failure: str | None = None
    extra_logs: dict = field(default_factory=dict)
    endpoint: dict | None = None
    """a run_agent session's call counts (``rlhf.agents.tokens.Session.stats``)"""


def sample_state(smp: Sample) -> dict:
    """A sample as a checkpoint's trainer.json holds it (lists, numbers, strings): a partial rollout's finished
    agent trajectory carried to a later step."""
    d = dataclasses.asdict(smp)
    if smp.routed_experts is not None:
        d["routed_experts"] = smp.routed_experts.tolist()
    return d


def sample_from_state(d: dict) -> Sample:
    import numpy as np

    d = dict(d)
    d["agent"] = AgentOutcome(**d["agent"]) if d["agent"] is not None else None
    if d["routed_experts"] is not None:
        d["routed_experts"] = np.asarray(d["routed_experts"], dtype=np.int16)
    return Sample(**d)
