"""The gated delta rule and the short causal convolution of Gated DeltaNet layers (Qwen3-Next, Qwen3.5), with
packed sequences.

On CUDA, megatron-core's ``GatedDeltaNet`` calls flash-linear-attention's ``chunk_gated_delta_rule`` and
``causal-conv1d``'s ``causal_conv1d_fn``; neither runs on a CPU (Triton / CUDA only). The torch twins here take their
place (``chunk_gated_delta_rule``, ``causal_conv1d``): the same arguments and shapes as fla's, plus ``cu_seqlens``
for a packed stream of sequences (batch 1), where the recurrent state and the convolution's window restart at every
sequence boundary. ``recurrent_gated_delta_rule`` is the one-token-at-a-time definition the chunked form is tested
against (in fp64).

Dispatch (``gated_delta_backend``): fla for CUDA tensors when it imports, unless ``RLHF_KERNELS_FORCE_TORCH=1``;
the torch twin otherwise. The convolution likewise: causal-conv1d's ``causal_conv1d_fn`` (its ``seq_idx`` for a
packed stream, channel-last as it requires) for CUDA tensors when the package imports, else the twin. Each choice
is logged once. Neither CUDA path has run on a GPU in this project's checks yet (tests/gpu/gpu_check_kernels.py
compares them with the twins where the packages are installed).

Shapes: q, k ``(B, T, H, Dk)``, v ``(B, T, H, Dv)`` (q/k already repeated to the value heads), g and beta
``(B, T, H)`` (g: the log decay, <= 0), state ``(B, H, Dk, Dv)``; the convolution's x ``(B, D, T)``, weight
``(D, K)``.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)
_LOGGED: set[str] = set()


def _log_once(op: str, path: str) -> None:
    if (op, path) not in _LOGGED:
        _LOGGED.add((op, path))
        log.info("%s: %s", op, path)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """fla's / transformers' ``x * rsqrt(sum(x^2) + eps)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Tensor | None = None, scale: float | None = None
                               ) -> tuple[Tensor, Tensor]:
    """The definition, one token at a time, in the inputs' dtype (tests run it in fp64):
    ``S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T (scale q_t)``.
    Returns (o ``(B, T, H, Dv)``, final state ``(B, H, Dk, Dv)``)."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    out = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        kv_mem = (state * k[:, i, :, :, None]).sum(-2)  # (B, H, Dv)
        delta = (v[:, i] - kv_mem) * beta[:, i, :, None]
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        out.append((state * (q[:, i] * scale)[..., None]).sum(-2))
    return torch.stack(out, dim=1), state


def _chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None, chunk: int,
             scale: float) -> tuple[Tensor, Tensor]:
    """One batch of whole sequences, fp32, heads first: q, k (B, H, T, Dk), v (B, H, T, Dv), g, beta (B, H, T)."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk - t % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q * scale, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # (B, H, N, C): log decay from the chunk's start to each position
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # (B, H, N, C, C)
    # the delta rule within a chunk is a unit lower-triangular system (the WY / UT form)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # read below the diagonal only (unit diagonal)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # (B, H, N, C, C), lower triangle with the diagonal
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    last = cum[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1)
    s = q.new_zeros(b, h, dk, dv) if state is None else state.float()
    out = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s
        out.append(q_dec[:, :, i] @ s + intra[:, :, i] @ v_new)
        s = s * last[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return o, s


def torch_chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                                 initial_state: Tensor | None = None, output_final_state: bool = False,
                                 cu_seqlens: Tensor | None = None, use_qk_l2norm_in_kernel: bool = False,
                                 chunk_size: int = 64) -> tuple[Tensor, Tensor | None]:
    """fla's ``chunk_gated_delta_rule`` in torch (fp32 inside, the output in q's dtype). ``cu_seqlens`` (int,
    ``[N + 1]``, batch 1): each sequence starts from ``initial_state[i]`` (or zeros), and the final states are one
    per sequence."""
    dtype = q.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float()), l2norm(k.float())
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))  # heads first
    if cu_seqlens is None:
        o, s = _chunked(q, k, v, g, beta, initial_state, chunk_size, scale)
        return o.transpose(1, 2).to(dtype), (s if output_final_state else None)
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs batch 1 (a packed stream), got batch {q.shape[0]}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    outs, states = [], []
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi == lo:
            states.append(q.new_zeros(1, *q.shape[1:2], k.shape[-1], v.shape[-1]))
            continue
        init = None if initial_state is None else initial_state[i: i + 1]
        o, s = _chunked(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], g[:, :, lo:hi], beta[:, :, lo:hi], init,
                        chunk_size, scale)
        outs.append(o)
        states.append(s)
    o = torch.cat(outs, dim=2)
    if o.shape[2] < q.shape[2]:  # tokens past cu_seqlens[-1] (padding of the stream): zeros
        o = F.pad(o, (0, 0, 0, q.shape[2] - o.shape[2]))
    return o.transpose(1, 2).to(dtype), (torch.cat(states) if output_final_state else None)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = "silu",
                  cu_seqlens: Tensor | None = None) -> Tensor:
    """causal-conv1d's ``causal_conv1d_fn`` in torch: depthwise, ``out[t] = sum_j weight[:, K-1-j] x[t-j]``, over
    x ``(B, D, T)``, weight ``(D, K)``. With ``cu_seqlens`` (batch 1) a tap never reaches across a sequence's
    start: the window restarts at every boundary, as if each sequence ran alone."""
    width = weight.shape[-1]
    t = x.shape[-1]
    fn = _causal_conv1d_pkg() if x.is_cuda and os.environ.get("RLHF_KERNELS_FORCE_TORCH") != "1" else None
    if fn is not None and activation in (None, "silu", "swish"):
        _log_once("causal conv1d", "causal-conv1d causal_conv1d_fn")
        seq_idx = None
        if cu_seqlens is not None:  # (1, T) int32: the sequence of each token; causal-conv1d wants channel-last x
            seq_idx = _sequence_ids(cu_seqlens, t, x.device)[None].to(torch.int32)
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        return fn(x, weight, bias, seq_idx=seq_idx, activation=activation)
    _log_once("causal conv1d", "torch twin (rlhf.kernels.gated_delta)")
    if cu_seqlens is None:
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[1])[..., :t]
    else:
        # position of each token within its sequence; tap j may read x[t - j] only where that is >= 0
        bounds = cu_seqlens.to(device=x.device, dtype=torch.long)
        seq_id = _sequence_ids(cu_seqlens, t, x.device)
        first = torch.cat([bounds[:1], bounds[1:-1]])  # each sequence's first token
        pos = torch.arange(t, device=x.device) - first[seq_id.clamp(max=first.numel() - 1)]
        out = 0
        for j in range(width):
            shifted = F.pad(x, (j, 0))[..., :t] * (pos >= j).to(x.dtype)
            out = out + shifted * weight[:, width - 1 - j, None]
        if bias is not None:
            out = out + bias[:, None]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: activation {activation!r} (silu or None)")
    return out


