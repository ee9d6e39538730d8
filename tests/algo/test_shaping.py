"""Length shaping and the dynamic-filtering rule against OpenRLHF's formulas, written out here from its source
(openrlhf/trainer/ppo_utils/length_penalty.py, samples_generator.py), with hand cases."""
import pytest
import torch

from rlhf.algo.shaping import ShapingConfig, apply_length_penalties, keep_groups


def openrlhf_length_penalties(rewards, lengths, truncated, max_new_tokens, buffer_len, factor, coef):
    r = [float(x) for x in rewards]
    if buffer_len is not None:
        expected = max_new_tokens - buffer_len
        for j, n in enumerate(lengths):
            exceed = min(n - expected, buffer_len)
            if exceed > 0:
                r[j] += -exceed / buffer_len * factor
    if coef is not None:
        for j, t in enumerate(truncated):
            if t:
                r[j] = coef if coef < 0 else r[j] * coef
    return r


@pytest.mark.parametrize("buffer_len,factor,coef", [(4, 1.0, None), (4, 0.5, 0.3), (None, 1.0, -0.5),
                                                     (10, 2.0, 0.0)])
def test_length_penalties_match_openrlhf(buffer_len, factor, coef):
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(32, generator=g, dtype=torch.float64) * 2 - 0.5
    lengths = torch.randint(1, 17, (32,), generator=g)
    truncated = lengths == 16
    cfg = ShapingConfig(generate_max_len=16, overlong_buffer_len=buffer_len, overlong_penalty_factor=factor,
                        stop_properly_penalty_coef=coef)
    out, pen, touched = apply_length_penalties(rewards, lengths, truncated, cfg)
    want = openrlhf_length_penalties(rewards.tolist(), lengths.tolist(), truncated.tolist(), 16, buffer_len, factor,
                                     coef)
    assert out.tolist() == pytest.approx(want, abs=1e-12)
    assert touched.tolist() == (truncated.tolist() if coef is not None else [False] * 32)
    if buffer_len is not None:
        assert pen.tolist() == [n > 16 - buffer_len for n in lengths.tolist()]
        assert pen.any() and not pen.all()  # the case exercises both sides of the threshold


def test_overlong_hand_case():
    cfg = ShapingConfig(generate_max_len=20, overlong_buffer_len=4)
    out, _, _ = apply_length_penalties(torch.ones(4, dtype=torch.float64), torch.tensor([15, 16, 18, 20]),
                                       torch.tensor([False, False, False, True]), cfg)
    assert out.tolist() == pytest.approx([1.0, 1.0, 0.5, 0.0])  # 16 is the threshold; 18 is half the buffer in


def test_keep_groups():
    scores = torch.tensor([0, 0, 0, 0,  1, 1, 1, 1,  0, 1, 0, 0,  0.5, 0.5, 0.5, 0.5,  0.2, 0.9, 0.9, 0.9])
    assert keep_groups(scores, 4, 0.0, 1.0).tolist() == [False, False, True, False, True]
    # the range alone: OpenRLHF's rule (LO < mean < HI); a mean of 0.725 is outside (0, 0.7)
    assert keep_groups(scores, 4, 0.0, 0.7).tolist() == [False, False, True, False, False]


@pytest.mark.parametrize("kw,needle", [({"overlong_buffer_len": 0}, "--overlong_buffer_len 0"),
                                       ({"overlong_buffer_len": 17}, "--overlong_buffer_len 17"),
                                       ({"stop_properly_penalty_coef": 1.5}, "--stop_properly_penalty_coef 1.5"),
                                       ({"overlong_penalty_factor": -1}, "--overlong_penalty_factor must be")])
def test_shaping_flags_are_checked(kw, needle):
    with pytest.raises(ValueError, match=needle):
        ShapingConfig(generate_max_len=16, **kw)
