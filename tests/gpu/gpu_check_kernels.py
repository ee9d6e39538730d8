"""The kernel checks of ``tests/gpu/gpu_check.py`` (part ``fp32``): the kernels at real shapes, fp32 and bf16, forward
and backward, against fp64 references, with times against plain torch. GPU only; ``report(name, ok, detail,
figures)`` is the check's reporter."""
from __future__ import annotations

import time
from typing import Callable

Report = Callable[..., None]


def timed(fn, reps: int = 5) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def check_logprobs(report: Report) -> None:
    import torch

    import rlhf.kernels as kernels

    N, V, H, T = 4096, 32000, 1024, 0.8
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = (torch.randn(N, V, device="cuda", generator=g) * 3).to(dtype).requires_grad_(True)
        targets = torch.randint(0, V, (N,), device="cuda", generator=g)
        lp = kernels.token_logprobs(logits, targets, temperature=T)
        ref = torch.log_softmax(logits.detach().double() / T, -1).gather(-1, targets[:, None])[:, 0]
        err = (lp.double() - ref).abs().max().item()
        lp.sum().backward()
        ref_grad = torch.autograd.grad(torch.log_softmax(logits.double() / T, -1).gather(-1, targets[:, None]).sum(),
                                       logits)[0]
        gerr = (logits.grad.double() - ref_grad.double()).abs().max().item()
        t_k = timed(lambda: kernels.token_logprobs(logits.detach(), targets, temperature=T))
        t_t = timed(lambda: torch.log_softmax(logits.detach().float() / T, -1).gather(-1, targets[:, None]))
        report(f"kernels.token_logprobs[{str(dtype)[6:]}]", err < tol and gerr < tol,
               f"N={N} V={V}: max|lp-ref|={err:.1e} max|grad-ref|={gerr:.1e}; {t_k * 1e3:.2f} ms vs torch "
               f"log_softmax {t_t * 1e3:.2f} ms", figures=dict(max_err=err, max_grad_err=gerr, ms=t_k * 1e3,
                                                                torch_ms=t_t * 1e3))
        hidden = (torch.randn(N, H, device="cuda", generator=g)).to(dtype).requires_grad_(True)
        weight = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5).to(dtype).requires_grad_(True)
        flp = kernels.fused_linear_logprobs(hidden, weight, targets, temperature=T)
        fref = torch.log_softmax((hidden.detach().double() @ weight.detach().double().T) / T, -1)
        ferr = (flp.double() - fref.gather(-1, targets[:, None])[:, 0]).abs().max().item()
        flp.sum().backward()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        kernels.fused_linear_logprobs(hidden.detach(), weight.detach(), targets, temperature=T)
        extra = (torch.cuda.max_memory_allocated() - base) / 2**20
        ok = ferr < tol * 5 and torch.isfinite(hidden.grad).all().item() and torch.isfinite(weight.grad).all().item()
        report(f"kernels.fused_linear_logprobs[{str(dtype)[6:]}]", bool(ok),
               f"N={N} H={H} V={V}: max|lp-ref|={ferr:.1e}, forward extra memory {extra:.0f} MiB (full logits "
               f"{N * V * 4 / 2**20:.0f} MiB in fp32)", figures=dict(max_err=ferr, forward_extra_mib=extra))


def _attention_reference(q, k, v, cu, scale):
    import torch

    out = torch.empty_like(q, dtype=torch.float64)
    rep = q.shape[1] // k.shape[1]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = q[s:e].double(), k[s:e].double().repeat_interleave(rep, 1), v[s:e].double().repeat_interleave(
            rep, 1)
        att = torch.einsum("thd,shd->hts", qs, ks) * scale
        mask = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        out[s:e] = torch.einsum("hts,shd->thd", att, vs)
    return out


