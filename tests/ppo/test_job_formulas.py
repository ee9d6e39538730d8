"""Real PPO jobs (launch/ppo.py, 2 ranks) checked against the peers' formulas on their own dumped tensors
(``--dump_experience``; the formulas in tests/peer_math.py, written out from OpenRLHF's and verl's source):

* the reference reaches the KL: at TP 2 with the reference offloaded, the reference's log-probs are the reference
  model's own (transformers' forward of its checkpoint on the job's tokens), not the actor's; the KL, the
  KL-penalised rewards (``--init_kl_coef``) and GAE's returns are OpenRLHF's on them; ``--eps_clip``,
  ``--entropy_coef`` and ``--value_clip`` reach the actor's and the critic's losses;
* verl's decoupled correction (``--rollout_is`` with batch normalisation, ``--rollout_rs``) at DP 2 with different
  prompts on each rank equals verl's over the global batch, with the KL in the loss (``--use_kl_loss``) against the
  reference; verl's bypass mode (``--use_rollout_logprobs``) and OpenRLHF's GSPO with its IS correction (its own
  dotted flags) equal their loss functions on every micro-batch.

The bf16 jobs give the generator (vLLM, bf16) and the trainer (megatron, bf16) different log-probs, as on a GPU;
the thresholds are set inside that spread, so the corrections act. Each check has a control that it can fail."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from helpers import REPO, run_torchrun, tail
from peer_math import (openrlhf_approx_kl, openrlhf_compute_reward, openrlhf_gae, openrlhf_policy_loss_per_token,
                       openrlhf_value_loss_per_token, verl_is_weights, verl_token_k1_keep, verl_vanilla_per_token)
from ppo_common import ppo_args

PPO = os.path.join(REPO, "launch/ppo.py")
KL_COEF, EPS, VALUE_CLIP, ENTROPY, GAMMA, LAMBD = 0.07, 0.1, 0.15, 0.02, 0.99, 0.9
IS_C, RS = 1.002, (0.998, 1.002)  # inside the bf16 spread of the generator against the trainer (0.1-0.5% here)
BYPASS_RS = (0.9, 1.1)  # against the current policy: the second pass over a batch has moved it further


def _job(setup, tmp, name, extra: dict, openrlhf: list[str] = ()) -> dict:
    """Run a 2-rank job of 2 steps with --dump_experience; {step: {rank: records}}."""
    save, dump = str(tmp / name), str(tmp / f"{name}_dump")
    args = ppo_args(setup, save, **{"--rollout_batch_size": "8", "--n_samples_per_prompt": "2",
                                    "--train_batch_size": "8", "--micro_train_batch_size": "4",
                                    "--micro_rollout_batch_size": "8", "--max_samples": "16",
                                    "--dump_experience": dump, **extra}) + list(openrlhf)
    p = run_torchrun(PPO, 2, args, timeout=600)
    assert p.returncode == 0, tail(p)
    out: dict = {}
    for f in sorted(glob.glob(os.path.join(dump, "step*_rank*.pt"))):
        rec = torch.load(f)
        out.setdefault(rec["step"], {})[rec["rank"]] = rec
    assert sorted(out) == [1, 2] and all(sorted(v) == [0, 1] for v in out.values()), out.keys()
    return out


def _mask(e):
    return e["action_mask"].double()


# --------------------------------------------------------------------------------- the reference, GAE, clips
@pytest.fixture(scope="module")
def kl_job(ppo_setup, tmp_path_factory):
    """GAE with a critic at TP 2 (one DP rank), the reference offloaded between its forwards, fp32, the megatron
    generator; the KL in the reward."""
    return _job(ppo_setup, tmp_path_factory.mktemp("kl"), "kl", {
        "--tensor_model_parallel_size": "2", "--rollout_backend": "megatron", "--vllm_tensor_parallel_size": None,
        "--ref_reward_offload": "", "--advantage_estimator": "gae", "--init_kl_coef": str(KL_COEF),
        "--kl_estimator": "k1", "--eps_clip": str(EPS), "--value_clip": str(VALUE_CLIP),
        "--entropy_coef": str(ENTROPY), "--gamma": str(GAMMA), "--lambd": str(LAMBD), "--max_epochs": "2",
        "--actor_learning_rate": "3e-2"})


def _hf_logprobs(model_dir: str, e: dict) -> torch.Tensor:
    """transformers' own forward of ``model_dir`` on the dumped tokens: log-probs of the response tokens (B, T)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=e["input_ids"], attention_mask=e["attention_mask"]).logits.double()
    lp = logits.log_softmax(-1)  # the generation temperature is 1.0 in these jobs
    rows = torch.arange(lp.shape[0]).unsqueeze(1)
    return lp[rows, e["resp_pos"], e["response_ids"]]


