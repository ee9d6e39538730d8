"""``rlhf.rollout.partial.PartialRollouts``, the bookkeeping of partial rollouts between steps (no engine): the
staleness bound counted in weight updates, the oldest-first choice of trained groups, K = 0 as the synchronous
trainer, the prompt queue, and the checkpointed state."""
import argparse
import json

import numpy as np
import pytest

from rlhf.rollout.partial import PartialRolloutConfig, PartialRollouts, PartialSample, new_group


def group(g, versions, done=True, n=2):
    return [PartialSample(g, k, 10 + g, [1, 2], 0, [5] * len(versions), [-1.0] * len(versions), list(versions),
                          done, done) for k in range(n)]


def test_drop_stale_counts_weight_updates_and_requeues_the_prompt():
    """``--partial_rollout_drop_stale``: a carried group too old is dropped at the start of a step."""
    p = PartialRollouts(n=2, batch_groups=2, oversample_groups=1, max_staleness=1, drop_stale=True)
    p.carried = [group(0, [3, 3], done=False), group(1, [4, 5], done=False)]
    m = p.drop_stale(5)  # group 0 has tokens 2 updates old at version 5: more than K = 1
    assert m["partial/dropped_samples"] == 2.0
    assert [g[0].group for g in p.carried] == [1] and p.requeue == [(10, [1, 2])]
    # The same carried groups under K = 2 stay.
    q = PartialRollouts(n=2, batch_groups=2, oversample_groups=1, max_staleness=2, drop_stale=True)
    q.carried = [group(0, [3, 3], done=False)]
    assert q.drop_stale(5)["partial/dropped_samples"] == 0.0 and len(q.carried) == 1
    # The requeued prompt starts again as a new group, before the sampler's prompts.
    groups = p.round_groups([(77, [9])], step_seed=1)
    assert [(g[0].prompt_index, g[0].response_ids) for g in groups] == [(11, [5, 5]), (10, []), (77, [])]


def test_by_default_nothing_is_dropped_and_due_groups_are_waited_for_and_trained_first():
    """The default staleness rule: a group that could not be carried once more (oldest token K updates old) is due:
    the round must finish it and the step trains it, before the other whole groups in round order; nothing is
    dropped. A due group still unfinished when the round ends is an error, not a silent drop."""
    p = PartialRollouts(n=2, batch_groups=2, oversample_groups=2, max_staleness=1)
    p.carried = [group(0, [3, 3], done=False)]
    assert p.drop_stale(5) == {"partial/dropped_samples": 0.0} and len(p.carried) == 1  # kept, unlike drop_stale
    groups = [group(1, [5]), group(2, [5]), group(0, [4, 5]), group(3, [], done=False)]
    assert p.due(groups, 5) == [False, False, True, False]
    assert p.due(groups, 4) == [False, False, False, False]  # at version 4 group 0 may still be carried
    train, m = p.settle(groups, 5)
    assert [g[0].group for g in train] == [1, 0] and [g[0].group for g in p.carried] == [2, 3]
    assert m["partial/max_token_age"] == 1.0 and m["partial/tokens_age_1"] == 2.0
    with pytest.raises(RuntimeError, match="1 group\\(s\\) due at version 5 not trained"):
        p.settle([group(1, [5]), group(2, [5]), group(0, [4, 5], done=False)], 5)
    # K = 2: due two updates after the oldest token; with --partial_rollout_drop_stale nothing is ever due
    assert PartialRollouts(n=2, batch_groups=2, oversample_groups=2, max_staleness=2).due(groups, 6) == \
        [False, False, True, False]
    assert PartialRollouts(n=2, batch_groups=2, oversample_groups=2, max_staleness=1, drop_stale=True).due(
        groups, 5) == [False] * 4


