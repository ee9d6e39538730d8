"""Rollout corrections (rlhf/algo/rollout_correction.py) against the peers' formulas, written out below in fp64 from
their sources, not from ours:

* OpenRLHF 3c3be6234e0c, openrlhf/models/loss.py ``PolicyLoss.forward``: ``--algo.advantage.is_correction_type``
  tis / icepop / seq-mask-tis with ``--algo.advantage.is_correction_threshold LOW HIGH``;
* verl b178a3cd, verl/trainer/ppo/rollout_corr_helper.py ``compute_rollout_rejection_mask`` (and
  ``_parse_rollout_rs_thresholds``): ``rollout_rs`` token_k* / seq_sum_k* / seq_mean_k* / seq_max_k* with
  ``rollout_rs_threshold``; the rejected tokens leave ``response_mask``, which the loss aggregates over.

Each comparison has a negative control: a plausible misreading (no lower bound, the sign of k1, seq-mask-tis's
weights clamped as its comment says, ...) is told apart by the same inputs. The run-level check (the correction
reaches a real update and its metrics are logged) is tests/ppo/test_rlvr_options.py."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

F64 = torch.float64
B, T = 8, 7


def batch(seed=0, spread=0.35):
    """Right-padded log-probs (B, T): the trainer's ``old`` and the generator's ``rollout`` differ by ~``spread``
    per token; the padding holds garbage (large finite values) that must not leak."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    lens[0] = T
    mask = torch.arange(T)[None] < lens[:, None]  # (B, T)
    old = torch.randn(B, T, generator=g, dtype=F64) * 0.5 - 1.5
    rollout = old + torch.randn(B, T, generator=g, dtype=F64) * spread
    # whole sequences off by a known amount: near on-policy, far on either side, and slightly (k1's sign matters)
    for row, shift in ((3, 0.0), (5, 0.4), (6, -0.4), (7, 0.08)):
        rollout[row] = old[row] + shift + 0.02 * torch.randn(T, generator=g, dtype=F64)
    rollout = torch.where(mask, rollout, torch.full_like(rollout, 30.0))
    adv = torch.randn(B, T, generator=g, dtype=F64)
    lp = old + torch.randn(B, T, generator=g, dtype=F64) * 0.1
    return mask, old, rollout, adv, lp


def parse(extra: list[str]) -> argparse.Namespace:
    """launch/ppo.py's parser (rlhf.ppo.args.add_args with the launcher flags) after OpenRLHF's dotted flags."""
    from rlhf.config.migration import add_launcher_args
    from rlhf.config.openrlhf import translate
    from rlhf.ppo.args import add_args

    p = argparse.ArgumentParser()
    add_args(p)
    add_launcher_args(p)
    return p.parse_args(translate(["--pretrain", "m", "--prompt_data", "p.jsonl", "--save_path", "o", "--reward_fn",
                                   "rlhf.rewards.verifiers:math_reward", *extra], "ppo",
                                  set(p._option_string_actions)))


def ours(flags: list[str], lp, old, rollout, adv, mask, agg="token_mean"):
    """This repo's actor loss (make_actor_loss with ActorLossConfig.from_args) -> (loss mean, metrics)."""
    from rlhf.algo.advantages import get_estimator
    from rlhf.algo.ppo_losses import ActorLossConfig, make_actor_loss

    from rlhf.algo.rollout_correction import experience_correction

    args = parse(flags + ["--loss_agg_mode", agg])
    args.old_logprobs_source = "forward"
    cfg = ActorLossConfig.from_args(args, get_estimator("grpo"))
    batch = {"old_logprobs": old, "advantages": adv, "action_mask": mask, "vllm_logprobs": rollout}
    if cfg.corrected_in_experience:  # verl's decoupled mode: as make_experience applies it (rlhf.ppo.stages)
        keep, weights, _ = experience_correction(old, rollout, mask, cfg.correction)
        if keep is not None:
            batch["action_mask"] = mask & keep
        if weights is not None:
            batch["rollout_is_weights"] = weights
    fn = make_actor_loss(lambda b, out: (out, torch.zeros_like(out)), cfg)
    s, n, metrics = fn(batch, lp)
    return s / n, metrics


def ppo_token_loss(lp, old, adv, eps=0.2):
    ratio = (lp - old).clamp(-20, 20).exp()
    return -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)


