"""The RLVR loss options reach a real PPO run (launch/ppo.py's body in this process, one rank, the megatron
generator, a rule reward): RLOO with GSPO at the paper's clip range clips whole sequences on the second pass over a
batch, where token-level PPO at the same range clips parts of them; --entropy_coef moves the gradient; evaluation
during training scores what a direct generation scores. The formulas themselves: tests/algo/test_rlvr_losses.py."""
from __future__ import annotations

import json

import pytest
import torch

from ppo_common import TINY_GRPO, ppo_args

# Training runs in this process (main(argv)): pytest-timeout interrupts a test whose run hangs after 300 s, 5x the
# slowest of these files' tests on a loaded 2-core AMD EPYC (36-62 s, 2026-11-27; test_rlvr_options 11-50 s).
pytestmark = pytest.mark.timeout(300)


def _run(setup, out, monkeypatch, capsys, low_high, **flags):
    from helpers import free_port
    from rlhf.ppo import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    # char_code_reward: (almost) every sequence has a nonzero advantage; 10-token replies: room to clip a part
    argv = ppo_args(setup, str(out), **{**TINY_GRPO, "--reward_fn": "_rule_reward:char_code_reward",
                                        "--rollout_backend": "megatron", "--max_samples": "8",
                                        "--generate_max_len": "10",
                                        "--advantage_estimator": "rloo", "--policy_loss_type": "gspo",
                                        "--entropy_coef": "0.01", "--max_epochs": "2",
                                        "--actor_learning_rate": "1e-5", **flags}) + ["--eps_clip_low_high", *low_high]
    assert main(argv) == 0
    from rlhf.observability.metrics import read_metrics_jsonl

    m = read_metrics_jsonl(str(out / "metrics.jsonl"), "ppo")
    return [m[s] for s in sorted(m)], capsys.readouterr().err


def _record_zero_gradients(monkeypatch) -> list[list[bool]]:
    """Wraps the policy loss: for every sequence of every training call, which of its tokens (those with a nonzero
    advantage) get no gradient from the clipped objective, read from the gradient of the loss with respect to the
    log-probs (a clipped term is constant), not from the loss's own clip metric."""
    from rlhf.algo import ppo_losses

    real, seqs = ppo_losses.policy_loss, []

    def recording(logprobs, old_logprobs, advantages, action_mask, **kw):
        out = real(logprobs, old_logprobs, advantages, action_mask, **kw)
        if logprobs.requires_grad:
            grad, = torch.autograd.grad(out[0], logprobs, retain_graph=True)  # (B, T)
            live = (action_mask != 0) & (advantages != 0)
            seqs.extend((grad[b][live[b]] == 0).tolist() for b in range(grad.shape[0]) if live[b].any())
        return out

    monkeypatch.setattr(ppo_losses, "policy_loss", recording)
    return seqs