def test_an_older_token_shows_in_the_age_metrics():
    """The oldest trained token's age is logged as a number and in its own bin even past K (what a broken bound
    would train shows up)."""
    p = PartialRollouts(n=2, batch_groups=1, oversample_groups=1, max_staleness=1, drop_stale=True)
    m = p.trained_metrics([group(0, [2, 4, 5])], 5)
    assert m["partial/max_token_age"] == 3.0 and m["partial/tokens_age_3"] == 2.0 and m["partial/tokens_age_2"] == 0


def test_oldest_whole_groups_are_trained_first_and_the_rest_carried():
    p = PartialRollouts(n=2, batch_groups=2, oversample_groups=2, max_staleness=2)
    groups = [group(0, [3]), group(1, [4], done=False), group(2, [5, 5]), group(3, [5])]
    train, m = p.settle(groups, 5)
    assert [g[0].group for g in train] == [0, 2] and [g[0].group for g in p.carried] == [1, 3]
    assert m["partial/tokens_age_2"] == 2.0 and m["partial/tokens_age_0"] == 4.0 and m["partial/tokens_age_1"] == 0
    assert m["partial/carried_samples"] == 4.0 and m["partial/carried_unfinished"] == 2.0


def test_k0_is_the_synchronous_round():
    p = PartialRollouts(n=3, batch_groups=4, oversample_groups=5, max_staleness=0)
    assert p.new_prompts_needed() == 4  # no over-sampling: nothing may be carried across an update
    groups = p.round_groups([(i, [i]) for i in range(4)], step_seed=7)
    assert p.groups_needed(groups) == 4  # the engine runs every sample to its end
    # seeded as VLLMRollout.generate seeds prompt i of a step: seed * 1_000_003 + i * n, sample k: + k
    assert [s.seed for g in groups for s in g] == [7 * 1_000_003 + i * 3 + k for i in range(4) for k in range(3)]
    assert PartialRolloutConfig(max_staleness=0).extra_groups(4) == 0
    assert PartialRolloutConfig(partial_rollout_oversample=0.25).extra_groups(10) == 3


def test_prompt_queue_and_state_round_trip():
    batches = iter([[1, 2, 3], [4, 5, 6]])
    p = PartialRollouts(n=2, batch_groups=2, oversample_groups=1, max_staleness=1)
    assert p.take_prompts(2, lambda: next(batches)) == [1, 2]
    assert p.take_prompts(2, lambda: next(batches)) == [3, 4] and p.pending == [5, 6]
    p.carried = [group(0, [1, 2], done=False)] + [new_group(1, 3, [7], n=2, step_seed=1, position=0)]
    p.carried[0][1].done = True  # a finished sample of an MoE generator carries its routing (tokens, layers, top_k)
    p.carried[0][1].routed_experts = np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2)
    p.requeue = [(9, [8])]
    state = json.loads(json.dumps(p.state_dict()))  # plain data
    q = PartialRollouts(n=2, batch_groups=2, oversample_groups=1, max_staleness=1)
    q.load_state_dict(state)
    routed = [s.routed_experts for g in q.carried for s in g]
    assert routed[1].dtype == np.int16 and (routed[1] == p.carried[0][1].routed_experts).all()
    assert [r is None for r in routed] == [True, False, True, True]
    for g in q.carried + p.carried:
        for s in g:
            s.routed_experts = None
    assert q.carried == p.carried and q.requeue == p.requeue and q.pending == p.pending
    assert q.next_group == p.next_group


@pytest.mark.parametrize("flags,msg", [(["--max_staleness", "-1"], "--max_staleness must be >= 0, got -1"),
                                       (["--partial_rollout_oversample", "9"],
                                        "--partial_rollout_oversample must be in [0, 8], got 9")])
def test_bad_values_name_the_flag(flags, msg):
    ap = argparse.ArgumentParser()
    PartialRolloutConfig.add_args(ap)
    with pytest.raises(ValueError) as e:
        PartialRolloutConfig.from_args(ap.parse_args(flags))
    assert str(e.value) == msg