# ---- OpenRLHF, written out (openrlhf/models/loss.py PolicyLoss.forward, the ``enable_vllm_is_correction`` block)
def openrlhf_masked_mean(x, mask, dim=None):
    return (x * mask).sum() / mask.sum() if dim is None else (x * mask).sum(dim) / mask.sum(dim)


def openrlhf_loss(kind, low, high, lp, old, rollout, adv, mask, token_level_loss=True, clamp_seq_weights=False):
    mask = mask.to(F64)
    loss = ppo_token_loss(lp, old, adv)
    rollout_log_ratio = old - rollout
    if kind == "icepop":
        vllm_is = torch.exp(rollout_log_ratio).detach()
        vllm_is = vllm_is * ((vllm_is >= low) & (vllm_is <= high))
        loss = vllm_is * loss
    elif kind == "seq-mask-tis":
        seq_is = torch.exp(openrlhf_masked_mean(rollout_log_ratio, mask, dim=-1))
        seq_mask = (seq_is >= low) & (seq_is <= high)
        vllm_is = torch.exp(rollout_log_ratio).detach()
        if clamp_seq_weights:  # the negative control: what the comment above OpenRLHF's code says
            vllm_is = vllm_is.clamp(min=low, max=high)
        loss = seq_mask.unsqueeze(-1) * vllm_is * loss
    else:
        loss = torch.exp(rollout_log_ratio).clamp(min=low, max=high).detach() * loss
    loss = torch.where(mask.bool(), loss, 0)  # the padding's garbage x 0 would be NaN in fp; 0 in OpenRLHF's data
    if token_level_loss:
        return openrlhf_masked_mean(loss, mask)
    return openrlhf_masked_mean(loss, mask, dim=-1).mean()


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
def test_openrlhf_correction_types_equal_openrlhfs_formula(kind, agg):
    """OpenRLHF's command line (--algo.advantage.is_correction_enable, _threshold 0.8 1.25, _type KIND) through the
    PPO parser: loss and gradient equal OpenRLHF's, token-level and sequence-mean aggregation alike. Negative
    controls: without the lower bound, and another type at the same bounds, the loss differs."""
    mask, old, rollout, adv, lp0 = batch()
    flags = ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_threshold", "0.8", "1.25",
             "--algo.advantage.is_correction_type", kind]
    res = []
    for fn in (lambda lp: ours(flags, lp, old, rollout, adv, mask, agg)[0],
               lambda lp: openrlhf_loss(kind, 0.8, 1.25, lp, old, rollout, adv, mask, agg == "token_mean")):
        lp = lp0.clone().requires_grad_(True)
        loss = fn(lp)
        loss.backward()
        res.append((loss.item(), torch.where(mask, lp.grad, 0)))
    assert res[0][0] == pytest.approx(res[1][0], rel=1e-12)
    assert torch.allclose(res[0][1], res[1][1], rtol=1e-10, atol=1e-14)
    no_floor = openrlhf_loss(kind, 0.0, 1.25, lp0, old, rollout, adv, mask, agg == "token_mean").item()
    assert abs(no_floor - res[0][0]) > 1e-4, (no_floor, res[0][0])
    other = {"tis": "icepop", "icepop": "seq-mask-tis", "seq-mask-tis": "tis"}[kind]
    assert abs(openrlhf_loss(other, 0.8, 1.25, lp0, old, rollout, adv, mask).item() - res[0][0]) > 1e-4


def test_seq_mask_tis_keeps_openrlhfs_unclamped_weights():
    """OpenRLHF's seq-mask-tis masks whole sequences by their geometric-mean weight and multiplies the kept tokens by
    the raw w, unclamped (its comment says "TIS (token-level clamp)", its code does not clamp). Negative control: the
    clamped reading is told apart; and the geometric mean both keeps and drops sequences here."""
    from rlhf.algo.rollout_correction import RolloutCorrectionConfig, rollout_correction

    mask, old, rollout, adv, lp = batch()
    cfg = RolloutCorrectionConfig(use_tis=True, tis_floor=0.8, tis_cap=1.25, is_correction_type="seq-mask-tis")
    corr = rollout_correction(old, rollout, mask, cfg)
    rows = (corr.weights != 0).any(-1)
    assert 0 < rows.sum() < B, rows
    w = torch.exp(old - rollout)
    assert torch.equal(corr.weights[rows][mask[rows]], w[rows][mask[rows]])
    assert (w[rows][mask[rows]] > 1.25).any() or (w[rows][mask[rows]] < 0.8).any()  # the clamp would bite
    ref = openrlhf_loss("seq-mask-tis", 0.8, 1.25, lp, old, rollout, adv, mask).item()
    clamped = openrlhf_loss("seq-mask-tis", 0.8, 1.25, lp, old, rollout, adv, mask, clamp_seq_weights=True).item()
    assert abs(ref - clamped) > 1e-4 and ours(["--use_tis", "--tis_floor", "0.8", "--tis_cap", "1.25",
                                               "--is_correction_type", "seq-mask-tis"], lp, old, rollout, adv,
                                              mask)[0].item() == pytest.approx(ref, rel=1e-12)