def test_the_reference_is_the_reference_model_and_the_kl_is_openrlhfs(kl_job, ppo_setup):
    """Step 2 (the actor has moved): the dumped reference log-probs are the reference checkpoint's own, the actor's
    are not; the KL is OpenRLHF's k1 of them, and the rewards with ``--init_kl_coef``'s penalty run through GAE give
    the dumped returns. Controls: the actor's log-probs as the reference, and a KL coefficient of 0, are told apart."""
    e = kl_job[2][0]["experience"]
    m = _mask(e).bool()
    ref_hf = _hf_logprobs(ppo_setup["actor"], e)
    torch.testing.assert_close(e["ref_logprobs"].double()[m], ref_hf[m], rtol=0, atol=5e-5)
    assert (e["old_logprobs"].double() - ref_hf)[m].abs().max() > 1e-2  # the actor moved: it is not the reference
    assert torch.equal(kl_job[2][1]["experience"]["ref_logprobs"], e["ref_logprobs"])  # TP ranks agree
    kl = openrlhf_approx_kl(e["old_logprobs"], e["ref_logprobs"], "k1") * _mask(e)
    torch.testing.assert_close(e["kl"].double() * _mask(e), kl, rtol=0, atol=1e-6)
    assert kl.abs().max() > 1e-2
    rewards = openrlhf_compute_reward(e["rewards"].double(), KL_COEF, kl, _mask(e))
    _, returns = openrlhf_gae(e["values"].double(), rewards, _mask(e), gamma=GAMMA, lambd=LAMBD)
    torch.testing.assert_close(e["returns"].double()[m], returns[m], rtol=0, atol=1e-5)
    _, no_kl = openrlhf_gae(e["values"].double(), openrlhf_compute_reward(e["rewards"].double(), 0.0, kl, _mask(e)),
                            _mask(e), gamma=GAMMA, lambd=LAMBD)
    assert (no_kl - returns)[m].abs().max() > 1e-3  # control: the coefficient shows in the returns
    assert e["kl_coef"] == KL_COEF


def test_eps_clip_and_entropy_coef_reach_the_actor_loss(kl_job):
    """Every actor micro-batch: the policy loss is OpenRLHF's PolicyLoss at ``--eps_clip 0.1`` on the dumped
    log-probs, and the loss is it minus ``--entropy_coef`` times the entropy (token sums). Control: some tokens are
    clipped at 0.1 and not at OpenRLHF's default 0.2, so the two clips give other losses."""
    told = 0
    for step in (1, 2):
        for r in kl_job[step][0]["actor"]:
            m = r["action_mask"].double()
            want = (openrlhf_policy_loss_per_token(r["logprobs"], r["old_logprobs"], r["advantages"], m,
                                                   eps_low=EPS, eps_high=EPS) * m).sum()
            got_sum, got_n = r["metrics"]["policy_loss"]
            assert float(got_sum) == pytest.approx(float(want), rel=1e-5, abs=1e-6) and int(got_n) == int(m.sum())
            total = want - ENTROPY * (r["entropy"].double() * m).sum()
            assert float(r["loss"]) == pytest.approx(float(total), rel=1e-5, abs=1e-6)
            loose = (openrlhf_policy_loss_per_token(r["logprobs"], r["old_logprobs"], r["advantages"], m) * m).sum()
            told += abs(float(loose - want)) > 1e-4
    assert told >= 1, "no micro-batch's ratio left [0.9, 1.1]: the clip was never seen"


def test_value_clip_reaches_the_critic_loss(kl_job):
    """Every critic micro-batch: OpenRLHF's ValueLoss at ``--value_clip 0.15`` on the dumped values (the critic's
    new values, the experience's old ones, the returns). Control: unclipped, some micro-batch's loss differs."""
    told = 0
    for step in (1, 2):
        for r in kl_job[step][0]["critic"]:
            m = r["action_mask"].double()
            want = (openrlhf_value_loss_per_token(r["new_values"], r["values"], r["returns"], VALUE_CLIP) * m).sum()
            assert float(r["loss"]) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
            free = (openrlhf_value_loss_per_token(r["new_values"], r["values"], r["returns"], None) * m).sum()
            told += abs(float(free - want)) > 1e-5
    assert told >= 1, "no value moved past the clip"