@pytest.mark.parametrize("flags,needle", [
    (["--agent_func_path", "x.py", "--partial_rollout_drop_stale"],
     "--partial_rollout_drop_stale with --agent_func_path: an agent's carried sessions are parked programs"),
    (["--vllm_generate_batch_size", "2"], "--vllm_generate_batch_size 2 must be at least --rollout_batch_size 4"),
    (["--vllm_generate_batch_size", "9"], "--vllm_generate_batch_size 9 starts 5 groups beyond --rollout_batch_size 4: "
                                          "more groups could come due"),
    (["--partial_rollout_oversample", "1.5"], "--partial_rollout_oversample 1.5 starts 6 groups beyond"),
])
def test_combinations_not_built_are_refused_by_name(flags, needle, tmp_path):
    """The job's check (``check_partial`` on the typed job, as ``validate`` runs it before any model); OpenRLHF's
    dotted flags reach the same flags."""
    from rlhf.config.migration import add_launcher_args
    from rlhf.config.openrlhf import translate
    from rlhf.ppo.args import PPOJobConfig, add_args
    from rlhf.rollout.partial import check_partial

    (tmp_path / "p.jsonl").write_text('{"prompt": "1 + 1 ="}\n')
    p = argparse.ArgumentParser()
    add_args(p)
    add_launcher_args(p)

    def job(extra):
        return PPOJobConfig.from_args(p.parse_args(translate(
            ["--pretrain", "m", "--prompt_data", str(tmp_path / "p.jsonl"), "--save_path", "o", "--reward_fn",
             "rlhf.rewards.verifiers:math_reward", "--rollout_batch_size", "4", *extra], "ppo", set(p._option_string_actions))))

    with pytest.raises(ValueError, match=needle):
        check_partial(job(["--partial_rollout", *flags]))
    # without --partial_rollout the same flags pass this check (over-sampling alone is refused: nothing carries it)
    if flags[0] == "--vllm_generate_batch_size":
        with pytest.raises(ValueError, match="only --partial_rollout carries over"):
            check_partial(job(flags))
    else:
        check_partial(job(flags))
    if "beyond" in needle:  # dropping what is too old needs no bound on what is started
        check_partial(job(["--partial_rollout", "--partial_rollout_drop_stale", *flags]))
    j = job(["--train.async_enable", "--train.partial_rollout_enable", "--train.async_queue_size", "2",
             "--rollout.vllm_generate_batch_size", "6"])
    assert (j.partial.partial_rollout, j.partial.max_staleness, j.partial.extra_groups(4)) == (True, 2, 2)


def _fake_megatron_rollout(monkeypatch, vocab=13, eos=(3, 7)):
    """``MegatronRollout`` over a causal stand-in for the actor: position t's logits depend on tokens 0..t only (a
    running mean of embeddings), so right padding must not reach a real position."""
    import types

    import torch

    import rlhf.models.pipeline
    from rlhf.rollout.megatron_generator import MegatronRollout

    monkeypatch.setattr(rlhf.models.pipeline, "gather_vocab_parallel", lambda x: x)  # TP 1, no megatron groups
    emb = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def logits(ids):  # (n, L) -> (n, L, V)
        e = emb[ids]
        return e + 2.0 * e.cumsum(1) / torch.arange(1, ids.shape[1] + 1, dtype=torch.float64)[None, :, None]

    r = MegatronRollout.__new__(MegatronRollout)
    r.mesh = types.SimpleNamespace(pp=1, ep=1, dp=1, dp_rank=0, tp_rank=0, pp_rank=0, is_last_stage=True)
    r.actor = types.SimpleNamespace(forward=lambda mbs: [{"output": logits(mbs[0]["input_ids"])}],
                                    spec=types.SimpleNamespace(vocab_size=vocab, num_experts=0),
                                    module=torch.nn.Module())
    r.eos_ids = set(eos)
    return r, logits


