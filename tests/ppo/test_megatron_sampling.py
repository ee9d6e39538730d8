"""The megatron generator's draw (``rlhf.rollout.megatron_generator.sample_rows``): vLLM's sampling semantics (the
log-probs of ``log_softmax(logits / temperature)``, top-p, greedy at temperature 0) with one uniform per row from
a CPU generator, inverted through the row's cumulative distribution on the logits' device. Checked against the
hand-computed distribution by counting draws, and the per-row and per-block generator forms against one row or
block drawn alone."""
import math

import pytest
import torch

from rlhf.rollout.megatron_generator import sample_rows

LOGITS = torch.tensor([2.0, -1.0, 0.5, 1.5, -3.0, 0.0])


def _nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The hand computation: softmax at the temperature, the most likely tokens until their mass reaches top_p,
    renormalised."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True)
    keep, mass = [], 0.0
    for i in order.tolist():
        if mass >= top_p:
            break
        keep.append(i)
        mass += float(p[i])
    q = torch.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8), (1.3, 0.5)])
def test_draws_follow_the_nucleus_distribution(temperature, top_p):
    """40,000 draws (one generator for all rows): every token's frequency within 5 standard deviations of its hand-
    computed probability, no token outside the nucleus drawn; each returned log-prob is log_softmax(logits / T) of
    its token (before top-p, as vLLM returns it)."""
    n = 40_000
    logits = LOGITS.expand(n, -1).contiguous()
    tok, lp = sample_rows(logits, temperature, top_p, torch.Generator().manual_seed(3))
    want = _nucleus(LOGITS, temperature, top_p)
    freq = torch.bincount(tok, minlength=len(LOGITS)).double() / n
    sigma = (want * (1 - want) / n).sqrt()
    assert torch.all((freq - want).abs() <= 5 * sigma + 1e-12), (freq, want)
    assert torch.all(freq[want == 0] == 0)
    ref = torch.log_softmax(LOGITS.double() / temperature, -1)[tok]
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-12)


def test_greedy_at_temperature_zero():
    tok, lp = sample_rows(torch.stack([LOGITS, -LOGITS]), 0.0, 1.0, torch.Generator().manual_seed(0))
    assert tok.tolist() == [0, 4]


def test_a_row_or_block_with_its_own_generator_draws_as_alone():
    """Per-row generators and per-block generators (a prompt's replies batched with another's) give each row or block
    the tokens it gets drawn alone with its generator."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=g)
    alone = [sample_rows(logits[k:k + 3], 1.0, 0.9, torch.Generator().manual_seed(10 + k // 3))[0] for k in (0, 3)]
    blocks = sample_rows(logits, 1.0, 0.9, [torch.Generator().manual_seed(10), torch.Generator().manual_seed(11)])[0]
    assert blocks.tolist() == torch.cat(alone).tolist()
    rows = sample_rows(logits, 1.0, 0.9, [torch.Generator().manual_seed(20 + k) for k in range(6)])[0]
    alone_rows = [sample_rows(logits[k:k + 1], 1.0, 0.9, torch.Generator().manual_seed(20 + k))[0] for k in range(6)]
    assert rows.tolist() == torch.cat(alone_rows).tolist()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_logits_are_an_error(bad):
    logits = LOGITS.clone()
    logits[2] = bad
    with pytest.raises(RuntimeError, match="not finite"):
        sample_rows(logits[None], 1.0, 1.0, torch.Generator().manual_seed(0))