def test_gspo_rloo_entropy_reach_the_update(ppo_setup, tmp_path, monkeypatch, capsys):
    """RLOO with GSPO at a 3e-4/4e-4 clip range, 2 passes over each batch. GSPO clips whole sequences: every token of
    a sequence gets no gradient or none does, and some sequences are clipped (the second pass, where ratios moved);
    token-level PPO at the same range and aggregation (one step, the same rollouts) clips parts of sequences and
    makes another update (its grad norm differs). The run's estimator is named in the log from the function it
    calls. --entropy_coef 0 instead of 0.01 (one step, the same rollouts) changes the grad norm."""
    seqs = _record_zero_gradients(monkeypatch)
    gspo, log = _run(ppo_setup, tmp_path / "gspo", monkeypatch, capsys, ["3e-4", "4e-4"])
    assert "advantage estimator: rloo (no critic, groups of 2 samples per prompt)" in log, log[-3000:]
    assert "actor loss: gspo, ratio clipped to [0.9997, 1.0004], seq_mean_token_mean, entropy_coef 0.01, KL in the " \
           "reward" in log, log[-3000:]
    # the first pass over a batch has ratio 1 (nothing clipped); on the second, sequences whose ratio moved past
    # +-4e-4 in the direction of their advantage are clipped, whole
    assert all(h["actor/clip_frac"] > 0 for h in gspo), gspo
    whole = sum(all(s) for s in seqs)
    assert 0 < whole < len(seqs) and all(all(s) or not any(s) for s in seqs), seqs  # measured: 14 of 28 clipped
    seqs.clear()
    ppo, log = _run(ppo_setup, tmp_path / "ppo", monkeypatch, capsys, ["3e-4", "4e-4"], **{
        "--policy_loss_type": "ppo", "--loss_agg_mode": "seq_mean_token_mean", "--stop_after_steps": "1"})
    assert "actor loss: ppo, ratio clipped to [0.9997, 1.0004], seq_mean_token_mean" in log, log[-3000:]
    assert ppo[0]["reward"] == gspo[0]["reward"] and ppo[0]["response_length"] == gspo[0]["response_length"]
    partial = sum(any(s) and not all(s) for s in seqs)
    assert partial > 0, seqs  # measured: 3 of 12 sequences in part, 3 whole
    # measured (step 1): 0.810 against 0.682; runs of the same settings agree to the last bit
    assert ppo[0]["actor/grad_norm"] != pytest.approx(gspo[0]["actor/grad_norm"], rel=1e-3), (ppo[0], gspo[0])
    no_entropy, log = _run(ppo_setup, tmp_path / "no_entropy", monkeypatch, capsys, ["3e-4", "4e-4"],
                           **{"--entropy_coef": "0", "--stop_after_steps": "1"})
    assert "actor loss: gspo, ratio clipped to [0.9997, 1.0004], seq_mean_token_mean, KL in the reward" in log
    assert no_entropy[0]["reward"] == gspo[0]["reward"]
    # measured (step 1): 0.68095 against 0.68210, 1.7e-3 relative
    assert no_entropy[0]["actor/grad_norm"] != pytest.approx(gspo[0]["actor/grad_norm"], rel=1e-4), \
        (no_entropy[0], gspo[0])


def test_dynamic_filtering_fills_the_batch_and_resumes_exactly(ppo_setup, tmp_path, monkeypatch, capsys):
    """A binary verifier (even reply length) on groups of 2: about half the groups agree and are dropped, and
    further rollouts fill the batch. With the overlong penalty on 3-token replies. Three steps straight equal one
    step, a stop, and a resume (the sampler's position after the extra rollouts is in the checkpoint)."""
    from crash_harness import assert_resumed
    from helpers import free_port
    from rlhf.ppo import main

    def run(out, *extra):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--reward_fn": "_rule_reward:parity_reward",
                                                "--rollout_backend": "megatron", "--max_samples": "64",
                                                "--num_episodes": "1", "--save_steps": "1",
                                                "--advantage_estimator": "grpo", "--dynamic_filtering": "",
                                                "--overlong_buffer_len": "2", "--actor_learning_rate": "1e-3",
                                                "--dynamic_filtering_max_rounds": "8"})
        assert main(argv + list(extra)) == 0
        return capsys.readouterr().err

    straight = tmp_path / "straight"
    run(straight, "--stop_after_steps", "3")
    from rlhf.observability.metrics import read_metrics_jsonl

    m = read_metrics_jsonl(str(straight / "metrics.jsonl"), "ppo")
    assert sorted(m) == [1, 2, 3]
    for s in m:  # about 1 group in 5 passes here
        d = {k.split("/")[1]: v for k, v in m[s].items() if k.startswith("dynamic_filtering/")}
        assert d["pass_rate"] < 1 and d["rounds"] >= 2, d  # groups were dropped and further rollouts made
        assert d["prompts"] == 4 * d["rounds"] and d["generated_tokens"] == d["prompts"] * 2 * 3, d
        assert d["filled"] == max(0, 4 - round(d["pass_rate"] * d["prompts"])), d  # short only after 8 rollouts
        assert m[s]["advantages_abs"] > 0, m[s]
        assert m[s]["overlong_penalized_frac"] == 1.0, m[s]  # every 3-token reply is past 3 - 2 tokens
    assert any(m[s]["dynamic_filtering/filled"] == 0 for s in m), m
    resumed = tmp_path / "resumed"
    run(resumed, "--stop_after_steps", "1")
    from rlhf.config.openrlhf import without_effect

    # with every OpenRLHF flag accepted as "no effect here" (tests/test_openrlhf_cli.py): the metrics below show it
    log = run(resumed, "--load_checkpoint", "--stop_after_steps", "2", *without_effect("ppo"))
    assert_resumed(log, "ppo", step=1)
    assert "--ckpt.max_mem (OpenRLHF) accepted, no effect here" in log
    got = read_metrics_jsonl(str(resumed / "metrics.jsonl"), "ppo")
    # the resumed steps drew the same prompts and samples: the same metrics to the last bit (timings, memory and
    # the weight-sync counter of the new process aside)
    skip = ("time/", "tokens_per_s", "mem/", "offload/", "weight_sync/", "weight_version")
    for s in (2, 3):
        same = {k: v for k, v in m[s].items() if not k.startswith(skip)}
        assert {k: v for k, v in got[s].items() if not k.startswith(skip)} == same, s
        assert "dynamic_filtering/pass_rate" in same and "reward" in same