def check_varlen_attention(report: Report) -> None:
    import torch

    import rlhf.kernels as kernels

    lengths = [1024, 517, 63, 1, 300]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    T = int(cu[-1])
    for d in (64, 128):
        for dtype, tol in ((torch.float32, 2e-4), (torch.bfloat16, 3e-2)):
            g = torch.Generator(device="cuda").manual_seed(d)
            q = torch.randn(T, 8, d, device="cuda", generator=g).to(dtype).requires_grad_(True)
            k = torch.randn(T, 2, d, device="cuda", generator=g).to(dtype).requires_grad_(True)  # GQA 4:1
            v = torch.randn(T, 2, d, device="cuda", generator=g).to(dtype).requires_grad_(True)
            scale = d ** -0.5
            out = kernels.varlen_attention(q, k, v, cu, max(lengths), softmax_scale=scale)
            ref = _attention_reference(q.detach(), k.detach(), v.detach(), cu, scale)
            err = (out.double() - ref).abs().max().item()
            out.float().pow(2).sum().backward()
            qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
            _attention_reference(qd, kd, vd, cu, scale).pow(2).sum().backward()
            gerr = max((a.grad.double() - b.grad).abs().max().item() / max(b.grad.abs().max().item(), 1e-6)
                       for a, b in ((q, qd), (k, kd), (v, vd)))
            t_k = timed(lambda: kernels.varlen_attention(q.detach(), k.detach(), v.detach(), cu, max(lengths),
                                                         softmax_scale=scale))
            path = kernels._select("varlen_attention", q, fast_paths=kernels.varlen_fast_paths(q.dtype))
            report(f"kernels.varlen_attention[d{d},{str(dtype)[6:]}]", err < tol and gerr < tol * 10,
                   f"{path} path, T={T} seqs={lengths} GQA 8:2: max|out-ref|={err:.1e}, max relative grad error "
                   f"{gerr:.1e}; "
                   f"{t_k * 1e3:.2f} ms", figures=dict(max_err=err, max_rel_grad_err=gerr, ms=t_k * 1e3))


def check_gated_delta(report: Report) -> None:
    """The Gated DeltaNet kernels' CUDA paths (flash-linear-attention's ``chunk_gated_delta_rule``, causal-conv1d's
    ``causal_conv1d_fn``) against the torch twins, on a packed stream and from an initial state (the decode cache).
    A package that does not import is reported as not checked (a failed check: the path ran nowhere)."""
    import torch

    from rlhf.kernels import gated_delta as gd

    lengths = [300, 1, 77, 512]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    T, H, dk, dv = int(cu[-1]), 4, 128, 128
    g0 = torch.Generator(device="cuda").manual_seed(0)
    q = gd.l2norm(torch.randn(1, T, H, dk, device="cuda", generator=g0))
    k = gd.l2norm(torch.randn(1, T, H, dk, device="cuda", generator=g0))
    v = torch.randn(1, T, H, dv, device="cuda", generator=g0)
    g = -torch.rand(1, T, H, device="cuda", generator=g0) * 0.3
    beta = torch.rand(1, T, H, device="cuda", generator=g0)
    ref, _ = gd.torch_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    if gd._fla() is None:
        report("kernels.chunk_gated_delta_rule[fla]", False, "flash-linear-attention does not import: not checked")
    else:
        out = gd.chunk_gated_delta_rule(q, k, v.bfloat16(), g, beta, cu_seqlens=cu)
        err = (out.float() - ref.float()).abs().max().item()
        state = torch.randn(1, H, dk, dv, device="cuda", generator=g0) * 0.1
        o1, s1 = gd.gated_delta_rule_with_state(q[:, :64], k[:, :64], v[:, :64].bfloat16(), g[:, :64], beta[:, :64],
                                                state)
        r1, rs = gd.torch_chunk_gated_delta_rule(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64],
                                                 initial_state=state, output_final_state=True)
        serr = max((o1.float() - r1.float()).abs().max().item(), (s1 - rs).abs().max().item())
        report("kernels.chunk_gated_delta_rule[fla,bf16]", err < 5e-2 and serr < 5e-2,
               f"packed T={T} seqs={lengths}: max|fla-twin|={err:.1e}; from a state: {serr:.1e}",
               figures=dict(max_err=err, state_err=serr))
    x = torch.randn(1, 256, T, device="cuda", generator=g0)
    w = torch.randn(256, 4, device="cuda", generator=g0) * 0.5
    b = torch.randn(256, device="cuda", generator=g0) * 0.1
    if gd._causal_conv1d_pkg() is None:
        report("kernels.causal_conv1d[causal-conv1d]", False, "causal-conv1d does not import: not checked")
        return
    import os

    out = gd.causal_conv1d(x, w, b, activation="silu", cu_seqlens=cu)
    os.environ["RLHF_KERNELS_FORCE_TORCH"] = "1"
    try:
        twin = gd.causal_conv1d(x, w, b, activation="silu", cu_seqlens=cu)
    finally:
        del os.environ["RLHF_KERNELS_FORCE_TORCH"]
    err = (out - twin).abs().max().item()
    report("kernels.causal_conv1d[causal-conv1d,fp32]", err < 1e-4, f"packed T={T}: max|pkg-twin|={err:.1e}",
           figures=dict(max_err=err))
