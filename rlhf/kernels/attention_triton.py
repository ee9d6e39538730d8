"""Triton flash-attention (forward and backward) over packed variable-length sequences, causal, with GQA.

Layout is THD as in flash-attn's varlen API: q `[T, Hq, D]`, k/v `[T, Hkv, D]`, `cu_seqlens` `[B + 1]`.
The grid is (blocks of max_seqlen, B, heads); a program whose block starts past its sequence's end exits
at once, so work is O(sum L_i^2), never O(T^2). Softmax runs in base 2 (exp2) with the scale folded in.

Backward, as in FlashAttention-2: delta = rowsum(dO * O) (torch), then one kernel for dK/dV per KV head
(looping over the q heads of its GQA group, so no atomics) and one for dQ.

Imported lazily by `kernels`. Runs on CPU only under `TRITON_INTERPRET=1`; there `tl.dot` on bf16 is wrong,
so DOT_FP32 upcasts the operands (it is also how fp32 inputs avoid tf32 on GPUs). Block sizes are sensible
defaults for sm_80/sm_90, not tuned on hardware.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, cu_seqlens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse_h,
    scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    start_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    seq_start = tl.load(cu_seqlens + seq)
    seq_len = tl.load(cu_seqlens + seq + 1) - seq_start
    if start_m * BLOCK_M >= seq_len:
        return
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_len
    d_ok = offs_d < HEAD_DIM
    rows = (seq_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Causal: keys beyond this query block's last row are never needed.
    hi = tl.minimum(seq_len, (start_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < seq_len
        kv_rows = (seq_start + cols).to(tl.int64)
        kT = tl.load(K + kv_rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                     mask=d_ok[:, None] & n_ok[None, :], other=0.0)  # (BLOCK_D, BLOCK_N)
        qk = _dot(q, kT, DOT_FP32) * scale_log2
        # Rows past the sequence end still see key 0, so no row is all -inf (no NaN); they are not stored.
        qk = tl.where((cols[None, :] <= offs_m[:, None]) & n_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + head * stride_lse_h + seq_start + offs_m, m_i + tl.log2(l_i), mask=m_ok)  # base-2 LSE


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, cu_seqlens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lse_h,
    scale_log2, softmax_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    start_m = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    seq_start = tl.load(cu_seqlens + seq)
    seq_len = tl.load(cu_seqlens + seq + 1) - seq_start
    if start_m * BLOCK_M >= seq_len:
        return
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seq_len
    d_ok = offs_d < HEAD_DIM
    rows = (seq_start + offs_m).to(tl.int64)
    md = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=md, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :], mask=md, other=0.0)
    lse = tl.load(LSE + head * stride_lse_h + seq_start + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + head * stride_lse_h + seq_start + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(seq_len, (start_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < seq_len
        kv_rows = (seq_start + cols).to(tl.int64)
        dn = d_ok[:, None] & n_ok[None, :]
        kT = tl.load(K + kv_rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None], mask=dn, other=0.0)
        vT = tl.load(V + kv_rows[None, :] * stride_vt + kv_head * stride_vh + offs_d[:, None], mask=dn, other=0.0)
        qk = _dot(q, kT, DOT_FP32) * scale_log2  # (BLOCK_M, BLOCK_N)
        keep = (cols[None, :] <= offs_m[:, None]) & n_ok[None, :] & m_ok[:, None]
        p = tl.exp2(tl.where(keep, qk - lse[:, None], float("-inf")))
        dp = _dot(do, vT, DOT_FP32)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(kT.dtype), tl.trans(kT), DOT_FP32)
    dq = dq * softmax_scale
    tl.store(DQ + rows[:, None] * stride_dqt + head * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=md)


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, cu_seqlens,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lse_h,
    scale_log2, softmax_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    start_n = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    seq_start = tl.load(cu_seqlens + seq)
    seq_len = tl.load(cu_seqlens + seq + 1) - seq_start
    if start_n * BLOCK_N >= seq_len:
        return
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < seq_len
    d_ok = offs_d < HEAD_DIM
    kv_rows = (seq_start + offs_n).to(tl.int64)
    nd = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + kv_rows[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :], mask=nd, other=0.0)
    v = tl.load(V + kv_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :], mask=nd, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Causal: only queries at or after this key block contribute.
    lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M
    for g in range(GROUP):  # every q head that shares this kv head
        head = kv_head * GROUP + g
        for start_m in range(lo, seq_len, BLOCK_M):
            rows_m = start_m + offs_m
            m_ok = rows_m < seq_len
            rows = (seq_start + rows_m).to(tl.int64)
            qT = tl.load(Q + rows[None, :] * stride_qt + head * stride_qh + offs_d[:, None],
                         mask=d_ok[:, None] & m_ok[None, :], other=0.0)  # (BLOCK_D, BLOCK_M)
            do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + offs_d[None, :],
                         mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
            lse = tl.load(LSE + head * stride_lse_h + seq_start + rows_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + head * stride_lse_h + seq_start + rows_m, mask=m_ok, other=0.0)
            qkT = _dot(k, qT, DOT_FP32) * scale_log2  # (BLOCK_N, BLOCK_M)
            keep = (rows_m[None, :] >= offs_n[:, None]) & m_ok[None, :] & n_ok[:, None]
            pT = tl.exp2(tl.where(keep, qkT - lse[None, :], float("-inf")))
            dv += _dot(pT.to(do.dtype), do, DOT_FP32)
            dpT = _dot(v, tl.trans(do), DOT_FP32)  # (BLOCK_N, BLOCK_M)
            dsT = pT * (dpT - delta[None, :])
            dk += _dot(dsT.to(qT.dtype), tl.trans(qT), DOT_FP32)
    dk = dk * softmax_scale
    tl.store(DK + kv_rows[:, None] * stride_dkt + kv_head * stride_dkh + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=nd)
    tl.store(DV + kv_rows[:, None] * stride_dvt + kv_head * stride_dvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=nd)


def _config(q: Tensor) -> dict:
    """Launch configuration. Under the interpreter: one wide block (it pays per program and per loop iteration).

    On GPUs, (BLOCK_M, BLOCK_N) and num_warps per kernel were chosen so that ptxas reports no register
    spills for sm_90 at D=64 and D=128 (checked ahead of time, not timed on hardware).
    """
    interpret = q.device.type == "cpu"
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    if interpret:
        return dict(BLOCK_D=block_d, DOT_FP32=True, num_warps=1, fwd=(32, 32), dq=(32, 32), dkdv=(32, 32))
    return dict(BLOCK_D=block_d, **_gpu_config(block_d, q.dtype == torch.float32))


def _gpu_config(block_d: int, fp32: bool) -> dict:
    """The GPU tiles for head size ``block_d``; ``AOT_SPECS`` compiles them for sm_90 ahead of time. fp32 at
    D=128 takes a 64-row forward tile: the 128 x 64 one needed 229,888 bytes of shared memory for sm_90 (the SM's
    per-block limit is 232,448), against 49,152 in bf16."""
    wide = block_d >= 128
    fwd = ((64, 64) if fp32 else (128, 64)) if wide else (64, 32)
    return dict(DOT_FP32=fp32, num_warps=8 if wide else 4, fwd=fwd, dq=(64, 32), dkdv=(32, 64))


class VarlenAttentionTriton(torch.autograd.Function):
    """Causal varlen attention; see `kernels.varlen_attention` for the contract."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
        t, hq, d = q.shape
        n_seqs = cu.numel() - 1
        cfg = _config(q)
        o = torch.empty_like(q)
        lse = torch.empty(hq, t, dtype=torch.float32, device=q.device)  # (Hq, T) base-2 log-sum-exp
        bm, bn = cfg["fwd"]
        if t > 0 and n_seqs > 0 and max_seqlen > 0:
            _attn_fwd_kernel[(triton.cdiv(max_seqlen, bm), n_seqs, hq)](
                q, k, v, o, lse, cu,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                o.stride(0), o.stride(1), lse.stride(0),
                float(softmax_scale * math.log2(math.e)),
                GROUP=hq // k.shape[1], HEAD_DIM=d, BLOCK_D=cfg["BLOCK_D"], BLOCK_M=bm, BLOCK_N=bn,
                DOT_FP32=cfg["DOT_FP32"], num_warps=cfg["num_warps"],
            )
        ctx.save_for_backward(q, k, v, o, lse, cu)
        ctx.cfg = (max_seqlen, softmax_scale, cfg)
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o, lse, cu = ctx.saved_tensors
        max_seqlen, softmax_scale, cfg = ctx.cfg
        do = do.contiguous()
        t, hq, d = q.shape
        hkv = k.shape[1]
        n_seqs = cu.numel() - 1
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if t == 0 or n_seqs == 0 or max_seqlen == 0:
            return dq, dk, dv, None, None, None
        delta = (do.float() * o.float()).sum(-1).t().contiguous()  # (Hq, T) rowsum(dO * O)
        common = dict(GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=cfg["BLOCK_D"], DOT_FP32=cfg["DOT_FP32"],
                      num_warps=cfg["num_warps"])
        scales = (float(softmax_scale * math.log2(math.e)), float(softmax_scale))
        bm, bn = cfg["dq"]
        _attn_bwd_dq_kernel[(triton.cdiv(max_seqlen, bm), n_seqs, hq)](
            q, k, v, do, dq, lse, delta, cu,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), lse.stride(0),
            *scales, BLOCK_M=bm, BLOCK_N=bn, **common,
        )
        bm, bn = cfg["dkdv"]
        _attn_bwd_dkdv_kernel[(triton.cdiv(max_seqlen, bn), n_seqs, hkv)](
            q, k, v, do, dk, dv, lse, delta, cu,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0),
            *scales, BLOCK_M=bm, BLOCK_N=bn, **common,
        )
        return dq, dk, dv, None, None, None