def _alone(logits, s, version, temperature, max_tokens, stops):
    """The plain reference: one sample on its own, a forward of exactly its tokens per new token."""
    import torch

    gen, ids, toks, lps = torch.Generator().manual_seed(s.round_seed(version)), list(s.prompt_ids + s.response_ids), [], []
    while len(s.response_ids) + len(toks) < max_tokens:
        z = logits(torch.tensor([ids]))[0, -1] / temperature
        cdf = torch.softmax(z, dim=-1).cumsum(-1)
        u = torch.rand(1, generator=gen, dtype=torch.float64)  # the documented draw: one uniform per row and token,
        t = int((cdf > u * cdf[-1]).nonzero()[0])  # the first token whose cumulative mass passes it
        toks.append(t)
        lps.append(float((z[t] - torch.logsumexp(z, -1)).float()))  # fp32 log-probs out, as vLLM hands them
        ids.append(t)
        if t in stops:
            break
    return toks, lps


@pytest.mark.parametrize("need", [1, 3])
def test_megatron_fallback_round_matches_samples_generated_alone(monkeypatch, need):
    """``MegatronRollout.partial_round`` (the fallback's partial rollouts): every unfinished sample of the replica in
    one right-padded batch, one token per forward, stopped once ``need`` groups are whole. Each sample's tokens and
    log-probs are a prefix of what the sample generates alone (its own seed; a carried one continues from its
    prefix with the continuation seed), the whole of it for finished ones; with every group needed (K = 0) every
    sample runs to its end; both end-of-sequence ids stop a sample."""
    import copy

    from rlhf.rollout.partial import PartialSample

    r, logits = _fake_megatron_rollout(monkeypatch)
    groups = [[PartialSample(0, k, 0, [1, 2, 4], 11 + k) for k in range(2)],
              [PartialSample(1, k, 1, [5], 21 + k, [6, 8], [-1.0, -2.0], [0, 0]) for k in range(2)],  # carried
              [PartialSample(2, k, 2, [9, 10, 11, 12, 2], 31 + k) for k in range(2)]]
    before = copy.deepcopy(groups)
    aborted, generated = r.partial_round(groups, need, temperature=0.7, top_p=1.0, max_tokens=9, version=1)
    assert sum(all(s.done for s in g) for g in groups) >= min(need, 3)
    assert aborted == sum(not s.done for g in groups for s in g) and (aborted == 0) == (need == 3), aborted
    assert generated == sum(len(s.response_ids) - len(b.response_ids) for g, gb in zip(groups, before)
                            for s, b in zip(g, gb))
    for g, gb in zip(groups, before):
        for s, b in zip(g, gb):
            toks, lps = _alone(logits, b, 1, 0.7, 9, {3, 7})
            new = s.response_ids[len(b.response_ids):]
            assert new == toks[:len(new)] and s.logprobs[len(b.logprobs):] == lps[:len(new)], (s, toks)
            assert s.versions == b.versions + [1] * len(new)
            assert s.done == (new == toks) and s.finished == (s.done and new[-1] in (3, 7))
    stopped_by = {s.response_ids[-1] for g in groups for s in g if s.finished}
    # both ids stop a sample where every sample runs to its end (K = 0); stopped after one group, only 3 occurs
    assert stopped_by == ({3, 7} if need == 3 else {3}), stopped_by


def _job(tmp_path, extra):
    from rlhf.config.migration import add_launcher_args
    from rlhf.config.openrlhf import translate
    from rlhf.ppo.args import PPOJobConfig, add_args

    (tmp_path / "p.jsonl").write_text('{"prompt": "1 + 1 ="}\n')
    p = argparse.ArgumentParser()
    add_args(p)
    add_launcher_args(p)
    return PPOJobConfig.from_args(p.parse_args(translate(
        ["--pretrain", "m", "--prompt_data", str(tmp_path / "p.jsonl"), "--save_path", "o", "--reward_fn",
         "rlhf.rewards.verifiers:math_reward", "--rollout_batch_size", "4", *extra], "ppo", set(p._option_string_actions))))