def test_use_tis_alone_is_bit_identical_to_the_old_weight():
    """--use_tis --tis_cap C (--tis_floor F) computes what it did before the corrections module, to the last bit:
    ``policy_loss(..., rollout_is_weights=exp(old - vllm).clamp(F, C))``."""
    from rlhf.algo.ppo_losses import policy_loss

    mask, old, rollout, adv, lp0 = batch()
    old32, roll32, lp32, adv32 = old.float(), rollout.float(), lp0.float(), adv.float()
    for flags, floor in ((["--use_tis"], None), (["--use_tis", "--tis_floor", "0.9", "--tis_cap", "1.3"], 0.9)):
        cap = 1.3 if floor else 2.0
        lp = lp32.clone().requires_grad_(True)
        s, n, _ = policy_loss(lp, old32, adv32, mask, rollout_is_weights=torch.exp(old32 - roll32).clamp(
            min=floor, max=cap))
        (s / n).backward()
        lp2 = lp32.clone().requires_grad_(True)
        loss, _ = ours(flags, lp2, old32, roll32, adv32, mask)
        loss.backward()
        assert loss.item() == (s / n).item() and torch.equal(lp.grad, lp2.grad)


# ---- verl, written out (rollout_corr_helper.py compute_rollout_rejection_mask)
def verl_rejection_mask(log_ratio, response_mask, option, lower, upper, k1_sign=-1.0):
    """verl's modified response mask for one option; ``k1_sign=+1`` is the negative control (k1 = log ratio)."""
    m = response_mask.to(F64)
    lr = torch.clamp(log_ratio, min=-20.0, max=20.0)
    token = {"k1": k1_sign * lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}
    kind = option.rsplit("_", 1)[1]
    stat = torch.where(response_mask, token[kind], 0)  # verl_F.masked_sum/mean: values * mask
    if option.startswith("token"):
        pass
    elif option.startswith("seq_sum"):
        stat = (stat * m).sum(-1, keepdim=True)
    elif option.startswith("seq_mean"):
        stat = (stat * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True)
    else:
        mx = token[kind].masked_fill(~response_mask, float("-inf")).max(-1, keepdim=True).values
        stat = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx)
    if kind == "k1":
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    else:
        keep = stat <= upper
    return (m * keep.expand_as(m).to(F64)).bool()


VERL_CASES = [("token_k1", "0.8_1.5"), ("token_k2", "0.03"), ("token_k3", "0.03"), ("seq_sum_k1", "0.5_1.2"),
              ("seq_sum_k2", "0.15"), ("seq_sum_k3", "0.15"), ("seq_mean_k1", "0.9_1.05"), ("seq_mean_k2", "0.05"),
              ("seq_mean_k3", "0.05"), ("seq_max_k2", "0.05"), ("seq_max_k3", "0.05")]


