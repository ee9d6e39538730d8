"""The CPU shim for megatron-core: scoped to megatron's modules, and enough for its CUDA-only code paths."""
import pytest
import torch

from rlhf.compat import cuda as cuda_shim

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is only installed without CUDA")


@pytest.fixture(scope="module")
def shim():
    assert cuda_shim.install()
    return cuda_shim


def test_megatron_modules_see_cpu_devices(shim):
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import schedules

    for mod in (schedules, clip_grads):
        assert mod.torch is not torch  # rebound ...
        assert mod.torch.cuda.current_device() == torch.device("cpu")
        t = mod.torch.zeros(2, device="cuda")  # ... so literal device="cuda" lands on the CPU
        assert t.device.type == "cpu"
        assert mod.torch.tensor([1.0], device="cuda:3").device.type == "cpu"
        mod.torch.cuda.synchronize()  # no-op instead of "Torch not compiled with CUDA enabled"


def test_global_torch_untouched(shim):
    # vLLM and our own code keep the real torch: a real CUDA request still fails loudly.
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    assert torch.ones(2).type() == "torch.FloatTensor"  # outside megatron's checks, the real type name


def test_type_names_only_inside_checks(shim):
    with shim._CudaTypeNames():
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"
        assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(2).type() == "torch.FloatTensor"
    assert torch.ones(2).cuda().device.type == "cpu"  # Tensor.cuda() is the identity on CPU builds


def test_rng_tracker_forks_the_cpu_generator(shim):
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(0)
    tracker.add("shim-test", 1234)
    before = torch.get_rng_state().clone()
    with tracker.fork("shim-test"):
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is restored after the fork
    with tracker.fork("shim-test"):
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the tracked stream advanced
    torch.manual_seed(1234)
    assert torch.equal(a, torch.rand(3))  # and it is the seeded CPU stream
    tracker.reset()


def test_clip_grads_runs_on_cpu(shim):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-6)
