"""The CPU KV cache of vLLM sized to the rollout batch: the byte count by hand, the flag that overrides it, and the
engine kwargs that carry it (an end-to-end run without --vllm_kv_cache_mb is in test_families.py)."""
import argparse

from rlhf.models.spec import spec_from_hf_config
from rlhf.ppo.roles import rollout_config
from rlhf.rollout.types import CPU_KV_CACHE_BYTES, MIN_CPU_KV_CACHE_BYTES, RolloutConfig, kv_cache_bytes_for_batch
from rlhf.rollout.vllm_engine import vllm_memory_kwargs

SPEC = spec_from_hf_config(dict(model_type="llama", vocab_size=1000, hidden_size=512, intermediate_size=1376,
                                num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8))


def test_bytes_by_hand():
    # 64 sequences x 100 tokens -> 128-token pages; K and V x 8 layers x 4 KV heads of 64 x 4 bytes; +25%
    assert kv_cache_bytes_for_batch(SPEC, 2, 64, 100, 4) == int(64 * 128 * (2 * 8 * 4 * 64 * 4) * 1.25)
    assert kv_cache_bytes_for_batch(SPEC, 16, 64, 100, 2) == int(64 * 128 * (2 * 8 * 1 * 64 * 2) * 1.25)  # replicated
    assert kv_cache_bytes_for_batch(SPEC, 2, 1, 10, 4) == MIN_CPU_KV_CACHE_BYTES


def _args(**kw):
    base = dict(vllm_tensor_parallel_size=2, vllm_num_engines=None, vllm_gpu_memory_utilization=0.5,
                vllm_kv_cache_mb=None, prompt_max_len=64, generate_max_len=36, bf16=False, seed=1,
                vllm_enforce_eager=True, rollout_backend="vllm", weight_sync_bucket_mb=512, rollout_batch_size=32,
                n_samples_per_prompt=4)
    base.update(kw)
    return argparse.Namespace(**base)


def test_rollout_config_sizes_the_cpu_cache_unless_the_flag_is_given():
    cfg = rollout_config(_args(), SPEC, world_size=4)  # 2 engines, 64 sequences each, 100 tokens
    assert cfg.kv_cache_bytes is None and cfg.cpu_kv_cache_bytes == kv_cache_bytes_for_batch(SPEC, 2, 64, 100, 4)
    assert vllm_memory_kwargs(cfg, on_cuda=False) == {"kv_cache_memory_bytes": cfg.cpu_kv_cache_bytes}
    assert "kv_cache_memory_bytes" not in vllm_memory_kwargs(cfg, on_cuda=True)  # CUDA: the memory fraction
    flagged = rollout_config(_args(vllm_kv_cache_mb=48), SPEC, world_size=4)
    assert flagged.cpu_kv_cache_bytes is None
    assert vllm_memory_kwargs(flagged, on_cuda=False) == {"kv_cache_memory_bytes": 48 << 20}
    assert vllm_memory_kwargs(RolloutConfig(), on_cuda=False) == {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
