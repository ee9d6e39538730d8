"""token_logprobs / fused_linear_logprobs (torch path) against naive log_softmax + gather + entropy."""

from __future__ import annotations

import logging

import pytest
import torch

import rlhf.kernels as kernels
from _kernels_testlib import FWD_TOL, GRAD_TOL
from _kernels_testlib import grads_of as _grads
from _kernels_testlib import naive_logprobs as naive


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,v,vocab_size", [(1, 7, None), (37, 101, 90), (64, 1000, None)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_naive(dtype, n, v, vocab_size, temperature):
    g = torch.Generator().manual_seed(n + v)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    if vocab_size is not None:
        logits[:, vocab_size:] = 50.0  # padding columns must not leak into the softmax
    targets = torch.randint(0, vocab_size or v, (n,), generator=g)
    grad_lp, grad_ent = torch.randn(n, generator=g).double(), torch.randn(n, generator=g).double()

    lp, ent, (grad,) = _grads(
        lambda x: kernels.token_logprobs(x, targets, temperature=temperature, return_entropy=True,
                                         vocab_size=vocab_size, chunk_size=16),
        [logits], grad_lp, grad_ent)
    ref_lp, ref_ent, (ref_grad,) = _grads(lambda x: naive(x, targets, temperature, vocab_size),
                                          [logits.double()], grad_lp, grad_ent)

    assert lp.dtype == ent.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(lp.double(), ref_lp, **FWD_TOL)
    torch.testing.assert_close(ent.double(), ref_ent, **FWD_TOL)
    torch.testing.assert_close(grad.double(), ref_grad, **GRAD_TOL[dtype])
    if vocab_size is not None:
        assert torch.all(grad[:, vocab_size:] == 0)


@pytest.mark.parametrize("which", ["logprobs", "entropy"])
def test_grad_through_one_output(which):
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(9, 50, generator=g), torch.randint(0, 50, (9,), generator=g)
    gl = torch.randn(9, generator=g).double() if which == "logprobs" else None
    ge = torch.randn(9, generator=g).double() if which == "entropy" else None
    *_, (grad,) = _grads(lambda x: kernels.token_logprobs(x, targets, return_entropy=True), [logits], gl, ge)
    *_, (ref,) = _grads(lambda x: naive(x, targets, 1.0), [logits.double()], gl, ge)
    torch.testing.assert_close(grad.double(), ref, **GRAD_TOL[torch.float32])


