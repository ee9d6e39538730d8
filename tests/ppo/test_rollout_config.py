"""The CPU KV cache of vLLM sized to the rollout batch: the byte count by hand, the flag that overrides it, and the
engine kwargs that carry it (an end-to-end run without --vllm_kv_cache_mb is in test_families.py). The generator
layout chosen when --vllm_tensor_parallel_size is not given, and --zero_stage's default, by hand."""
import argparse

import pytest

from rlhf.models.spec import spec_from_hf_config
from rlhf.ppo.roles import rollout_config
from rlhf.rollout.types import (CPU_KV_CACHE_BYTES, MIN_CPU_KV_CACHE_BYTES, RolloutConfig,
                                choose_tensor_parallel_size, kv_cache_bytes_for_batch)
from rlhf.rollout.vllm_generator import vllm_memory_kwargs

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


def _job(**kw):
    """The parts of ``PPOJobConfig`` that ``rollout_config`` reads, from ``_args``'s flags."""
    from rlhf.agents.flags import AgentPart
    from rlhf.models.routing_replay import RouterReplayPart
    from rlhf.config.parts import EnginePart
    from rlhf.ppo.parts import GenerationPart, PPOBatch, PPOLora, RolloutPart
    from rlhf.rollout.partial_config import PartialRolloutConfig

    a = vars(_args(**kw))
    pick = lambda cls: cls(**{k: v for k, v in a.items() if k in cls.flag_dests()})  # noqa: E731
    return argparse.Namespace(rollout=pick(RolloutPart), engine=pick(EnginePart), batch=pick(PPOBatch),
                              generation=pick(GenerationPart), agent=AgentPart(), router_replay=RouterReplayPart(),
                              lora=pick(PPOLora), partial=pick(PartialRolloutConfig))


@pytest.mark.parametrize("flags,kept", [({}, 1), ({"async_one_step_off": True}, 2),
                                        ({"partial_rollout": True, "max_staleness": 3}, 4)])
def test_adapter_versions_kept_cover_the_staleness(flags, kept):
    """--lora_sync adapter keeps the adapter versions a trained token may come from: the current one, one more
    one-step-off, --max_staleness more with partial rollouts (vLLM's max_cpu_loras and the folders on disk)."""
    cfg = rollout_config(_job(lora_rank=4, lora_sync="adapter", **flags))
    assert (cfg.lora_adapter_rank, cfg.lora_adapter_keep) == (4, kept)
    assert rollout_config(_job(lora_rank=4, **flags)).lora_adapter_rank == 0  # merged: no LoRA path


def test_rollout_config_sizes_the_cpu_cache_unless_the_flag_is_given():
    cfg = rollout_config(_job(), SPEC, world_size=4)  # 2 engines, 64 sequences each, 100 tokens
    assert cfg.kv_cache_bytes is None and cfg.cpu_kv_cache_bytes == kv_cache_bytes_for_batch(SPEC, 2, 64, 100, 4)
    assert vllm_memory_kwargs(cfg, on_cuda=False)["kv_cache_memory_bytes"] == cfg.cpu_kv_cache_bytes
    assert "kv_cache_memory_bytes" not in vllm_memory_kwargs(cfg, on_cuda=True)  # CUDA: the memory fraction
    flagged = rollout_config(_job(vllm_kv_cache_mb=48), SPEC, world_size=4)
    assert flagged.cpu_kv_cache_bytes is None
    assert vllm_memory_kwargs(flagged, on_cuda=False)["kv_cache_memory_bytes"] == 48 << 20
    assert vllm_memory_kwargs(RolloutConfig(), on_cuda=False)["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES


def _spec(heads, kv, hidden=512, layers=8, vocab=1000, ffn=1376):
    return spec_from_hf_config(dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv))


def test_cpu_layout_is_the_largest_tp_the_heads_allow_within_a_node():
    assert choose_tensor_parallel_size(SPEC, 2, 2, cuda=False)[0] == 2
    assert choose_tensor_parallel_size(SPEC, 8, 4, cuda=False)[0] == 4  # never across nodes
    assert choose_tensor_parallel_size(_spec(9, 3, hidden=576), 2, 2, cuda=False)[0] == 1  # SmolLM2's heads
    assert choose_tensor_parallel_size(_spec(8, 2), 4, 4, cuda=False)[0] == 4  # KV heads replicated
    assert choose_tensor_parallel_size(_spec(12, 12), 8, 8, cuda=False)[0] == 4
    tp, why = choose_tensor_parallel_size(SPEC, 1, 1, cuda=False)
    assert tp == 1 and why


