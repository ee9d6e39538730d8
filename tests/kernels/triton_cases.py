"""Triton kernels against naive references; run in a child pytest process by test_kernels_triton.py.

Not collected by the main session (no test_ prefix): on CPU it needs TRITON_INTERPRET=1 and
RLHF_KERNELS_FORCE_TRITON=1 in the environment before triton is imported. KERNELS_TEST_DEVICE=cuda runs the
same cases compiled on a GPU. Shapes are tiny because the interpreter costs ~2 ms per loop iteration per program.
"""

from __future__ import annotations

import os

import pytest
import torch

import rlhf.kernels as kernels
from _kernels_testlib import ATTN_TOL, FWD_TOL, GRAD_TOL, grads_of, naive_logprobs, packed_qkv, padded_attention
from rlhf.kernels import reference

DEVICE = torch.device(os.environ.get("KERNELS_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_kernels_triton.py (needs TRITON_INTERPRET=1)", allow_module_level=True)


def test_dispatch_picks_triton():
    assert kernels._select("token_logprobs", torch.zeros(1, device=DEVICE)) == "triton"
    assert kernels._select("varlen_attention", torch.zeros(1, device=DEVICE)) in (
        "triton", "flash_attn", "torch_flash", "transformer_engine")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("return_entropy", [True, False])
def test_token_logprobs(dtype, return_entropy):
    n, v, vocab_size, temperature = 5, 300, 280, 0.7
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    logits[:, vocab_size:] = 50.0
    targets = torch.randint(0, vocab_size, (n,), generator=g)
    gl, ge = torch.randn(n, generator=g).double(), torch.randn(n, generator=g).double()

    def fn(x):
        out = kernels.token_logprobs(x, targets.to(DEVICE), temperature=temperature, vocab_size=vocab_size,
                                     return_entropy=return_entropy)
        return out if return_entropy else (out, out.new_zeros(n))

    ge_used = ge.to(DEVICE) if return_entropy else None
    lp, ent, (grad,) = grads_of(fn, [logits.to(DEVICE)], gl.to(DEVICE), ge_used)
    ref_lp, ref_ent, (ref_grad,) = grads_of(lambda x: naive_logprobs(x, targets, temperature, vocab_size),
                                            [logits.double()], gl, ge if return_entropy else None)
    torch.testing.assert_close(lp.cpu().double(), ref_lp, **FWD_TOL)
    if return_entropy:
        torch.testing.assert_close(ent.cpu().double(), ref_ent, **FWD_TOL)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.cpu().double(), ref_grad, **GRAD_TOL[dtype])
    assert torch.all(grad[:, vocab_size:] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_inplace_backward(dtype):
    n, v, vocab_size = 5, 300, 280
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab_size, (n,), generator=g)
    gl, ge = torch.randn(n, generator=g).double(), torch.randn(n, generator=g).double()
    leaf = logits.to(DEVICE).requires_grad_(True)
    x = leaf * 1.0  # a non-leaf, read by the kernel only
    seen = []
    x.register_hook(lambda grad: seen.append(grad.data_ptr() == x.data_ptr()))
    lp, ent = kernels.token_logprobs(x, targets.to(DEVICE), temperature=0.7, vocab_size=vocab_size,
                                     return_entropy=True, inplace_backward=True)
    ((lp.double() * gl.to(DEVICE)).sum() + (ent.double() * ge.to(DEVICE)).sum()).backward()
    assert seen == [True], "the gradient must come back in the logits' own storage"
    _, _, (ref_grad,) = grads_of(lambda y: naive_logprobs(y, targets, 0.7, vocab_size), [logits.double()], gl, ge)
    assert leaf.grad.dtype == dtype
    torch.testing.assert_close(leaf.grad.cpu().double(), ref_grad, **GRAD_TOL[dtype])
    # The kernel writes through a raw pointer; the version bump still makes a later reader of x raise.
    x = leaf * 1.0
    other = (x * x).sum()
    lp = kernels.token_logprobs(x, targets.to(DEVICE), inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (lp.sum() + other).backward()


@pytest.mark.parametrize("n_valid", [0, 70, 128])
def test_shard_ops_match_reference(n_valid):
    """The per-shard ops as tensor parallelism calls them: foreign targets (-1), partial and empty shards."""
    from rlhf.kernels.logprobs_triton import logprob_chunk_grad_triton, logprob_chunk_stats_triton

    g = torch.Generator().manual_seed(n_valid)
    logits = torch.randn(4, 128, generator=g).to(DEVICE)
    tloc = torch.tensor([3, -1, min(n_valid, 128) - 1, -1]).clamp(min=-1).to(DEVICE)
    tloc = torch.where(tloc < n_valid, tloc, -1)
    got = logprob_chunk_stats_triton(logits, tloc, n_valid, 0.5, True)
    ref = reference.logprob_chunk_stats(logits, tloc, n_valid, 0.5, True)
    for name in ("s", "u", "tgt") + (("m",) if n_valid else ()):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), atol=1e-5, rtol=1e-5, msg=name)
    if n_valid == 0:
        assert torch.all(got.m == float("-inf"))
    logz, ent = torch.randn(4, generator=g).to(DEVICE) + 5, torch.rand(4, generator=g).to(DEVICE)
    gl, ge = torch.randn(4, generator=g).to(DEVICE), torch.randn(4, generator=g).to(DEVICE)
    args = (tloc, n_valid, 0.5, logz, ent, gl, ge)
    out = logprob_chunk_grad_triton(logits, *args, out=torch.empty_like(logits))
    expected = reference.logprob_chunk_grad(logits, *args, out=torch.empty_like(logits))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # In place (the fused path overwrites each logits chunk with its gradient).
    inplace = logits.clone()
    logprob_chunk_grad_triton(inplace, *args, out=inplace)
    torch.testing.assert_close(inplace, expected, atol=1e-5, rtol=1e-5)