# ------------------------------------------------------------------------------------------ verl's corrections
BF16 = {"--bf16": "", "--advantage_estimator": "grpo", "--vllm_tensor_parallel_size": "1", "--max_epochs": "2",
        "--actor_learning_rate": "3e-2", "--generate_max_len": "8", "--dual_clip": "3.0"}


@pytest.fixture(scope="module")
def decoupled_job(ppo_setup, tmp_path_factory):
    return _job(ppo_setup, tmp_path_factory.mktemp("verl"), "decoupled", {
        **BF16, "--use_kl_loss": "", "--kl_estimator": "k3", "--init_kl_coef": "0.03", "--rollout_is": "token",
        "--rollout_is_threshold": str(IS_C), "--rollout_is_batch_normalize": "", "--rollout_rs": "token_k1",
        "--rollout_rs_threshold": f"{RS[0]}_{RS[1]}"})


def _global(recs: dict, key: str) -> torch.Tensor:
    return torch.cat([recs[r]["experience"][key] for r in (0, 1)])


def test_verls_decoupled_correction_over_the_global_batch(decoupled_job):
    """DP 2, each rank its own prompts: the rejection (token_k1 in [0.998, 1.002]) and the truncated weights
    normalised over the whole step's batch are verl's on the two ranks' samples together. Control: weights
    normalised over one rank's shard differ."""
    shards, rejected, total = 0, 0, 0
    for step in (1, 2):
        recs = decoupled_job[step]
        assert set(recs[0]["experience"]["prompt_index"].tolist()).isdisjoint(recs[1]["experience"]["prompt_index"]
                                                                              .tolist())
        resp = _global(recs, "reward_mask").bool()  # the response as generated
        old, rollout = _global(recs, "old_logprobs"), _global(recs, "vllm_logprobs")
        keep = verl_token_k1_keep(old, rollout, resp, *RS)
        assert torch.equal(_global(recs, "action_mask").bool(), keep)
        rejected, total = rejected + int((resp & ~keep).sum()), total + int(resp.sum())
        want = verl_is_weights(old, rollout, resp, "token", IS_C, normalize=True)
        got = _global(recs, "rollout_is_weights").double()
        torch.testing.assert_close(got[resp], want[resp], rtol=1e-5, atol=1e-6)
        B = recs[0]["experience"]["old_logprobs"].shape[0]
        local = verl_is_weights(old[:B], rollout[:B], resp[:B], "token", IS_C, normalize=True)
        shards += (local - want[:B])[resp[:B]].abs().max() > 1e-5
    assert shards >= 1, "one shard's normalisation equals the batch's: the check cannot tell"
    assert 0 < rejected < total, "the rejection never acted (or took everything)"


def test_the_kl_loss_is_against_the_reference(decoupled_job):
    """--use_kl_loss (k3, 0.03): in every actor micro-batch the KL term is OpenRLHF's ``compute_approx_kl`` of the
    current log-probs against the reference's, and the reference is not the actor: equal to it at step 1, apart
    after the first update."""
    for step in (1, 2):
        e = decoupled_job[step][0]["experience"]
        m = _mask(e).bool()
        gap = (e["old_logprobs"].double() - e["ref_logprobs"].double())[m].abs().max()
        assert (gap == 0) if step == 1 else (gap > 0.05), (step, gap)
        for r in decoupled_job[step][0]["actor"]:
            mm = r["action_mask"].double()
            kl = (openrlhf_approx_kl(r["logprobs"], r["ref_logprobs"], "k3") * mm).sum()
            assert float(r["metrics"]["kl_loss"][0]) == pytest.approx(float(kl), rel=1e-4, abs=1e-6)
            # ppo_actor.training_step: loss = actor_loss + kl_loss * kl_ctl (token sums here, --init_kl_coef 0.03)
            want = float(r["metrics"]["policy_loss"][0]) + 0.03 * float(kl)
            assert float(r["loss"]) == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_verls_weights_multiply_the_policy_loss(decoupled_job):
    """Each micro-batch's policy loss is verl's vanilla loss (dual clip 3) weighted by the batch's IS weights over
    the kept tokens."""
    for step in (1, 2):
        for r in decoupled_job[step][0]["actor"]:
            m = r["action_mask"].double()
            per = verl_vanilla_per_token(r["old_logprobs"], r["logprobs"], r["advantages"]) * \
                r["rollout_is_weights"].double()
            assert float(r["metrics"]["policy_loss"][0]) == pytest.approx(float((per * m).sum()), rel=1e-4, abs=1e-6)


