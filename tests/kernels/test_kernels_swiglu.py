"""kernels.swiglu against megatron's unfused MLP activation (the same bits, forward and backward, fp32 and bf16)
and against fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhf.kernels.swiglu import swiglu


def _unfused(y):  # megatron-core 0.16.1 mlp.py's glu with glu_linear_offset 0.0
    a, b = torch.chunk(y, 2, dim=-1)
    return F.silu(a) * (b + 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_bits_and_fp64(dtype):
    gen = torch.Generator().manual_seed(4)
    y = (torch.randn(37, 1, 2 * 48, generator=gen) * 3).to(dtype)
    g = torch.randn(37, 1, 48, generator=gen).to(dtype)
    outs = []
    for fn in (swiglu, _unfused):
        leaf = y.clone().requires_grad_(True)
        out = fn(leaf)
        out.backward(g)
        outs.append((out.detach(), leaf.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    y64 = y.double().requires_grad_(True)
    ref = _unfused(y64)
    ref.backward(g.double())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(outs[0][0].double(), ref.detach(), **tol)
    torch.testing.assert_close(outs[0][1].double(), y64.grad, **tol)
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(torch.zeros(2, 3))


def test_megatron_mlp_runs_it(monkeypatch):
    """transformer_config turns the fused activation on for dense local-spec models only, and megatron's MLP then
    calls kernels.swiglu; RLHF_SWIGLU_IMPL=megatron turns it off, anything else is refused."""
    from megatron.core.transformer import mlp

    import rlhf.kernels.swiglu as ks
    from rlhf.compat.megatron import swiglu_function
    from rlhf.models.gpt import fused_swiglu
    from rlhf.models.spec import spec_from_hf_config

    dense = spec_from_hf_config(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    assert fused_swiglu(dense, use_te=False) and not fused_swiglu(dense, use_te=True)
    swiglu_function()
    calls, real = [], ks.SwiGLUFunction
    monkeypatch.setattr(ks, "SwiGLUFunction", type("Spy", (), {
        "apply": staticmethod(lambda y: calls.append(y.shape) or real.apply(y))}))
    y = torch.randn(5, 2, 16)
    assert torch.equal(mlp.bias_swiglu_impl(y, None), _unfused(y)) and calls
    monkeypatch.setenv("RLHF_SWIGLU_IMPL", "megatron")
    assert not fused_swiglu(dense, use_te=False)
    monkeypatch.setenv("RLHF_SWIGLU_IMPL", "fused")
    with pytest.raises(ValueError, match="RLHF_SWIGLU_IMPL"):
        fused_swiglu(dense, use_te=False)
