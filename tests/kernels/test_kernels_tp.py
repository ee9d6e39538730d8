"""Vocab-parallel log-probs at TP=2 and TP=4 on gloo against the single-process full-vocab result.

Each rank computes the full-vocab reference itself (same seed), then its shard's result, and asserts:
logprobs and entropy equal, the logits grad equals its slice of the full grad (also with `inplace_backward`),
and for the fused variant the hidden grad (all-reduced) equals the full one and the weight grad equals its
slice. The padded vocab leaves the last rank with no real column at TP=4, which exercises the empty-shard path.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from helpers import spawn_within

from rlhf.distributed.env import free_port

N, H, V_LOCAL_TOTAL, TEMPERATURE = 11, 8, 32, 0.9


def _full_and_shard(fn, full_inputs, shard_inputs, gl, ge):
    """Run fn on full and sharded inputs (each a list of tensors), backward with (gl, ge); return both."""
    out = []
    for inputs in (full_inputs, shard_inputs):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        lp, ent = fn(leaves, inputs is shard_inputs)
        ((lp * gl).sum() + (ent * ge).sum()).backward()
        out.append((lp.detach(), ent.detach(), [t.grad for t in leaves]))
    return out


def _worker(rank: int, world: int, port: int) -> None:
    import rlhf.kernels as kernels  # imported in the child: spawn starts a fresh interpreter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        group = dist.new_group(list(range(world)))
        v_local = V_LOCAL_TOTAL // world
        lo, hi = rank * v_local, (rank + 1) * v_local
        tol = dict(atol=1e-5, rtol=1e-5)
        for vocab_size in (None, 23):  # 23 of 32: at TP=4 rank 3 holds only padding
            g = torch.Generator().manual_seed(7)
            logits = torch.randn(N, V_LOCAL_TOTAL, generator=g) * 2
            hidden = torch.randn(N, H, generator=g)
            weight = torch.randn(V_LOCAL_TOTAL, H, generator=g) / H**0.5
            targets = torch.randint(0, vocab_size or V_LOCAL_TOTAL, (N,), generator=g)
            gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)

            def token(ts, sharded):
                return kernels.token_logprobs(ts[0], targets, temperature=TEMPERATURE, return_entropy=True,
                                              vocab_size=vocab_size, tp_group=group if sharded else None,
                                              chunk_size=4)

            (f_lp, f_ent, (f_g,)), (s_lp, s_ent, (s_g,)) = _full_and_shard(
                token, [logits], [logits[:, lo:hi]], gl, ge)
            torch.testing.assert_close(s_lp, f_lp, **tol)
            torch.testing.assert_close(s_ent, f_ent, **tol)
            torch.testing.assert_close(s_g, f_g[:, lo:hi], **tol)

            def token_inplace(ts, sharded):  # on a non-leaf, as a model output; the full run is the default
                x = ts[0] * 1.0 if sharded else ts[0]
                return kernels.token_logprobs(x, targets, temperature=TEMPERATURE, return_entropy=True,
                                              vocab_size=vocab_size, tp_group=group if sharded else None,
                                              chunk_size=4, inplace_backward=sharded)

            _, (i_lp, i_ent, (i_g,)) = _full_and_shard(token_inplace, [logits], [logits[:, lo:hi]], gl, ge)
            torch.testing.assert_close(i_lp, f_lp, **tol)
            torch.testing.assert_close(i_ent, f_ent, **tol)
            torch.testing.assert_close(i_g, f_g[:, lo:hi], **tol)

            def fused(ts, sharded):
                return kernels.fused_linear_logprobs(ts[0], ts[1], targets, temperature=TEMPERATURE,
                                                     return_entropy=True, vocab_size=vocab_size, chunk_size=4,
                                                     tp_group=group if sharded else None)

            (f_lp, f_ent, (f_gh, f_gw)), (s_lp, s_ent, (s_gh, s_gw)) = _full_and_shard(
                fused, [hidden, weight], [hidden, weight[lo:hi]], gl, ge)
            torch.testing.assert_close(s_lp, f_lp, **tol)
            torch.testing.assert_close(s_ent, f_ent, **tol)
            torch.testing.assert_close(s_gh, f_gh, **tol)
            torch.testing.assert_close(s_gw, f_gw[lo:hi], **tol)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_matches_full_vocab(world):
    # re-raises the first rank's exception (with its traceback) and terminates the others; bounded
    spawn_within(_worker, (world, free_port()), nprocs=world, timeout=300)