@pytest.fixture(scope="module")
def bypass_job(ppo_setup, tmp_path_factory):
    return _job(ppo_setup, tmp_path_factory.mktemp("bypass"), "bypass", {
        **BF16, "--use_rollout_logprobs": "", "--rollout_is": "token", "--rollout_is_threshold": "2.0",
        "--rollout_rs": "token_k1", "--rollout_rs_threshold": f"{BYPASS_RS[0]}_{BYPASS_RS[1]}",
        "--rollout_correction_loss_type": "ppo_clip", "--actor_learning_rate": "1e-2"})


def test_verls_bypass_mode_loss(bypass_job):
    """--use_rollout_logprobs with the correction (verl's bypass mode, ppo_clip): the old log-probs are the
    generator's; in each micro-batch the rejection is against the current policy and the loss is verl's vanilla
    loss against the generator's log-probs over the kept tokens."""
    rejected = 0
    for step in (1, 2):
        assert torch.equal(bypass_job[step][0]["experience"]["old_logprobs"],
                           bypass_job[step][0]["experience"]["vllm_logprobs"])
        for r in bypass_job[step][0]["actor"]:
            resp = r["action_mask"].bool()
            keep = verl_token_k1_keep(r["logprobs"], r["vllm_logprobs"], resp, *BYPASS_RS)
            per = verl_vanilla_per_token(r["vllm_logprobs"], r["logprobs"], r["advantages"])
            got_sum, got_n = r["metrics"]["policy_loss"]
            assert int(got_n) == int(keep.sum()) and float(got_sum) == pytest.approx(
                float((per * keep).sum()), rel=1e-4, abs=1e-6)
            rejected += int((resp & ~keep).sum())
    assert rejected > 0


@pytest.fixture(scope="module")
def gspo_job(ppo_setup, tmp_path_factory):
    """GSPO with OpenRLHF's IS correction, from OpenRLHF's own dotted flags."""
    return _job(ppo_setup, tmp_path_factory.mktemp("gspo"), "gspo", {**BF16, "--dual_clip": None},
                ["--actor.policy_loss_type", "gspo", "--algo.advantage.is_correction_enable",
                 "--algo.advantage.is_correction_threshold", "0.5", "5.0", "--algo.kl.init_coef", "0"])


def test_gspo_with_openrlhfs_is_correction(gspo_job):
    """Each micro-batch: OpenRLHF's PolicyLoss (gspo, enable_vllm_is_correction: the sequence ratio against the
    generator's log-probs), aggregated per sequence (its token_level_loss=False), is the whole loss (no KL term:
    ``--algo.kl.init_coef 0``). Control: the ratio against the trainer's old log-probs instead gives another loss."""
    told = 0
    for step in (1, 2):
        for r in gspo_job[step][0]["actor"]:
            m = r["action_mask"].double()
            per = openrlhf_policy_loss_per_token(r["logprobs"], r["old_logprobs"], r["advantages"], m,
                                                 policy_loss_type="gspo", rollout_lp=r["vllm_logprobs"],
                                                 is_correction=("tis", 0.5, 5.0))
            seqs = m.sum(-1) > 0
            want = ((per * m).sum(-1) / m.sum(-1).clamp(min=1))[seqs].sum()  # the sequences' token means, summed
            assert int(r["count"]) == int(seqs.sum()) and float(r["loss"]) == pytest.approx(float(want), rel=1e-4,
                                                                                             abs=1e-6)
            assert float(r["metrics"]["policy_loss"][0]) == pytest.approx(float((per * m).sum()), rel=1e-4, abs=1e-6)
            plain = openrlhf_policy_loss_per_token(r["logprobs"], r["old_logprobs"], r["advantages"], m,
                                                   policy_loss_type="gspo")
            told += abs(float(((plain * m).sum(-1) / m.sum(-1).clamp(min=1))[seqs].sum() - want)) > 1e-5
    assert told >= 1
