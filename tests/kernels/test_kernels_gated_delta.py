"""The Gated DeltaNet twins (rlhf.kernels.gated_delta): the chunked gated delta rule against the one-token-at-a-time
definition in fp64 and against transformers' own torch path; packed streams against each sequence alone, with the
control (the state or the convolution's window carried across the boundary) failing; the dispatch named in the log.

Measured on this project's 2-core CPU, 2026-12-02: chunked fp32 vs the fp64 recurrence within 8e-7 (outputs of about
0.35), gradients within 2e-6; equal to transformers' torch path bit for bit.
"""
from __future__ import annotations

import logging

import pytest
import torch

from rlhf.kernels import gated_delta as gd

FP32_TOL = dict(atol=5e-6, rtol=1e-5)


def _inputs(b, t, h, dk, dv, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = gd.l2norm(torch.randn(b, t, h, dk, generator=g, dtype=dtype))
    k = gd.l2norm(torch.randn(b, t, h, dk, generator=g, dtype=dtype))
    v = torch.randn(b, t, h, dv, generator=g, dtype=dtype)
    decay = -torch.rand(b, t, h, generator=g, dtype=dtype) * 0.5  # exp(g) in (0.6, 1]: the state carries far
    beta = torch.rand(b, t, h, generator=g, dtype=dtype)
    return q, k, v, decay, beta


@pytest.mark.parametrize("b,t,h,dk,dv,chunk", [(2, 150, 3, 16, 8, 64), (1, 5, 2, 8, 8, 64), (1, 33, 1, 4, 16, 16)])
def test_chunked_equals_fp64_recurrence(b, t, h, dk, dv, chunk):
    x = _inputs(b, t, h, dk, dv)
    init = torch.randn(b, h, dk, dv, dtype=torch.float64) * 0.1
    ref, ref_state = gd.recurrent_gated_delta_rule(*x, initial_state=init)
    leaves = [y.float().requires_grad_(True) for y in x]
    out, state = gd.torch_chunk_gated_delta_rule(*leaves, initial_state=init.float(), output_final_state=True,
                                                 chunk_size=chunk)
    torch.testing.assert_close(out.double(), ref, **FP32_TOL)
    torch.testing.assert_close(state.double(), ref_state, **FP32_TOL)
    # gradients of every input, against autograd through the fp64 recurrence
    w = torch.randn_like(ref)
    (out.double() * w).sum().backward()
    ref_leaves = [y.clone().requires_grad_(True) for y in x]
    (gd.recurrent_gated_delta_rule(*ref_leaves, initial_state=init)[0] * w).sum().backward()
    for name, a, r in zip(("q", "k", "v", "g", "beta"), leaves, ref_leaves):
        torch.testing.assert_close(a.grad.double(), r.grad, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_chunked_equals_transformers_torch_path():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, decay, beta = (y.float() for y in _inputs(2, 150, 3, 16, 8, seed=1))
    ours = gd.torch_chunk_gated_delta_rule(q, k, v, decay, beta, use_qk_l2norm_in_kernel=True)[0]
    ref = hf.torch_chunk_gated_delta_rule(q, k, v, decay, beta, use_qk_l2norm_in_kernel=True)[0]
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    x = torch.randn(2, 10, 30)
    w, bias = torch.randn(10, 4), torch.randn(10)
    torch.testing.assert_close(gd.causal_conv1d(x, w, bias), hf.causal_conv1d_fn(x, w, bias, activation="silu"))


LENGTHS = [40, 1, 75, 0, 9]


def _cu():
    return torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])


def test_packed_delta_rule_restarts_state_at_each_boundary():
    cu = _cu()
    x = [y.float() for y in _inputs(1, int(cu[-1]), 2, 8, 8, seed=2)]
    packed, states = gd.torch_chunk_gated_delta_rule(*x, cu_seqlens=cu, output_final_state=True)
    carried = gd.torch_chunk_gated_delta_rule(*x)[0]  # the control: one sequence over the boundaries
    leak = 0.0
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if hi == lo:
            continue
        alone, state = gd.torch_chunk_gated_delta_rule(*(y[:, lo:hi] for y in x), output_final_state=True)
        torch.testing.assert_close(packed[:, lo:hi], alone, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(states[i: i + 1], state, atol=1e-6, rtol=1e-6)
        leak = max(leak, (carried[:, lo:hi] - alone).abs().max().item())
    assert leak > 1e-2


def test_packed_conv_restarts_window_at_each_boundary():
    cu = _cu()
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(1, 6, int(cu[-1]), generator=g), torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    packed = gd.causal_conv1d(x, w, b, cu_seqlens=cu)
    carried = gd.causal_conv1d(x, w, b)
    leak = 0.0
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if hi == lo:
            continue
        alone = gd.causal_conv1d(x[..., lo:hi], w, b)
        torch.testing.assert_close(packed[..., lo:hi], alone, atol=1e-6, rtol=1e-6)
        leak = max(leak, (carried[..., lo:hi] - alone).abs().max().item())
    assert leak > 1e-2


def test_dispatch_is_named_once_in_the_log(caplog, monkeypatch):
    monkeypatch.setattr(gd, "_LOGGED", set())
    q, k, v, decay, beta = (y.float() for y in _inputs(1, 8, 1, 4, 4))
    with caplog.at_level(logging.INFO, logger=gd.__name__):
        for _ in range(2):
            gd.chunk_gated_delta_rule(q, k, v, decay, beta)
    lines = [r.getMessage() for r in caplog.records if "gated delta rule" in r.getMessage()]
    assert lines == ["gated delta rule: torch twin (rlhf.kernels.gated_delta; fla needs CUDA)"]
    assert gd.gated_delta_backend(q) == "torch"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_gets_the_dtypes_it_takes(monkeypatch, dtype):
    """fla's chunk_gated_delta_rule (fla/ops/gated_delta_rule/chunk.py, fla-org/flash-linear-attention at 0315a70)
    asserts ``q.dtype == k.dtype == v.dtype`` and ``q.dtype != torch.float32``; the layer hands over fp32 q and k
    (l2-normed in fp32) and v in the model's dtype. A stand-in with fla's asserts, dispatched to as on CUDA."""
    calls = []

    def fake_fla(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
                 use_qk_l2norm_in_kernel=False):
        assert q.dtype == k.dtype == v.dtype
        assert q.dtype != torch.float32, "ChunkGatedDeltaRuleFunction does not support float32"
        calls.append(q.dtype)
        return gd.torch_chunk_gated_delta_rule(q, k, v, g, beta)[0], None

    monkeypatch.setattr(gd, "gated_delta_backend", lambda x: "fla")
    monkeypatch.setattr(gd, "_fla", lambda: fake_fla)
    q, k, v, decay, beta = (y.float() for y in _inputs(1, 8, 2, 4, 4))
    out = gd.chunk_gated_delta_rule(q, k, v.to(dtype), decay, beta.to(dtype))
    assert calls == ([torch.bfloat16] if dtype == torch.bfloat16 else [])  # fp32: the twin, named in the log
    assert out.shape == v.shape and torch.isfinite(out.float()).all()