def test_fused_linear_logprobs():
    n, h, v = 6, 16, 200
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / 4
    targets = torch.randint(0, 190, (n,), generator=g)
    gl, ge = torch.randn(n, generator=g).double(), torch.randn(n, generator=g).double()
    lp, ent, (gh, gw) = grads_of(
        lambda x, w: kernels.fused_linear_logprobs(x, w, targets.to(DEVICE), return_entropy=True, chunk_size=4,
                                                   vocab_size=190),
        [hidden.to(DEVICE), weight.to(DEVICE)], gl.to(DEVICE), ge.to(DEVICE))
    ref_lp, ref_ent, (ref_gh, ref_gw) = grads_of(lambda x, w: naive_logprobs(x @ w.t(), targets, 1.0, 190),
                                                 [hidden.double(), weight.double()], gl, ge)
    tol = dict(atol=1e-4, rtol=1e-4)  # tf32 matmuls on GPUs
    for a, b in ((lp, ref_lp), (ent, ref_ent), (gh, ref_gh), (gw, ref_gw)):
        torch.testing.assert_close(a.cpu().double(), b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,hq,hkv,d", [([5, 17, 1, 9], 4, 2, 16), ([3, 0, 40], 2, 1, 24)])
def test_varlen_attention_packed_matches_padded(dtype, lens, hq, hkv, d):
    q, k, v, grad_out, cu = packed_qkv(lens, hq, hkv, d, dtype)
    leaves = [t.to(DEVICE, copy=True).requires_grad_(True) for t in (q, k, v)]
    out = kernels.varlen_attention(*leaves, cu.to(DEVICE), max(lens))
    out.backward(grad_out.to(DEVICE))
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = padded_attention(*ref_leaves, cu)
    ref.backward(grad_out.double())
    tol = ATTN_TOL[dtype]
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        torch.testing.assert_close(out[s:e].cpu().double(), ref[s:e], **tol, msg=lambda m: f"seq {i} out: {m}")
        for name, a, b in zip("qkv", leaves, ref_leaves):
            torch.testing.assert_close(a.grad[s:e].cpu().double(), b.grad[s:e], **tol,
                                       msg=lambda m: f"seq {i} d{name}: {m}")


# --------------------------------------------------------------- the fused layer kernels (rlhf.models.fused)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# bf16 rounds each output once (relative 2^-8); the fp64 reference is exact
LAYER_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_triton_matches_fp64(dtype):
    from rlhf.kernels.swiglu import swiglu
    from rlhf.kernels.swiglu_triton import swiglu_triton

    g = torch.Generator().manual_seed(0)
    y = (torch.randn(3, 5, 2 * 20, generator=g) * 2).to(dtype)
    gout = torch.randn(3, 5, 20, generator=g).to(dtype)
    out, (gy,) = _out_and_grads(swiglu_triton, y, gout)
    ref, (ref_gy,) = _out_and_grads(swiglu, y.double(), gout.double())
    torch.testing.assert_close(out.double(), ref, **LAYER_TOL[dtype])
    torch.testing.assert_close(gy.double(), ref_gy, **LAYER_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_rope_triton_matches_fp64(dtype, strided):
    from rlhf.kernels.rope import rotary_half
    from rlhf.kernels.rope_triton import rope_triton

    s, b, h, d = 7, 2, 3, 16
    g = torch.Generator().manual_seed(1)
    # strided: the query as megatron hands it, a view into a wider fused-QKV tensor
    t = torch.randn(s, b, h + 2 if strided else h, d, generator=g).to(dtype)[:, :, :h] if strided else \
        torch.randn(s, b, h, d, generator=g).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    ang = torch.outer(torch.arange(s).double() + 3, inv)
    freqs = torch.cat([ang, ang], -1)[:, None, None, :]
    gout = torch.randn(s, b, h, d, generator=g).to(dtype)
    out, (gt,) = _out_and_grads(lambda x: rope_triton(x, freqs.float().to(DEVICE), 0.9), t, gout)
    fd = freqs.to(DEVICE)
    ref, (ref_gt,) = _out_and_grads(lambda x: rotary_half(x, fd.cos() * 0.9, fd.sin() * 0.9), t.double(),
                                    gout.double())
    torch.testing.assert_close(out.double(), ref, **LAYER_TOL[dtype])
    torch.testing.assert_close(gt.double(), ref_gt, **LAYER_TOL[dtype])


def _out_and_grads(fn, x, gout):
    """fn(x) and d(sum(fn(x) * gout))/dx, computed on DEVICE, returned on the CPU."""
    x = x.to(DEVICE).requires_grad_(True)
    out = fn(x)
    (grad,) = torch.autograd.grad(out, x, gout.to(DEVICE))
    return out.detach().cpu(), (grad.cpu(),)


@pytest.mark.skipif(INTERPRETED, reason="Liger-Kernel's RMSNorm kernel does not run in Triton's interpreter "
                                        "(AttributeError: 'float' object has no attribute 'to'): GPU only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_rmsnorm_module_matches_fp64(dtype):
    from rlhf.models.fused import FusedRMSNorm

    g = torch.Generator().manual_seed(2)
    norm = torch.nn.RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    x = torch.randn(2, 9, 64, generator=g).to(dtype)
    gout = torch.randn(2, 9, 64, generator=g).to(dtype)
    ref, (ref_gx,) = _out_and_grads(lambda v: torch.nn.functional.rms_norm(v, (64,), norm.weight.double().to(DEVICE),
                                                                           1e-5), x.double(), gout.double())
    norm = norm.to(device=DEVICE, dtype=dtype)
    norm.__class__ = FusedRMSNorm
    out, (gx,) = _out_and_grads(norm, x, gout)
    torch.testing.assert_close(out.double(), ref, **LAYER_TOL[dtype])
    torch.testing.assert_close(gx.double(), ref_gx, **LAYER_TOL[dtype])


@pytest.mark.skipif(INTERPRETED, reason="Liger-Kernel's kernels do not run in Triton's interpreter: GPU only")
def test_head_nll_sum_liger_matches_fp64():
    from rlhf.models import fused

    g = torch.Generator().manual_seed(3)
    n, hdim, v, vocab = 37, 64, 300, 280  # a padded vocabulary: rows 280.. are no classes
    hidden = torch.randn(n, hdim, generator=g).to(DEVICE).requires_grad_(True)
    weight = (torch.randn(v, hdim, generator=g) / 8).to(DEVICE).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=g).to(DEVICE)
    fused.request(True)
    assert fused.enabled(DEVICE)
    loss = fused.head_nll_sum(hidden, weight, targets, vocab_size=vocab)
    loss.backward()
    hd, wd = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(hd @ wd[:vocab].T, targets, reduction="sum")
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(hidden.grad.double(), hd.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(weight.grad.double(), wd.grad, atol=1e-4, rtol=1e-4)
    assert torch.all(weight.grad[vocab:] == 0)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="torch's fp32-output bf16 GEMM (addmm out_dtype) is CUDA's only")
def test_bf16_weight_gradient_accumulates_into_main_grad_on_the_device():
    """The fused part ``wgrad``: two micro-batches' bf16 weight gradients added into the fp32 ``main_grad`` inside
    cuBLAS's GEMM (``rlhf.compat.main_grad``), against fp64; the forward and the input gradient as megatron's own."""
    from rlhf.compat import main_grad

    assert main_grad.bf16_accumulation_works(DEVICE)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 64, generator=g).bfloat16().to(DEVICE).requires_grad_()
    w.main_grad, w.grad_added_to_main_grad = torch.randn(96, 64, generator=g).to(DEVICE), False
    want = w.main_grad.double().cpu()
    for rows in (37, 300):
        x = torch.randn(2, rows, 64, generator=g).bfloat16()
        gy = torch.randn(2, rows, 96, generator=g).bfloat16()
        xd = x.to(DEVICE).requires_grad_()
        y = main_grad.MainGradLinear.apply(xd, w, None)
        y.backward(gy.to(DEVICE))
        want += gy.double().reshape(-1, 96).T @ x.double().reshape(-1, 64)
        wd = w.detach().double().cpu()
        torch.testing.assert_close(y.double().cpu(), x.double() @ wd.T, **LAYER_TOL[torch.bfloat16])
        torch.testing.assert_close(xd.grad.double().cpu(), gy.double() @ wd, **LAYER_TOL[torch.bfloat16])
    assert w.grad_added_to_main_grad
    # fp32 sums of at most 674 exact bf16 products: relative error ~1e-6 of the sums' scale (~25), never bf16's 4e-3
    torch.testing.assert_close(w.main_grad.double().cpu(), want, atol=2e-4, rtol=1e-5)