def test_one_update_per_batch_skips_the_old_logprob_forward(ppo_setup, tmp_path, monkeypatch, capsys):
    """With one on-policy update per batch (--max_epochs 1, TINY_GRPO's --train_batch_size = the step's 8 samples)
    the old log-probs are the update's own forward, detached: no actor forward in make_experience, ratio exactly 1,
    and the same gradient as with the forward (within fp32 rounding: the two forwards of the same weights differ in
    the last bits), so the same loss and grad norm step by step; the drift check is measured in the update."""
    from helpers import free_port
    from rlhf.ppo import main

    def run(out, *extra):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--reward_fn": "_rule_reward:char_code_reward",
                                                "--rollout_backend": "megatron", "--max_samples": "8",
                                                "--actor_learning_rate": "1e-3", "--max_epochs": "1"})
        assert main(argv + list(extra)) == 0
        return json.load(open(out / "ppo_result.json"))["history"], capsys.readouterr().err

    skip, log = run(tmp_path / "skip")
    assert "old log-probs: the update's own forward, detached" in log, log[-2000:]
    keep, log = run(tmp_path / "keep", "--old_logprobs_forward", "always")
    assert "old log-probs: the actor's forward in make_experience (--old_logprobs_forward always)" in log
    assert len(skip) == len(keep) == 2
    for a, b in zip(skip, keep):
        assert a["advantages_abs"] > 0.1  # the policy gradient is live, not only the KL loss's
        assert "time/actor_fwd" not in a and b["time/actor_fwd"] > 0
        assert a["actor/ratio"] == 1.0 and abs(b["actor/ratio"] - 1.0) < 1e-6
        # fp32 rounding of one forward against another (|log ratio| <= 1e-6 per token): relative 1e-5 is loose
        for k in ("actor/policy_loss", "actor/grad_norm", "entropy", "reward"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (k, a[k], b[k])
        assert 0 < a["rollout_logprob_drift_max"] <= 1e-5 and a["rollout_logprob_drift"] <= a["rollout_logprob_drift_max"]


def test_rollout_correction_reaches_the_update(ppo_setup, tmp_path, monkeypatch, capsys):
    """OpenRLHF's --algo.advantage.is_correction_type tis against icepop at bounds that bite (0.8 1.25), one step
    each from the same rollouts. The generator's log-probs stand for a stale behaviour policy: every third response
    token's is lowered by 0.3 (w = e^0.3 = 1.35 > 1.25 there, about 1 elsewhere). tis clamps those weights (clipped,
    nothing masked), icepop zeroes them (masked, nothing clipped); the mean weight and the update differ. The
    formulas themselves: tests/algo/test_rollout_correction.py."""
    from helpers import free_port
    from rlhf.ppo import main, stages

    real = stages.generator_logprobs

    def stale(local, T):
        return real(local, T) - 0.3 * (torch.arange(T) % 3 == 0).to(torch.float32)  # (B, T)

    monkeypatch.setattr(stages, "generator_logprobs", stale)

    def run(kind):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        argv = ppo_args(ppo_setup, str(tmp_path / kind), **{
            **TINY_GRPO, "--reward_fn": "_rule_reward:char_code_reward", "--rollout_backend": "megatron",
            "--max_samples": "8", "--max_epochs": "1", "--stop_after_steps": "1"})
        assert main(argv + ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_threshold",
                            "0.8", "1.25", "--algo.advantage.is_correction_type", kind]) == 0
        capsys.readouterr()
        from rlhf.observability.metrics import read_metrics_jsonl

        return read_metrics_jsonl(str(tmp_path / kind / "metrics.jsonl"), "ppo")[1]

    tis, ice = run("tis"), run("icepop")
    assert tis["reward"] == ice["reward"]  # the same rollouts
    assert tis["actor/rollout_corr_masked_frac"] == 0 and 0.2 < tis["actor/rollout_corr_clipped_frac"] < 0.5, tis
    assert ice["actor/rollout_corr_clipped_frac"] == 0 and 0.2 < ice["actor/rollout_corr_masked_frac"] < 0.5, ice
    assert ice["actor/rollout_corr_masked_frac"] == tis["actor/rollout_corr_clipped_frac"]  # the same tokens
    assert tis["actor/rollout_is_weight"] > ice["actor/rollout_is_weight"] > 0.99, (tis, ice)
    assert tis["actor/grad_norm"] != pytest.approx(ice["actor/grad_norm"], rel=1e-4), (tis, ice)