def _causal_conv1d_pkg():
    """causal-conv1d's ``causal_conv1d_fn`` (Dao-AILab/causal-conv1d, causal_conv1d/causal_conv1d_interface.py), or
    None where it does not import."""
    try:
        from causal_conv1d import causal_conv1d_fn
    except Exception:  # not installed, or built against another torch / CUDA
        return None
    return causal_conv1d_fn


def _sequence_ids(cu_seqlens: Tensor, t: int, device) -> Tensor:
    """(T,) long: the index of the sequence each of a packed stream's ``t`` tokens belongs to."""
    starts = torch.zeros(t, dtype=torch.long, device=device)
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    starts[bounds[1:-1][bounds[1:-1] < t]] = 1
    return starts.cumsum(0)


def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or built against another torch
        return None
    return chunk_gated_delta_rule


def gated_delta_backend(x: Tensor) -> str:
    """``fla`` for CUDA tensors when flash-linear-attention imports (and ``RLHF_KERNELS_FORCE_TORCH`` is unset),
    else ``torch``."""
    if x.is_cuda and os.environ.get("RLHF_KERNELS_FORCE_TORCH") != "1" and _fla() is not None:
        return "fla"
    return "torch"


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                           cu_seqlens: Tensor | None = None) -> Tensor:
    """The chunked gated delta rule of one Gated DeltaNet layer (q, k already l2-normed, in fp32 or v's dtype), no
    state in or out: fla's kernel or the torch twin (``gated_delta_backend``). fla's takes q, k and v in one dtype,
    bf16 or fp16 (it asserts both): q and k are cast to v's, and an fp32 model runs the twin. Returns o
    ``(B, T, H, Dv)``."""
    path = gated_delta_backend(q)
    if path == "fla" and v.dtype == torch.float32:
        _log_once("gated delta rule", "torch twin (fla's chunk_gated_delta_rule refuses fp32; an fp32 model)")
        path = "torch"
    if path == "fla":
        _log_once("gated delta rule", "flash-linear-attention chunk_gated_delta_rule")
        q, k = q.to(v.dtype), k.to(v.dtype)
        o, _ = _fla()(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                      cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
                      use_qk_l2norm_in_kernel=False)
        return o
    _log_once("gated delta rule", "torch twin (rlhf.kernels.gated_delta; fla needs CUDA)")
    return torch_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens)[0]


def gated_delta_rule_with_state(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
    """``chunk_gated_delta_rule`` from ``initial_state`` ``(B, H, Dk, Dv)`` (None: zeros), returning the final state
    too: the megatron generator's decode steps (``rlhf.rollout.decode_cache``), a prompt's prefill then one token
    at a time. fla's kernel on CUDA in bf16/fp16, else the torch twin. Returns (o ``(B, T, H, Dv)``, state fp32)."""
    if gated_delta_backend(q) == "fla" and v.dtype != torch.float32:
        _log_once("gated delta rule with state", "flash-linear-attention chunk_gated_delta_rule")
        o, state = _fla()(q.to(v.dtype), k.to(v.dtype), v, g=g, beta=beta, initial_state=initial_state,
                          output_final_state=True, use_qk_l2norm_in_kernel=False)
        return o, state.float()
    _log_once("gated delta rule with state", "torch twin (rlhf.kernels.gated_delta)")
    o, state = torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                            chunk_size=min(64, q.shape[1]))  # a decode step: one chunk of one
    return o, state
