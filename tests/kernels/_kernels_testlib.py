"""Naive references and input builders shared by the tests in this folder and their child processes.

Deliberately independent of `kernels.reference`: plain log_softmax / explicit attention math on a padded batch.
"""

from __future__ import annotations

import torch

# Forward outputs are computed in fp32 from the given logits for every dtype, so they are tight for bf16
# too; gradients come back in the input dtype, so bf16 grads carry bf16 rounding.
FWD_TOL = dict(atol=2e-5, rtol=2e-5)
GRAD_TOL = {torch.float32: dict(atol=2e-6, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=2e-2)}
ATTN_TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def naive_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int | None = None):
    """log_softmax(logits / T).gather(targets) and -sum p log p, in fp64, padding columns dropped."""
    x = logits.double()[..., :vocab_size] / temperature
    logp = torch.log_softmax(x, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def grads_of(fn, inputs, grad_lp, grad_ent):
    """Run fn(*leaf copies of inputs) -> (logprobs, entropy); backward with the given upstream grads."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    lp, ent = fn(*inputs)
    loss = 0
    if grad_lp is not None:
        loss = loss + (lp.double() * grad_lp).sum()
    if grad_ent is not None:
        loss = loss + (ent.double() * grad_ent).sum()
    loss.backward()
    return lp.detach(), ent.detach(), [t.grad for t in inputs]


def packed_qkv(lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    """Random packed q `[T, Hq, D]`, k, v `[T, Hkv, D]`, a grad for the output, and int32 cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    grad_out = torch.randn(t, hq, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], dtype=torch.int32)
    return q, k, v, grad_out, cu


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float | None = None):
    """Right-pad the packed sequences to `[B, H, L, D]` and run explicit causal + key-padding attention in fp64.

    Returns the packed `[T, Hq, D]` output (padding rows dropped), differentiable wrt q, k, v.
    """
    lens = (cu[1:] - cu[:-1]).tolist()
    b, lmax, (_, hq, d), hkv = len(lens), max(lens), q.shape, k.shape[1]
    scale = d**-0.5 if scale is None else scale
    mask = torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None]  # (B, L) real tokens

    def pad(x):  # (T, H, D) -> (B, H, L, D) fp64
        out = x.new_zeros(b, lmax, *x.shape[1:], dtype=torch.float64)
        out[mask] = x.double()
        return out.transpose(1, 2)

    qp, kp, vp = pad(q), pad(k), pad(v)
    kp, vp = (x.repeat_interleave(hq // hkv, dim=1) for x in (kp, vp))  # GQA: share kv heads
    scores = qp @ kp.transpose(-1, -2) * scale  # (B, H, L, L)
    causal = torch.ones(lmax, lmax, dtype=torch.bool).tril()
    allowed = causal[None, None] & mask[:, None, None, :]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = (probs @ vp).transpose(1, 2)  # (B, L, H, D)
    return out[mask]