@pytest.mark.parametrize("option,spec", VERL_CASES)
def test_verl_rejection_equals_verls_formula(option, spec):
    """--rollout_rs OPTION --rollout_rs_threshold SPEC (verl's names and threshold syntax): the tokens kept are
    verl's modified response mask, which both keeps and rejects here; the loss is the PPO loss's token mean over
    that mask, loss and gradient as verl aggregates it. Negative controls: k1 with the opposite sign (k1 = log
    p_trainer/p_rollout) keeps other tokens at these asymmetric bounds; the other options' masks differ too."""
    from rlhf.algo.rollout_correction import RolloutCorrectionConfig, rollout_correction

    mask, old, rollout, adv, lp0 = batch()
    lower, upper = (float(v) for v in spec.split("_")) if "_" in spec else (None, float(spec))
    want = verl_rejection_mask(old - rollout, mask, option, lower, upper)
    corr = rollout_correction(old, rollout, mask, RolloutCorrectionConfig(rollout_rs=option,
                                                                          rollout_rs_threshold=spec))
    got = mask & corr.keep
    assert torch.equal(got, want)
    assert 0 < want.sum() < mask.sum(), (option, want.sum(), mask.sum())  # the threshold bites, not everywhere
    if option.endswith("k1"):
        assert not torch.equal(verl_rejection_mask(old - rollout, mask, option, lower, upper, k1_sign=1.0), want)
    res = []
    for fn in (lambda lp: ours(["--rollout_rs", option, "--rollout_rs_threshold", spec], lp, old, rollout, adv,
                               mask)[0],
               lambda lp: (ppo_token_loss(lp, old, adv) * want).sum() / want.sum()):
        lp = lp0.clone().requires_grad_(True)
        loss = fn(lp)
        loss.backward()
        res.append((loss.item(), torch.where(mask, lp.grad, 0)))
    assert res[0][0] == pytest.approx(res[1][0], rel=1e-12)
    assert torch.allclose(res[0][1], res[1][1], rtol=1e-10, atol=1e-14)
    # zeroing the rejected tokens' loss but keeping them in the denominator (OpenRLHF's way) is another loss
    assert abs((ppo_token_loss(lp0, old, adv) * want).sum().item() / mask.sum().item() - res[0][0]) > 1e-6


def test_verl_thresholds_several_options_and_a_single_upper():
    """verl's ``_parse_rollout_rs_thresholds``: one threshold shared, or one per option; a k1 option given only
    UPPER takes LOWER = 1 / UPPER; every option must pass (logical AND)."""
    from rlhf.algo.rollout_correction import RolloutCorrectionConfig, rollout_correction

    cfg = RolloutCorrectionConfig(rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="1.3,0.1")
    assert cfg.rs_bounds() == (("token_k1", 1 / 1.3, 1.3), ("seq_max_k2", None, 0.1))
    assert RolloutCorrectionConfig(rollout_rs="seq_mean_k3,token_k2", rollout_rs_threshold="0.05").rs_bounds() == (
        ("seq_mean_k3", None, 0.05), ("token_k2", None, 0.05))
    mask, old, rollout, _, _ = batch()
    want = (verl_rejection_mask(old - rollout, mask, "token_k1", 1 / 1.3, 1.3)
            & verl_rejection_mask(old - rollout, mask, "seq_max_k2", None, 0.1))
    assert torch.equal(mask & rollout_correction(old, rollout, mask, cfg).keep, want)


