"""rlhf.compat.onednn: the fp32 linear layers' oneDNN GEMMs against an fp64 hand computation, and the switch and
fallback around them. The whole training step with them is checked against fp64 HF + torch Adam in
tests/train/test_optimizer_reference.py."""
import logging

import pytest
import torch

from rlhf.compat import onednn


def test_linear_forward_and_both_grads_match_fp64():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen).requires_grad_()  # [s, b, h] as megatron feeds it
    w = torch.randn(48, 64, generator=gen).requires_grad_()
    b = torch.randn(48, generator=gen).requires_grad_()
    y = onednn.OneDNNLinear.apply(x, w, b)
    g = torch.randn(y.shape, generator=gen)
    y.backward(g)
    xd, wd, gd = x.detach().double(), w.detach().double(), g.double()
    want = {"y": xd @ wd.T + b.detach().double(), "x": gd @ wd, "w": gd.reshape(-1, 48).T @ xd.reshape(-1, 64),
            "b": gd.sum((0, 1))}
    got = {"y": y, "x": x.grad, "w": w.grad, "b": b.grad}
    for k in want:
        assert got[k].shape == want[k].shape, k
        err = (got[k].double() - want[k]).abs().max().item() / want[k].abs().max().item()
        assert err < 1e-5, (k, err)  # fp32 rounding (measured 1e-6); a wrong transpose is off by O(1)


def test_no_tokens_gives_empty_output_and_zero_weight_grad():
    """An MoE expert that received no tokens: oneDNN itself rejects the empty products."""
    x = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)
    y = onednn.OneDNNLinear.apply(x, w, None)
    assert y.shape == (0, 6)
    y.sum().backward()
    assert x.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros(6, 8))


