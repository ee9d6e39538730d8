"""``--use_liger_kernel`` (rlhf.models.fused) on the CPU: SFT's loss from the hidden states with the head fused
(``rlhf.supervised.sft.fused_head_loss``) against the logits path (``sft_loss``, ``packed_sft_loss``) that the CPU runs by
default, and the flag's rules. The CUDA kernels themselves are compared with fp64 in tests/kernels/triton_cases.py
(Triton's interpreter here; Liger's kernels on a GPU, in the GPU check)."""
from __future__ import annotations

import types

import pytest
import torch

from rlhf.algo.losses import packed_sft_loss, sft_loss
from rlhf.models import fused
from rlhf.supervised.sft import fused_head_loss


def _engine(weight):
    return types.SimpleNamespace(model=types.SimpleNamespace(output_weight=lambda: weight))


def _logits(hidden, weight, vocab):
    logits = hidden @ weight.T
    logits[..., vocab:] = -1e30  # megatron's padded vocabulary, masked as mask_padded_vocab does
    return logits


@pytest.mark.parametrize("packed", [False, True])
def test_fused_head_loss_equals_the_logits_path(packed):
    g = torch.Generator().manual_seed(0)
    h, v, vocab = 16, 40, 37
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) / 4).requires_grad_(True)
    if packed:
        cu = torch.tensor([0, 5, 12, 13, 20], dtype=torch.int32)
        ids = torch.randint(0, vocab, (1, 20), generator=g)
        loss_mask = (torch.rand(1, 20, generator=g) > 0.3).long()
        batch = {"input_ids": ids, "loss_mask": loss_mask, "packed_seq_params": types.SimpleNamespace(cu_seqlens_q=cu)}
        hidden = torch.randn(1, 20, h, generator=g, dtype=torch.float64).requires_grad_(True)
        ref = packed_sft_loss(_logits(hidden, weight, vocab), ids, loss_mask, cu, vocab_size=vocab)
    else:
        ids = torch.randint(0, vocab, (3, 9), generator=g)
        loss_mask = torch.zeros(3, 9, dtype=torch.long)
        loss_mask[:, 4:] = 1
        loss_mask[2, 7:] = 0  # right padding
        batch = {"input_ids": ids, "loss_mask": loss_mask}
        hidden = torch.randn(3, 9, h, generator=g, dtype=torch.float64).requires_grad_(True)
        ref = sft_loss(_logits(hidden, weight, vocab), ids, loss_mask, vocab_size=vocab)
    ref_grads = torch.autograd.grad(ref[0], (hidden, weight))
    out = fused_head_loss(_engine(weight), None, vocab)(batch, hidden)
    grads = torch.autograd.grad(out[0], (hidden, weight))
    assert int(out[1]) == int(ref[1]) > 0
    # both paths hand back fp32 log-probs (relative 2^-24 each) summed in a different order: a few fp32 ulps of
    # the sum; their gradients stay fp64
    torch.testing.assert_close(out[0].double(), ref[0].double(), rtol=1e-6, atol=0)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-6, atol=1e-9)
    assert torch.all(grads[1][vocab:] == 0)


def test_the_flag_rules(monkeypatch):
    try:
        fused.request(None)
        assert not fused.enabled("cpu")  # the default: CUDA only
        fused.request(True)
        assert fused.enabled("cpu")  # the torch twins and SFT's fused head
        monkeypatch.setattr(fused, "liger_import_error", lambda: "ModuleNotFoundError: No module named 'liger_kernel'")
        fused.request(None)
        assert not fused.enabled("cuda")  # the default without liger-kernel: off, no error
        assert not fused.enabled("cuda", use_te=True)
        fused.request(True)
        with pytest.raises(ValueError, match=r"--use_liger_kernel: liger-kernel does not import.*pip install "
                                             r"liger-kernel"):
            fused.enabled("cuda")
        monkeypatch.setattr(fused, "liger_import_error", lambda: None)
        fused.request(None)
        assert fused.enabled("cuda") and not fused.enabled("cuda", use_te=True)
        fused.request(False)
        assert not fused.enabled("cuda")
    finally:
        fused.request(None)


def test_fuse_norms_keeps_the_weights_and_the_cpu_function():
    m = torch.nn.Sequential(torch.nn.RMSNorm(8, eps=1e-6), torch.nn.Linear(8, 8), torch.nn.RMSNorm(8))
    with torch.no_grad():
        m[0].weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 8)
    before, keys = m(x), list(m.state_dict())
    assert fused.fuse_norms(m) == 2 and isinstance(m[0], fused.FusedRMSNorm)
    assert list(m.state_dict()) == keys
    assert torch.equal(m(x), before)  # on the CPU the torch function runs


@pytest.mark.parametrize("rows", ["per_sequence", "per_token"])
def test_thd_rope_fast_path_takes_megatrons_angles(monkeypatch, rows):
    """The packed (THD) RoPE path of the fused kernels (rlhf.compat.megatron.rotary_half_rope) against megatron's
    own, with the Triton kernel replaced by its torch twin: the same angles for every token, in megatron's two
    cases (``freqs`` over each sequence's positions from 0, or one row per packed token)."""
    from megatron.core.models.common.embeddings import rope_utils

    import rlhf.kernels.rope_triton as rt
    from rlhf.kernels.rope import rotary_half
    from rlhf.compat.megatron import rotary_half_rope

    rotary_half_rope()
    monkeypatch.setattr(rt, "rope_triton", lambda t, freqs, mscale: rotary_half(
        t, (freqs.cos() * mscale).to(t.dtype), (freqs.sin() * mscale).to(t.dtype)))
    g = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 5, 12, 13, 20], dtype=torch.int32)
    t = torch.randn(20, 3, 8, generator=g)
    n = 32 if rows == "per_sequence" else 20
    ang = torch.outer(torch.arange(n).float(), 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
    freqs = torch.cat([ang, ang], -1)[:, None, None, :]
    cp = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    monkeypatch.setattr(fused, "active_for", lambda x, part=None: False)
    ref = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, mscale=0.9, cp_group=cp)
    monkeypatch.setattr(fused, "active_for", lambda x, part=None: True)
    out = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, mscale=0.9, cp_group=cp)
    assert torch.equal(out, ref)
    assert not torch.equal(out[5:12], rotary_half(t[5:12].unsqueeze(1), *(f(freqs[5:12]) * 0.9 for f in (
        torch.cos, torch.sin))).squeeze(1)) or rows == "per_token"  # positions restart at each sequence


def test_which_kernels_run(monkeypatch):
    monkeypatch.delenv(fused.PARTS_ENV, raising=False)
    assert [p for p in fused.PARTS if fused.part_on(p)] == ["swiglu", "rope", "head"]  # Liger's RMSNorm: opt-in
    monkeypatch.setenv(fused.PARTS_ENV, "norm,head")
    assert [p for p in fused.PARTS if fused.part_on(p)] == ["norm", "head"]
    monkeypatch.setenv(fused.PARTS_ENV, "norm,attention")
    with pytest.raises(ValueError, match="RLHF_FUSED_PARTS='norm,attention'"):
        fused.part_on("norm")