def test_openrlhf_reward_file_and_its_extra_logs(ppo_setup, tmp_path, monkeypatch):
    """OpenRLHF's examples/python/reward_func.py, unchanged (tests/peers), as --remote_rm_url: its random 0/1
    rewards train the step and its extra log (the same tensor) reaches metrics.jsonl and TensorBoard as
    reward_extra/dummy_scores, equal to the logged reward."""
    import os

    from helpers import REPO, free_port
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlhf.observability.metrics import read_metrics_jsonl
    from rlhf.ppo import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = tmp_path / "o"
    argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--rollout_backend": "megatron", "--max_samples": "8",
                                            "--remote_rm_url": os.path.join(REPO, "tests/peers/openrlhf/reward_func.py"),
                                            "--tensorboard": str(out / "tb")})
    assert main(argv) == 0
    m = read_metrics_jsonl(str(out / "metrics.jsonl"), "ppo")
    assert sorted(m) == [1, 2]
    for s in m:
        assert m[s]["reward_extra/dummy_scores"] == pytest.approx(m[s]["reward"], abs=1e-6), m[s]
    ev = EventAccumulator(str(out / "tb"))
    ev.Reload()
    assert "ppo/reward_extra/dummy_scores" in ev.Tags()["scalars"]


def _sample_like_the_fallback_generator(model, prompt_ids, k, temperature, max_tokens, eos, seed):
    """k replies to one prompt from a transformers model, drawn as rlhf/rollout/megatron_generator.py documents its
    sampling (one CPU generator per prompt; every step, one uniform per reply, the first token whose cumulative
    float64 softmax of logits / temperature passes it; each reply cut after its EOS): independent of the trainer's
    model, data and reward code."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt_ids] * k)  # (k, P)
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, -1].double()  # (k, V)
        cdf = torch.softmax(logits / temperature, dim=-1).cumsum(-1)  # (k, V)
        u = torch.rand(k, generator=gen, dtype=torch.float64)
        tok = (cdf > (u * cdf[:, -1])[:, None]).int().argmax(-1, keepdim=True)  # (k, 1)
        ids = torch.cat([ids, tok], dim=1)
    rows = ids[:, len(prompt_ids):].tolist()
    return [r[:r.index(eos) + 1] if eos in r else r for r in rows]


def test_evaluation_during_training(ppo_setup, tmp_path, monkeypatch):
    """--eval_dataset: held-out reward and pass@k at step 0, every --eval_steps and after the last step, in
    metrics.jsonl (prefix eval); pass@k is the mean over prompts of the best of k, so it is at least the mean.
    Every held-out prompt is used: more of them than the training's --max_samples (which once capped them). The
    step-0 reward equals a direct generation and scoring of the same prompts: the actor's HF checkpoint in
    transformers, sampled with the run's seed and --eval_temperature, scored by the reward function called
    directly. The run stops after step 2 and resumes from its checkpoint: no evaluation is repeated (the resumed
    run does not evaluate at its start, step 2's evaluation ran before the save)."""
    import transformers
    from _rule_reward import char_code_reward
    from helpers import free_port
    from ppo_common import write_prompts

    from rlhf.data.mixing import mix
    from rlhf.ppo import main
    from rlhf.ppo.evaluation import pass_at_k

    out = tmp_path / "o"
    held_out = write_prompts(tmp_path / "eval.jsonl", 25, seed=9)
    argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--rollout_backend": "megatron", "--max_samples": "20",
                                            "--reward_fn": "_rule_reward:char_code_reward", "--eval_dataset": held_out,
                                            "--eval_steps": "2", "--eval_n_samples_per_prompt": "3",
                                            "--num_episodes": "1", "--save_steps": "2"})
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert main(argv + ["--stop_after_steps", "2"]) == 0
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert main(argv + ["--load_checkpoint"]) == 0
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    ev = {r["step"]: r for r in records if r["prefix"] == "eval"}
    # 20 prompts / 4 per step: 5 steps; each evaluation once, the resumed run's (4, 5) after the first run's
    assert [r["step"] for r in records if r["prefix"] == "eval"] == [0, 2, 4, 5], records
    assert sorted(r["step"] for r in records if r["prefix"] == "ppo") == [1, 2, 3, 4, 5]
    for m in ev.values():
        assert m["prompts"] == 25 and 0 <= m["reward"] <= m["pass@3"] <= 1 and m["response_length"] == 3, m
    assert pass_at_k(torch.tensor([0.0, 1.0, 0.5, 0.2, 0.2, 0.2]), 3) == pytest.approx((2.1 / 6, 0.6))

    tok = transformers.AutoTokenizer.from_pretrained(ppo_setup["actor"])
    model = transformers.AutoModelForCausalLM.from_pretrained(ppo_setup["actor"], torch_dtype=torch.float32).eval()
    records = [json.loads(line)["prompt"] for line in open(held_out)]
    prompts = [records[j] for _, j in mix([len(records)], None, None, seed=3)]  # the data layer's order, --seed 3
    seed = 3 * 100_003 + 7_777_777 + 0  # --seed 3, step 0: the evaluation's generation seed
    texts, replies = [], []
    for i, p in enumerate(prompts):
        rows = _sample_like_the_fallback_generator(model, tok(p).input_ids, 3, 0.6, 3, tok.eos_token_id,
                                                   seed * 1_000_003 + i)
        texts += [p] * 3
        replies += tok.batch_decode(rows, skip_special_tokens=True)
    direct = torch.tensor(char_code_reward(texts, replies))
    mean, best = pass_at_k(direct, 3)
    # fp32 HF against fp32 megatron logits (within ~1e-6) draw the same tokens; the rewards are sevenths
    assert ev[0]["reward"] == pytest.approx(mean, abs=1e-6) and ev[0]["pass@3"] == pytest.approx(best, abs=1e-6), \
        (ev[0], mean, best)
    assert len(set(replies)) > 25, replies  # sampled replies, not one per prompt