def test_bf16_by_the_fp32_gemm_matches_fp64_and_bf16_kernel():
    """Fp32GemmLinear (bf16 operands, fp32 GEMM): forward and both grads against an fp64 hand computation on the
    same bf16 values, and within a bf16 rounding of torch's own bf16 linear."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(48, 64, generator=gen).bfloat16().requires_grad_()
    b = torch.randn(48, generator=gen).bfloat16().requires_grad_()
    y = onednn.Fp32GemmLinear.apply(x, w, b)
    g = torch.randn(y.shape, generator=gen).bfloat16()
    y.backward(g)
    assert y.dtype == x.grad.dtype == w.grad.dtype == b.grad.dtype == torch.bfloat16
    xd, wd, gd = x.detach().double(), w.detach().double(), g.double()
    want = {"y": xd @ wd.T + b.detach().double(), "dx": gd @ wd, "dw": gd.reshape(-1, 48).T @ xd.reshape(-1, 64),
            "db": gd.reshape(-1, 48).sum(0)}
    got = {"y": y, "dx": x.grad, "dw": w.grad, "db": b.grad}
    for k in want:  # one bf16 rounding of the result (2^-8 relative); a wrong transpose is off by O(1)
        err = ((got[k].double() - want[k]).abs() / want[k].abs().clamp(min=1.0)).max().item()
        assert err < 8e-3, (k, err)
    ref = torch.nn.functional.linear(x.detach(), w.detach(), b.detach())  # torch's bf16 kernel
    assert ((y.detach().float() - ref.float()).abs() / ref.float().abs().clamp(min=1.0)).max() < 1.6e-2


def test_frozen_weight_gets_no_grad():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(6, 8)
    onednn.OneDNNLinear.apply(x, w, None).sum().backward()
    assert w.grad is None
    assert torch.allclose(x.grad, w.sum(0).expand(4, 8), atol=1e-5)


def test_switch_and_named_fallback(monkeypatch, caplog):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    monkeypatch.setattr(onednn, "_state", {})
    monkeypatch.setenv("RLHF_CPU_LINEAR", "mkl")
    with pytest.raises(ValueError, match="RLHF_CPU_LINEAR"):
        onednn.use_onednn_linears(model)
    monkeypatch.setenv("RLHF_CPU_LINEAR", "torch")
    monkeypatch.setenv("RLHF_CPU_BF16_GEMM", "bf16")
    assert onednn.use_onednn_linears(model) == 0
    monkeypatch.setenv("RLHF_CPU_BF16_GEMM", "fp16")
    with pytest.raises(ValueError, match="RLHF_CPU_BF16_GEMM"):
        onednn.choose_cpu_gemms()
    monkeypatch.setenv("RLHF_CPU_LINEAR", "auto")  # by the CPU
    monkeypatch.setenv("RLHF_CPU_BF16_GEMM", "auto")
    for vendor, flags, want in (("GenuineIntel", {"avx512_bf16"}, ("torch", "fp32")),  # the Xeon measured
                                ("GenuineIntel", {"avx512_bf16", "amx_bf16"}, ("torch", "bf16")),
                                ("AuthenticAMD", {"avx512_bf16"}, ("onednn", "bf16")),  # the Zen 5 measured
                                ("AuthenticAMD", {"avx2"}, ("onednn", "fp32"))):
        monkeypatch.setattr(onednn, "cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(onednn, "cpu_flags", lambda f=flags: f)
        assert onednn.choose_cpu_gemms() == want, (vendor, flags)
    monkeypatch.undo()
    monkeypatch.setattr(onednn, "_state", {})

    def broken(a, w):
        raise RuntimeError("no oneDNN in this build")

    monkeypatch.setattr(onednn, "_gemm", broken)
    with caplog.at_level(logging.WARNING, logger="rlhf.compat.onednn"):
        assert not onednn.onednn_linear_works()
    assert "not usable (RuntimeError: no oneDNN in this build)" in caplog.text


@pytest.mark.parametrize("fn,dtype", [(onednn.MainGradLinear, torch.float32), (onednn.Fp32GemmLinear, torch.bfloat16)])
def test_weight_grad_accumulates_into_main_grad(fn, dtype):
    """A weight with megatron's ``main_grad`` (as DDP leaves it): two micro-batches' weight gradients add up
    there, in fp32 (the hand computation in fp64), the flag tells DDP's hook to skip its own add, and the
    input gradient is as without it. A weight without one gets its gradient the ordinary way."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(7, 12, generator=gen).to(dtype).requires_grad_()
    w.main_grad, w.grad_added_to_main_grad = torch.zeros(7, 12), False
    want = torch.zeros(7, 12, dtype=torch.float64)
    for rows in (5, 9):
        x = torch.randn(2, rows, 12, generator=gen).to(dtype).requires_grad_()
        g = torch.randn(2, rows, 7, generator=gen).to(dtype)
        fn.apply(x, w, None).backward(g)
        want += g.double().reshape(-1, 7).T @ x.double().reshape(-1, 12)
        torch.testing.assert_close(x.grad.double(), (g.double() @ w.double()), atol=1e-4,
                                   rtol=1e-5 if dtype == torch.float32 else 8e-3)
        w.grad = None  # what DDP's hook does with the placeholder
    assert w.grad_added_to_main_grad
    torch.testing.assert_close(w.main_grad.double(), want, atol=1e-5, rtol=1e-5)  # fp32, unrounded even for bf16
    plain = w.detach().clone().requires_grad_()
    x = torch.randn(3, 12, generator=gen).to(dtype)
    g = torch.randn(3, 7, generator=gen).to(dtype)
    fn.apply(x, plain, None).backward(g)
    assert plain.grad.dtype == dtype
    torch.testing.assert_close(plain.grad.double(), g.double().T @ x.double(), atol=1e-4,
                               rtol=1e-5 if dtype == torch.float32 else 8e-3)


_SHAPES_WORKER = """
import sys, time
import psutil, torch
from rlhf.compat import onednn
if sys.argv[1] == "bounded":
    onednn.bound_onednn_caches()
torch.set_num_threads(1)
w, proc, start, new = torch.randn(768, 256), psutil.Process(), time.monotonic(), 0
for i in range(400):  # up to 400 token counts, as packed micro-batches give
    onednn._gemm(torch.randn(600 + i, 256), w)
    if i == 63:
        rss = proc.memory_info().rss
    elif i > 63:
        new += 1
        if time.monotonic() - start > float(sys.argv[2]):
            break
print(new, (proc.memory_info().rss - rss) / 2**20, time.monotonic() - start)
"""