def test_logprobs_only_and_leading_dims():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 33, generator=g, requires_grad=True)
    targets = torch.randint(0, 33, (2, 5), generator=g)
    lp = kernels.token_logprobs(logits, targets, temperature=0.5)
    assert lp.shape == (2, 5)
    lp.sum().backward()
    ref = logits.detach().clone().requires_grad_(True)
    ref_lp = torch.log_softmax(ref / 0.5, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_lp.sum().backward()
    torch.testing.assert_close(lp, ref_lp, **FWD_TOL)
    torch.testing.assert_close(logits.grad, ref.grad, **GRAD_TOL[torch.float32])


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_chunk_size_does_not_change_results(chunk_size):
    g = torch.Generator().manual_seed(2)
    logits, targets = torch.randn(10, 64, generator=g), torch.randint(0, 64, (10,), generator=g)
    gl, ge = torch.randn(10, generator=g).double(), torch.randn(10, generator=g).double()
    out = _grads(lambda x: kernels.token_logprobs(x, targets, return_entropy=True, chunk_size=chunk_size),
                 [logits], gl, ge)
    ref = _grads(lambda x: kernels.token_logprobs(x, targets, return_entropy=True), [logits], gl, ge)
    for a, b in zip((out[0], out[1], out[2][0]), (ref[0], ref[1], ref[2][0])):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("keep", [True, False], ids=["logits_kept", "recomputed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,h,v,vocab_size,chunk_size", [
    (13, 16, 70, 64, 4), (32, 24, 200, None, None),
    # 1M-logit cache blocks of 13 rows inside chunks of 16 (13 + 3; the last chunk of 14: 13 + 1), padded vocab
    (30, 8, 75000, 74990, 16)])
def test_fused_linear_matches_naive(dtype, n, h, v, vocab_size, chunk_size, keep, monkeypatch):
    """Both backwards: from the logits the CPU forward kept, and recomputed (past FUSED_CPU_KEEP_BYTES)."""
    from rlhf.kernels import logprobs

    if not keep:
        monkeypatch.setattr(logprobs, "FUSED_CPU_KEEP_BYTES", 0)
    assert logprobs.default_chunk_rows(75000, logprobs.TORCH_OPS.chunk_elems) == 13
    g = torch.Generator().manual_seed(n * h)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    targets = torch.randint(0, vocab_size or v, (n,), generator=g)
    gl, ge = torch.randn(n, generator=g).double(), torch.randn(n, generator=g).double()

    lp, ent, (gh, gw) = _grads(
        lambda x, w: kernels.fused_linear_logprobs(x, w, targets, temperature=0.8, return_entropy=True,
                                                   chunk_size=chunk_size, vocab_size=vocab_size),
        [hidden, weight], gl, ge)
    ref_lp, ref_ent, (ref_gh, ref_gw) = _grads(lambda x, w: naive(x @ w.t(), targets, 0.8, vocab_size),
                                               [hidden.double(), weight.double()], gl, ge)
    assert gh.dtype == gw.dtype == dtype
    # bf16 logits are rounded before the softmax here, so the forward is only bf16-accurate.
    fwd_tol = FWD_TOL if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(lp.double(), ref_lp, **fwd_tol)
    torch.testing.assert_close(ent.double(), ref_ent, **fwd_tol)
    grad_tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(gh.double(), ref_gh, **grad_tol)
    torch.testing.assert_close(gw.double(), ref_gw, **grad_tol)
    if vocab_size is not None:
        assert torch.all(gw[vocab_size:] == 0)


def test_fused_linear_second_backward_recomputes():
    """The kept logits are overwritten by the first backward; a second one (retain_graph) recomputes them."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(9, 8, generator=g, requires_grad=True)
    weight = torch.randn(30, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 30, (9,), generator=g)
    lp, ent = kernels.fused_linear_logprobs(hidden, weight, targets, chunk_size=4, return_entropy=True)
    loss = lp.sum() + 0.3 * ent.sum()
    first = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight))
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_fused_linear_weight_only_grad():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 8, generator=g)
    weight = torch.randn(20, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 20, (6,), generator=g)
    kernels.fused_linear_logprobs(hidden, weight, targets, chunk_size=4).sum().backward()
    ref_w = weight.detach().clone().requires_grad_(True)
    torch.log_softmax(hidden @ ref_w.t(), -1).gather(1, targets[:, None]).sum().backward()
    torch.testing.assert_close(weight.grad, ref_w.grad, atol=1e-5, rtol=1e-5)


def test_user_errors():
    logits, targets = torch.randn(4, 10), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="--temperature"):
        kernels.token_logprobs(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="leading dims"):
        kernels.token_logprobs(logits, targets[:3])
    with pytest.raises(ValueError, match="vocab_size"):
        kernels.token_logprobs(logits, targets, vocab_size=11)
    with pytest.raises(ValueError, match="V_local, H"):
        kernels.fused_linear_logprobs(torch.randn(4, 3), torch.randn(10, 5), targets)


def test_dispatch_logs_path_once(caplog, monkeypatch):
    monkeypatch.setattr(kernels, "_logged", set())
    logits, targets = torch.randn(3, 8), torch.zeros(3, dtype=torch.long)
    with caplog.at_level(logging.INFO, logger="rlhf.kernels"):
        kernels.token_logprobs(logits, targets)
        kernels.token_logprobs(logits, targets)
    msgs = [r.getMessage() for r in caplog.records if "token_logprobs" in r.getMessage()]
    assert msgs == ["kernels.token_logprobs: using the torch path (cpu tensors)"]


def test_env_switches(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.setenv("RLHF_KERNELS_FORCE_TORCH", "1")
    monkeypatch.setenv("RLHF_KERNELS_FORCE_TRITON", "1")
    assert kernels._select("token_logprobs", cpu) == "torch"  # FORCE_TORCH wins
    monkeypatch.delenv("RLHF_KERNELS_FORCE_TORCH")
    if not kernels._importable("triton"):  # only looks for triton, never imports it
        with pytest.raises(RuntimeError, match="not installed"):
            kernels._select("token_logprobs", cpu)
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels._select("token_logprobs", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # _select only reads it
    assert kernels._select("token_logprobs", cpu) == "triton"


def _inplace_grads(logits, targets, gl, ge, **kw):
    """token_logprobs(inplace_backward=True) on a non-leaf copy of `logits` (as a model output would be).

    Returns (logprobs, entropy, grad wrt the leaf, whether the grad reaching the non-leaf shares its storage)."""
    leaf = logits.detach().clone().requires_grad_(True)
    x = leaf * 1.0  # MulBackward with a Python scalar saves nothing: x is read by the kernel only
    seen = []
    x.register_hook(lambda g: seen.append(g.data_ptr() == x.data_ptr()))
    lp, ent = kernels.token_logprobs(x, targets, return_entropy=True, inplace_backward=True, **kw)
    loss = 0
    if gl is not None:
        loss = loss + (lp.double() * gl).sum()
    if ge is not None:
        loss = loss + (ent.double() * ge).sum()
    loss.backward()
    return lp.detach(), ent.detach(), leaf.grad, seen == [True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,v,vocab_size,chunk_size", [(1, 7, None, None), (37, 101, 90, 16), (64, 1000, None, 5)])
@pytest.mark.parametrize("grads", ["both", "logprobs", "entropy"])
def test_inplace_backward_matches_reference(dtype, n, v, vocab_size, chunk_size, grads):
    g = torch.Generator().manual_seed(n + v + 1)
    logits = (torch.randn(n, v, generator=g) * 3).to(dtype)
    if vocab_size is not None:
        logits[:, vocab_size:] = 50.0
    targets = torch.randint(0, vocab_size or v, (n,), generator=g)
    gl = torch.randn(n, generator=g).double() if grads != "entropy" else None
    ge = torch.randn(n, generator=g).double() if grads != "logprobs" else None
    kw = dict(temperature=0.7, vocab_size=vocab_size, chunk_size=chunk_size)

    lp, ent, grad, aliased = _inplace_grads(logits, targets, gl, ge, **kw)
    assert aliased, "the gradient must come back in the logits' own storage"
    assert grad.dtype == dtype
    ref_lp, ref_ent, (ref_grad,) = _grads(lambda x: naive(x, targets, 0.7, vocab_size), [logits.double()], gl, ge)
    torch.testing.assert_close(lp.double(), ref_lp, **FWD_TOL)
    torch.testing.assert_close(ent.double(), ref_ent, **FWD_TOL)
    torch.testing.assert_close(grad.double(), ref_grad, **GRAD_TOL[dtype])
    # and the same numbers as the default (allocating) backward
    *_, (default,) = _grads(lambda x: kernels.token_logprobs(x, targets, return_entropy=True, **kw), [logits],
                            gl, ge)
    torch.testing.assert_close(grad, default, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5)


def test_inplace_backward_without_upstream_grad_and_leading_dims():
    g = torch.Generator().manual_seed(4)
    leaf = torch.randn(2, 5, 33, generator=g, requires_grad=True)
    targets = torch.randint(0, 33, (2, 5), generator=g)
    lp, ent = kernels.token_logprobs(leaf * 1.0, targets, return_entropy=True, inplace_backward=True)
    assert lp.shape == ent.shape == (2, 5)
    (lp.sum() * 0 + ent.detach().sum()).backward()  # a zero upstream gradient
    assert torch.all(leaf.grad == 0)
    ref = leaf.detach().clone().requires_grad_(True)
    torch.log_softmax(ref, -1).gather(-1, targets.unsqueeze(-1)).sum().backward()
    leaf.grad = None
    kernels.token_logprobs(leaf * 1.0, targets, inplace_backward=True).sum().backward()
    torch.testing.assert_close(leaf.grad, ref.grad, **GRAD_TOL[torch.float32])


def test_inplace_backward_misuse_fails_loudly():
    g = torch.Generator().manual_seed(5)
    leaf = torch.randn(6, 40, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (6,), generator=g)
    with pytest.raises(ValueError, match="not a leaf"):  # its .grad would alias its own data
        kernels.token_logprobs(leaf, targets, inplace_backward=True)
    # Another op saved the same logits and runs its backward after ours: autograd sees the version bump.
    x = leaf * 1.0
    other = (x * x).sum()  # MulBackward saves x
    lp = kernels.token_logprobs(x, targets, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (lp.sum() + other).backward()
    # A second backward through the same graph would recompute from the overwritten logits.
    x = leaf * 1.0
    lp = kernels.token_logprobs(x, targets, inplace_backward=True)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()
    # Without inplace_backward the same graph is fine.
    x = leaf * 1.0
    other = (x * x).sum()
    (kernels.token_logprobs(x, targets).sum() + other).backward()