def test_eval_needs_a_rule_reward(ppo_setup, tmp_path, monkeypatch, capsys):
    from rlhf.ppo import main

    argv = ppo_args(ppo_setup, str(tmp_path / "o"), **{"--eval_dataset": ppo_setup["prompts"]})
    assert main(argv) == 2
    assert "--eval_dataset scores the held-out replies with the run's rule reward" in capsys.readouterr().err


def test_dynamic_filtering_regenerates_with_vllm(ppo_setup, tmp_path, monkeypatch, capsys):
    """With vLLM on CPU the engine releases its weights after each rollout; dynamic filtering's further rounds within
    a step must sync them again (once failed: "vLLM's weights were freed after the last rollout")."""
    from helpers import free_port
    from rlhf.observability.metrics import read_metrics_jsonl
    from rlhf.ppo import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = tmp_path / "o"
    argv = ppo_args(ppo_setup, str(out), **{**TINY_GRPO, "--reward_fn": "_rule_reward:parity_reward",
                                            "--rollout_backend": "vllm", "--max_samples": "64",
                                            "--dynamic_filtering": "", "--dynamic_filtering_max_rounds": "4",
                                            "--stop_after_steps": "2", "--actor_learning_rate": "1e-3"})
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    m = read_metrics_jsonl(str(out / "metrics.jsonl"), "ppo")
    assert sorted(m) == [1, 2] and max(s["dynamic_filtering/rounds"] for s in m.values()) >= 2, m