def test_bounded_caches_keep_new_shapes_from_growing_memory(monkeypatch):
    """GEMMs at new token counts after 64: with the caches at their 1024-entry defaults resident memory grows by
    ~0.57 MB a shape (one JIT kernel and scratchpad kept per shape; 193 MB over 336 shapes), bounded by
    ``bound_onednn_caches`` by ~1 MB in all. Each arm in its own process, since oneDNN reads the capacities once; the
    unbounded arm shows the test can fail. An arm takes no new shape after 60 s: 400 shapes take 4.3 s on AMD EPYC,
    but on a CI machine of another kind the bounded arm ran past 120 s, so the default arm's figure is per new shape,
    with at least 32 new shapes required of each arm."""
    import subprocess
    import sys

    from helpers import REPO, test_env

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    assert onednn.bound_onednn_caches() == {v: "64" for v in onednn._CACHE_VARS}
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    assert onednn.bound_onednn_caches() == {} and onednn.os.environ["LRU_CACHE_CAPACITY"] == "7"  # the user's kept
    # glibc serving the product's outputs by mmap keeps heap fragmentation out of the figure (it added 0-140 MB)
    env = {k: v for k, v in test_env(MALLOC_MMAP_THRESHOLD_="65536").items() if k not in onednn._CACHE_VARS}
    grown = {}
    for arm in ("bounded", "default"):
        out = subprocess.run([sys.executable, "-c", _SHAPES_WORKER, arm, "60"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        new, mb, seconds = out.stdout.split()[-3:]
        grown[arm] = (int(new), float(mb), float(seconds))
    assert min(g[0] for g in grown.values()) >= 32, grown  # too few new shapes for the figures to mean much
    # measured on AMD EPYC, 336 new shapes each in 4.3 s: bounded 0.54 MB in all, default 193 MB = 0.57 MB a shape
    assert grown["bounded"][1] < 16 and grown["default"][1] / grown["default"][0] > 0.25, grown


@pytest.mark.parametrize("fn,dtype", [(onednn.MainGradLinear, torch.float32), (onednn.Fp32GemmLinear, torch.bfloat16)])
def test_tied_weight_placeholder_is_zeros(fn, dtype, monkeypatch):
    """An LM head tied to the embedding (megatron's ``zero_out_wgrad``): its ``.grad`` is the placeholder plus the
    lookup's gradient, which DDP's hook adds to ``main_grad``, so the placeholder must be zeros. Before: an
    uninitialized tensor, and a tied SmolLM2-style model trained in bf16 on CPU skipped every update (NaN grad
    norm) under the default bf16-by-fp32-GEMM path."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(7, 12, generator=gen).to(dtype).requires_grad_()
    w.main_grad, w.grad_added_to_main_grad, w.zero_out_wgrad = torch.zeros(7, 12), False, True
    ids = torch.tensor([1, 3, 3])
    h = torch.nn.functional.embedding(ids, w)  # (3, 12): the lookup
    x = torch.randn(4, 12, generator=gen).to(dtype)
    g = torch.randn(4, 7, generator=gen).to(dtype)
    with monkeypatch.context() as m:  # uninitialized memory at its worst (fresh small blocks are often zeros)
        m.setattr(torch, "empty", lambda shape, dtype=None: torch.full(shape, float("nan"), dtype=dtype))
        (fn.apply(x, w, None) * g).sum().add(h.float().sum()).backward()
    lookup = torch.zeros(7, 12, dtype=dtype).index_add_(0, ids, torch.ones(3, 12, dtype=dtype))
    assert torch.equal(w.grad, lookup)  # the placeholder added nothing
    torch.testing.assert_close(w.main_grad.double(), g.double().T @ x.double(), atol=1e-5, rtol=1e-5)