def test_correction_metrics():
    """The fraction of response tokens zeroed or rejected, the fraction whose weight tis clamped, and the mean
    weight over the tokens kept, on a hand-made batch (the padding's garbage not counted)."""
    from rlhf.algo.rollout_correction import RolloutCorrectionConfig, rollout_correction

    w = torch.tensor([[0.5, 1.0, 1.1, 3.0], [0.9, 2.0, 9.0, 9.0]], dtype=F64)  # the last two of row 1: padding
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).bool()
    old = torch.zeros(2, 4, dtype=F64)
    rollout = -torch.log(w)

    def metrics(**kw):
        m = rollout_correction(old, rollout, mask, RolloutCorrectionConfig(**kw)).metrics
        return {k: float(s) / float(n) for k, (s, n) in m.items()}

    tis = metrics(use_tis=True, tis_floor=0.8, tis_cap=1.5)
    assert tis == pytest.approx({"rollout_corr_masked_frac": 0.0, "rollout_corr_clipped_frac": 3 / 6,
                                 "rollout_is_weight": (0.8 + 1.0 + 1.1 + 1.5 + 0.9 + 1.5) / 6})
    ice = metrics(use_tis=True, tis_floor=0.8, tis_cap=1.5, is_correction_type="icepop")
    assert ice == pytest.approx({"rollout_corr_masked_frac": 3 / 6, "rollout_corr_clipped_frac": 0.0,
                                 "rollout_is_weight": (1.0 + 1.1 + 0.9) / 3})
    rs = metrics(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.5")  # k1 = log w: keeps w in [0.8, 1.5]
    assert rs == pytest.approx({"rollout_corr_masked_frac": 3 / 6, "rollout_corr_clipped_frac": 0.0,
                                "rollout_is_weight": 1.0})


def test_flags_parse_and_openrlhf_flags_map():
    """Our flags through launch/ppo.py's parser; OpenRLHF's dotted flags map onto them, and an OpenRLHF command
    line (one naming --actor.model_name_or_path) gets OpenRLHF's default bounds 0.5 5.0 unless it gives its own."""
    from rlhf.algo.rollout_correction import RolloutCorrectionConfig

    a = parse(["--use_tis", "--is_correction_type", "icepop", "--tis_floor", "0.5", "--rollout_rs",
               "token_k1,seq_mean_k3", "--rollout_rs_threshold", "0.5_2,0.1"])
    cfg = RolloutCorrectionConfig.from_args(a)
    assert (cfg.use_tis, cfg.is_correction_type, cfg.tis_floor, cfg.tis_cap) == (True, "icepop", 0.5, 2.0)
    assert cfg.rs_bounds() == (("token_k1", 0.5, 2.0), ("seq_mean_k3", None, 0.1))
    for kind in ("tis", "icepop", "seq-mask-tis"):
        a = parse(["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", kind])
        assert (a.use_tis, a.is_correction_type, a.tis_floor, a.tis_cap) == (True, kind, None, 2.0)
    a = parse(["--actor.model_name_or_path", "m", "--algo.advantage.is_correction_enable",
               "--algo.advantage.is_correction_type", "icepop"])
    assert (a.use_tis, a.is_correction_type, a.tis_floor, a.tis_cap) == (True, "icepop", 0.5, 5.0)
    a = parse(["--actor.model_name_or_path", "m", "--algo.advantage.is_correction_threshold", "0.7", "1.4"])
    assert (a.tis_floor, a.tis_cap) == (0.7, 1.4)
    with pytest.raises(SystemExit):  # argparse's choices
        parse(["--is_correction_type", "cispo"])


@pytest.mark.parametrize("flags,needle", [
    (["--use_tis", "--tis_floor", "3", "--tis_cap", "2"], "--tis_floor 3: must be in [0, --tis_cap 2)"),
    (["--rollout_rs", "token_k4", "--rollout_rs_threshold", "2"], "--rollout_rs token_k4: expected options"),
    (["--rollout_rs", "seq_max_k1", "--rollout_rs_threshold", "2"], "--rollout_rs seq_max_k1: expected options"),
    (["--rollout_rs", "token_k1"], "--rollout_rs token_k1 needs --rollout_rs_threshold"),
    (["--rollout_rs", "token_k1,token_k2", "--rollout_rs_threshold", "1,2,3"], "--rollout_rs_threshold 1,2,3: one"),
    (["--rollout_rs", "token_k2", "--rollout_rs_threshold", "0.5_2"], "'0.5_2' for token_k2 is not one number"),
    (["--rollout_rs", "token_k1", "--rollout_rs_threshold", "2_0.5"], "'2_0.5' for token_k1 must be positive, LOWER"),
    (["--rollout_rs", "token_k3", "--rollout_rs_threshold", "-1"], "'-1' for token_k3 must be positive"),
    (["--rollout_rs_threshold", "2"], "--rollout_rs_threshold 2: without --rollout_rs"),
    (["--use_tis", "--use_rollout_logprobs"], "--use_tis weighs by the trainer's old log-probs"),
    (["--rollout_is", "token", "--rollout_is_batch_normalize", "--use_rollout_logprobs"],
     "--rollout_is_batch_normalize with --use_rollout_logprobs"),
    (["--rollout_is", "token", "--use_tis"], "--rollout_is token with --use_tis: two importance weights"),
    (["--rollout_is_batch_normalize"], "--rollout_is_batch_normalize without --rollout_is"),
])
def test_bad_values_name_the_flag(flags, needle, tmp_path):
    from rlhf.ppo.algo_args import check_algo
    from rlhf.ppo.args import PPOJobConfig

    (tmp_path / "p.jsonl").write_text('{"prompt": "1 + 1 ="}\n')
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        # the part's own checks as the job is built, then the job's
        check_algo(PPOJobConfig.from_args(parse(flags + ["--prompt_data", str(tmp_path / "p.jsonl")])))