def varlen_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, softmax_scale: float
) -> Tensor:
    """q `[T, Hq, D]`, k/v `[T, Hkv, D]`, cu_seqlens `[B + 1]` -> `[T, Hq, D]` (cu_seqlens[-1] must be T)."""
    return VarlenAttentionTriton.apply(q, k, v, cu_seqlens, int(max_seqlen), float(softmax_scale))


def _attn_signature(names: list[str], ptrs: dict[str, str]) -> dict[str, str]:
    sig = {}
    for n in names:
        if n in ptrs:
            sig[n] = ptrs[n]
        elif n.startswith("stride"):
            sig[n] = "i32"
        elif n in ("scale_log2", "softmax_scale"):
            sig[n] = "fp32"
        else:
            sig[n] = "constexpr"
    return sig


def _aot_specs() -> dict:
    """Kernel name -> dict(fn, signature, constexprs, num_warps) of the GPU launches ``_config`` makes at D=128 and
    GQA 4:1, in bf16 and fp32 (fp32: fp32 dots and operands, twice the shared memory per tile).

    tests/kernels compiles each of these for sm_90 ahead of time and checks its shared memory fits the SM.
    """
    specs = {}
    for tag, el, f32dot in (("", "*bf16", False), ("_fp32", "*fp32", True)):
        f32 = "*fp32"
        consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, DOT_FP32=f32dot)
        cfg = _gpu_config(128, f32dot)
        for name, kernel, ptrs, (bm, bn) in (
            ("attn_fwd", _attn_fwd_kernel, dict(Q=el, K=el, V=el, O=el, LSE=f32, cu_seqlens="*i32"), cfg["fwd"]),
            ("attn_bwd_dq", _attn_bwd_dq_kernel,
             dict(Q=el, K=el, V=el, DO=el, DQ=el, LSE=f32, DELTA=f32, cu_seqlens="*i32"), cfg["dq"]),
            ("attn_bwd_dkdv", _attn_bwd_dkdv_kernel,
             dict(Q=el, K=el, V=el, DO=el, DK=el, DV=el, LSE=f32, DELTA=f32, cu_seqlens="*i32"), cfg["dkdv"]),
        ):
            sig = _attn_signature(list(kernel.arg_names), ptrs)
            specs[name + tag] = dict(fn=kernel, signature=sig, constexprs={**consts, "BLOCK_M": bm, "BLOCK_N": bn},
                                     num_warps=cfg["num_warps"])
    return specs


AOT_SPECS = _aot_specs()