def test_cuda_layout_is_the_smallest_tp_whose_weights_leave_room_for_the_kv_cache():
    big = _spec(64, 8, hidden=8192, layers=80, vocab=32000, ffn=28672)  # ~69B parameters, 138 GB in bf16
    gib = 2**30
    assert choose_tensor_parallel_size(big, 8, 8, cuda=True, device_bytes=80 * gib, dtype_bytes=2,
                                       gpu_memory_utilization=0.9)[0] == 4  # 32 GiB per shard <= 36
    assert choose_tensor_parallel_size(big, 8, 8, cuda=True, device_bytes=80 * gib, dtype_bytes=2,
                                       gpu_memory_utilization=0.5)[0] == 8  # 16 GiB per shard <= 20
    small = _spec(32, 32, hidden=4096, layers=32, vocab=32000, ffn=11008)  # ~6.7B: 13.5 GB in bf16
    assert choose_tensor_parallel_size(small, 8, 8, cuda=True, device_bytes=80 * gib, dtype_bytes=2,
                                       gpu_memory_utilization=0.9)[0] == 1


def _ppo_args(**kw):
    base = dict(vllm_tensor_parallel_size=None, vllm_num_engines=None, vllm_gpu_memory_utilization=0.5, bf16=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_resolve_vllm_tp(monkeypatch):
    from rlhf.ppo.args import resolve_vllm_tp

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    a = _ppo_args()
    assert resolve_vllm_tp(a, SPEC, 2) and a.vllm_tensor_parallel_size == 2
    a = _ppo_args(vllm_tensor_parallel_size=1)
    assert resolve_vllm_tp(a, SPEC, 2) == "" and a.vllm_tensor_parallel_size == 1  # the user's choice stays
    a = _ppo_args(vllm_num_engines=2)
    assert resolve_vllm_tp(a, SPEC, 2) and a.vllm_tensor_parallel_size == 1
    with pytest.raises(ValueError, match="--vllm_num_engines 3"):
        resolve_vllm_tp(_ppo_args(vllm_num_engines=3), SPEC, 2)


def test_zero_stage_default_is_one_when_data_parallel_on_cuda():
    from rlhf.config.job import resolve_zero_stage

    for given, dp, cuda, want in ((None, 2, True, 1), (None, 1, True, 0), (0, 4, True, 0), (1, 1, True, 1),
                                  (None, 2, False, 0), (1, 2, False, 1)):
        a = argparse.Namespace(zero_stage=given)
        assert resolve_zero_stage(a, dp, cuda) == want and a.zero_stage == want


def test_generator_dtype_follows_the_cpu_bf16_choice(monkeypatch):
    from rlhf.rollout.types import generator_dtype

    assert generator_dtype(False, on_cuda=True)[0] == generator_dtype(False, on_cuda=False)[0] == "float32"
    assert generator_dtype(True, on_cuda=True)[0] == "bfloat16"
    monkeypatch.setenv("RLHF_CPU_BF16_GEMM", "bf16")
    assert generator_dtype(True, on_cuda=False)[0] == "bfloat16"
    cfg = rollout_config(_job(bf16=True), SPEC, world_size=4)
    assert (cfg.dtype, cfg.cpu_kv_cache_bytes) == ("bfloat16", kv_cache_bytes_for_batch(SPEC, 2, 64, 100, 2))
    monkeypatch.setenv("RLHF_CPU_BF16_GEMM", "fp32")  # bf16 products slower than fp32's: vLLM in fp32, 4-byte cache
    dtype, why = generator_dtype(True, on_cuda=False)
    assert dtype == "float32" and "RLHF_CPU_BF16_GEMM" in why
    cfg = rollout_config(_job(bf16=True), SPEC, world_size=4)
    assert (cfg.dtype, cfg.cpu_kv_cache_bytes) == ("float32", kv_cache_bytes_for_batch(SPEC, 2, 64, 100, 4))


def test_fixed_policy_generator_takes_generator_dtype(monkeypatch):
    """Batch inference and rejection sampling (``plan_policy_generator``) run vLLM in the dtype PPO's generator
    would: under --bf16 on a CPU whose bf16 products are slow, fp32."""
    import rlhf.models.source
    import rlhf.models.spec
    from rlhf.rollout import plan_policy_generator
    from rlhf.rollout.types import generator_dtype

    monkeypatch.setattr(rlhf.models.source, "describe_source", lambda path: {"spec": SPEC, "padded_vocab": 0})
    monkeypatch.setattr(rlhf.models.spec, "check_parallel_fit", lambda *a, **k: None)
    monkeypatch.setenv("RLHF_DEVICE", "cpu")
    args = argparse.Namespace(temperature=1.0, top_p=1.0, tensor_model_parallel_size=1, pretrain="policy",
                              vllm_kv_cache_mb=None, prompt_max_len=16, max_new_tokens=8, seed=1,
                              rollout_backend="megatron", bf16=True)
    for gemm, want in (("fp32", "float32"), ("bf16", "bfloat16")):
        monkeypatch.setenv("RLHF_CPU_BF16_GEMM", gemm)
        _, rcfg, use_vllm = plan_policy_generator(args, world_size=1)
        assert not use_vllm and (rcfg.dtype, rcfg.dtype_reason) == generator_dtype(True, on_cuda=False), gemm
        assert rcfg.dtype == want
    args.bf16 = False
    assert plan_policy_generator(args, world_size=1)[1].dtype == "float32"