@pytest.mark.parametrize("flags,used,weights", [
    ([], "AReaL's decoupled PPO loss", ("icepop", None, 5.0)),
    (["--use_tis", "--tis_cap", "3"], "the flags' own: --use_tis (tis, [0, 3])", ("tis", None, 3.0)),
    (["--partial_rollout_correction", "none"], "none (--partial_rollout_correction none)", None),
    (["--partial_rollout_correction", "mask_offpolicy"], "slime's --mask-offpolicy-in-partial-rollout", None),
    (["--use_rollout_logprobs"], "verl's bypass mode", None),
])
def test_partial_rollouts_are_corrected_by_default_and_say_how(tmp_path, flags, used, weights):
    """A carried token is never trained without the correction the start-up line names: AReaL's decoupled loss
    (icepop bounds [0, 5] on p_trainer / p_generator) unless the flags ask for their own or for none."""
    from rlhf.rollout.partial import check_partial

    job = _job(tmp_path, ["--partial_rollout", *flags])
    check_partial(job)
    assert job.partial.correction_used.startswith(used), job.partial.correction_used
    c = job.correction
    assert ((c.is_correction_type, c.tis_floor, c.tis_cap) if c.use_tis else None) == weights
    plain = _job(tmp_path, [])  # no partial rollouts: no correction is added
    check_partial(plain)
    assert not plain.correction.enabled and plain.partial.correction_used == ""


def test_openrlhf_async_alone_is_one_step_off_whole_batches(tmp_path, caplog):
    """OpenRLHF's --train.async_enable (queue size 2) without --train.partial_rollout_enable: whole groups, two
    batches generated ahead, nothing aborted; each translated flag that differs says so in one log line."""
    import logging

    from rlhf.rollout.partial import check_partial

    caplog.set_level(logging.INFO, logger="rlhf.config.openrlhf")
    job = _job(tmp_path, ["--train.async_enable", "--train.async_queue_size", "2"])
    check_partial(job)
    p = job.partial
    assert (p.enabled, p.partial_rollout, p.whole_groups, p.max_staleness, p.extra_groups(4)) == (True, False, True,
                                                                                                2, 8)
    lines = [r.getMessage() for r in caplog.records if "(OpenRLHF) ->" in r.getMessage()]
    assert [ln.split(" (OpenRLHF)")[0] for ln in lines] == ["--train.async_enable", "--train.async_queue_size"], lines
    assert "--async_one_step_off, which differs: as in OpenRLHF each trained batch was generated whole" in lines[0]
    with pytest.raises(ValueError, match="--vllm_generate_batch_size 12 with --async_one_step_off"):
        check_partial(_job(tmp_path, ["--train.async_enable", "--rollout.vllm_generate_batch_size", "12"]))


def test_mask_offpolicy_trains_this_steps_tokens_only():
    """slime's --mask-offpolicy-in-partial-rollout: a continued reply's earlier tokens leave the loss, a reply carried
    whole from an earlier round leaves it whole, this step's replies stay (slime/rollout/sglang_rollout.py)."""
    from types import SimpleNamespace

    import torch

    from rlhf.ppo.partial_step import mask_offpolicy

    samples = [SimpleNamespace(versions=[3, 3, 4, 4]), SimpleNamespace(versions=[3, 3]), SimpleNamespace(versions=[4])]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    exp = SimpleNamespace(samples=samples, batch={"action_mask": mask.clone()})
    m = mask_offpolicy(exp, 4, SimpleNamespace(dp=1))
    assert exp.batch["action_mask"].tolist() == [[False, False, True, True], [False] * 4, [True, False, False, False]]
    assert m["partial/masked_offpolicy_frac"] == pytest.approx(4 / 7)
