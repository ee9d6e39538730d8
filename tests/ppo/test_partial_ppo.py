"""``--partial_rollout`` in a real PPO job (launch/ppo.py, one or two ranks, vLLM in-process, GRPO with a rule reward).
Packed micro-batches formed by token count (``--use_dynamic_batch``) in every job. The tiny actor's
generation_config.json names 25 end-of-sequence tokens (as Llama 3 names several), so its random
replies end at very different lengths and a step's groups finish long before its longest reply:
- ``--max_staleness 0`` is the synchronous trainer, bit for bit (the same weights after 3 steps; negative control:
  ``--max_staleness 1``, which carries samples across updates, ends elsewhere);
- ``--max_staleness 1``: vLLM is stopped early (samples aborted and carried), carried tokens are trained one update
  old and never older, and every trained group is whole;
- a job resumed from the checkpoint after step 1, with samples carried, ends with the straight run's weights, and
  so does one SIGKILLed at the crash harness's kill points (mid-save, between steps, mid-export);
- two vLLM engines (data parallel) stop and step together, and CP 2 (the same two engines) matches them;
- one engine at TP 2 over two ranks with a LoRA actor;
- with dynamic filtering: K = 0 is the synchronous filtered step, K = 1 trains only groups that pass.
Three steps each, 16 jobs (5 of them the crash harness's launches), about 20-45 s a job on a 2-core machine."""
import json
import os
import shutil

import pytest
from helpers import REPO, require, run_torchrun, tail

from ppo_common import TINY_GRPO, ppo_args

require("vllm")
PPO = os.path.join(REPO, "launch", "ppo.py")
STEPS = ["--num_episodes", "1", "--max_samples", "12"]  # 12 prompts / 4 per step: 3 steps
LONG = ["--max_samples", "32", "--max_ckpt_num", "8"]  # 8 steps (every checkpoint kept): the K = 1 runs whose
# carried replies, drops and lengths are compared
# Every job forms its micro-batches by token count, packed (the carried replies reach the update as any others)
DYNAMIC = ["--use_dynamic_batch", "--packing_samples", "--max_tokens_per_gpu", "96"]


@pytest.fixture(scope="module")
def eos_actor(ppo_setup, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("eos_actor") / "actor")
    shutil.copytree(ppo_setup["actor"], d)
    eos = json.load(open(os.path.join(d, "config.json"))).get("eos_token_id")
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [eos] + list(range(100, 124))}, f)
    return d


def _args(ppo_setup, actor, save, *extra):
    return ppo_args({**ppo_setup, "actor": actor}, str(save), **{
        **TINY_GRPO, "--reward_fn": "_rule_reward:char_code_reward", "--generate_max_len": "16",
        "--save_steps": "1", "--actor_learning_rate": "1e-3"}) + STEPS + DYNAMIC + list(extra)


def _run(ppo_setup, actor, save, *extra, timeout=600, nproc=1):
    args = _args(ppo_setup, actor, save, *extra)
    p = run_torchrun(PPO, nproc, args, timeout=timeout, PYTHONPATH=f"{REPO}{os.pathsep}{os.path.dirname(__file__)}")
    assert p.returncode == 0, tail(p)
    from rlhf.observability.metrics import read_metrics_jsonl

    m = read_metrics_jsonl(os.path.join(save, "metrics.jsonl"), "ppo")
    return [m[s] for s in sorted(m)], p


def _weights(save):
    from safetensors.torch import load_file

    return load_file(os.path.join(save, "model.safetensors"))


def _same(a, b):
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


K1 = ["--partial_rollout", "--max_staleness", "1", "--partial_rollout_oversample", "1"]
K1_LONG = K1 + LONG


@pytest.fixture(scope="module")
def k1(ppo_setup, eos_actor, tmp_path_factory):
    save = tmp_path_factory.mktemp("k1")
    hist, p = _run(ppo_setup, eos_actor, save, *K1_LONG)
    return save, hist, p


@pytest.fixture(scope="module")
def sync(ppo_setup, eos_actor, tmp_path_factory):
    save = tmp_path_factory.mktemp("sync")
    hist, _ = _run(ppo_setup, eos_actor, save, *LONG)
    return save, hist


def test_k0_is_the_synchronous_trainer_bit_for_bit(ppo_setup, eos_actor, k1, sync, tmp_path):
    k0, _ = _run(ppo_setup, eos_actor, tmp_path / "k0", "--partial_rollout", "--max_staleness", "0", *LONG)
    assert [h["reward"] for h in k0] == [h["reward"] for h in sync[1]]
    assert [h["response_length"] for h in k0] == [h["response_length"] for h in sync[1]]
    assert all(h["partial/aborted_samples"] == 0 and h["partial/carried_samples"] == 0 for h in k0), k0
    assert _same(_weights(tmp_path / "k0"), _weights(sync[0]))
    assert not _same(_weights(k1[0]), _weights(sync[0]))  # negative control: K = 1 carries, ends elsewhere


def test_k1_stops_early_carries_and_bounds_the_age(k1):
    _, hist, p = k1
    assert len(hist) == 8
    assert sum(h["partial/aborted_samples"] for h in hist) > 0, hist  # vLLM was stopped with samples unfinished
    assert any(h.get("partial/tokens_age_1", 0) > 0 for h in hist[1:]), hist  # carried tokens trained 1 update old
    assert all(h["partial/max_token_age"] <= 1 for h in hist), [h["partial/max_token_age"] for h in hist]
    assert all(h["partial/trained_groups"] == 4 for h in hist)
    assert all(abs(h["rollout_logprob_drift"]) < 1 for h in hist if "rollout_logprob_drift" in h)


@pytest.fixture(scope="module")
def k1_drop(ppo_setup, eos_actor, tmp_path_factory):
    save = tmp_path_factory.mktemp("k1_drop")
    hist, _ = _run(ppo_setup, eos_actor, save, *K1_LONG, "--partial_rollout_drop_stale")
    return save, hist


def _share(hist) -> dict:
    """Over a run's trained replies: mean length and the share that ended at the length budget (no EOS)."""
    return {"length": sum(h["response_length"] for h in hist) / len(hist),
            "at_budget": 1 - sum(h["finished_frac"] for h in hist) / len(hist)}


def _carried_at_end(save) -> int:
    ckpt = save / "checkpoints"
    state = json.loads((ckpt / (ckpt / "latest").read_text().strip() / "trainer.json").read_text())
    return len(state["extra"]["partial"]["carried"])


def test_k1_discards_nothing_and_trains_long_replies_as_the_synchronous_run(k1, sync, k1_drop):
    """The default bound waits for the groups it makes due (``partial/due_groups``) and drops nothing: every group
    started was trained or is still carried when the run ends (8 steps x 4 groups), and the oldest token trained is
    at most 1 update old. Control, ``--partial_rollout_drop_stale``: it drops groups the bound cannot wait for
    (``partial/dropped_samples``), finished samples included, and starts their prompts again (the tokens already
    generated for them are thrown away; no prompt is lost in either). The share of long replies (mean length, share at the 16-token budget) stays
    near the synchronous run's; measured (2-core Intel Xeon with AMX, 2026-11-28): sync 9.23 tokens / 0.27 at the
    budget, K = 1 9.02 / 0.20, dropping 8.64 / 0.17 (64 trained replies each: the bounds below are loose)."""
    (k1_save, k1h, _), (_, synch), (drop_save, droph) = k1, sync, k1_drop
    assert all(h["partial/dropped_samples"] == 0 for h in k1h), k1h
    assert sum(h["partial/due_groups"] for h in k1h) > 0, k1h  # the bound acted: the round waited for due groups
    assert all(h["partial/max_token_age"] <= 1 for h in k1h + droph), [h["partial/max_token_age"] for h in k1h + droph]
    started = sum(h["partial/new_groups"] for h in k1h)  # prompts the sampler gave
    assert started == 8 * 4 + _carried_at_end(k1_save), (started, _carried_at_end(k1_save))
    dropped = sum(h["partial/dropped_samples"] for h in droph) / 2  # groups of 2
    assert dropped > 0, droph
    started = sum(h["partial/new_groups"] for h in droph)  # a dropped group's prompt starts again (requeued)
    assert started == 8 * 4 + _carried_at_end(drop_save), (started, dropped)
    k1s, syncs = _share(k1h), _share(synch)
    assert k1s["length"] >= syncs["length"] - 1.5 and k1s["at_budget"] >= syncs["at_budget"] - 0.15, (k1s, syncs)


def _from_step_1(save, dst, drop_carried=False):
    """A copy of the straight run standing where a job stopped after step 1 would stand (later checkpoints and the
    export removed, ``latest`` naming step 1); ``drop_carried`` empties that checkpoint's carried samples (its
    manifest rewritten), for the negative control."""
    from rlhf.runtime.checkpoint import write_ckpt_manifest

    shutil.copytree(save, dst)
    ckpt = dst / "checkpoints"
    for it in ckpt.glob("iter_*"):
        if it.name != "iter_0000001":
            shutil.rmtree(it)
    os.remove(dst / "model.safetensors")
    (ckpt / "latest").write_text("iter_0000001")
    state_path = ckpt / "iter_0000001" / "trainer.json"
    state = json.loads(state_path.read_text())
    carried = state["extra"]["partial"]["carried"]
    assert sum(len(s["response_ids"]) for g in carried for s in g) > 0, "step 1's checkpoint must carry generated tokens"
    if drop_carried:
        state["extra"]["partial"]["carried"] = []
        state_path.write_text(json.dumps(state))
        write_ckpt_manifest(str(ckpt / "iter_0000001"))


def test_resume_with_samples_carried_is_exact(ppo_setup, eos_actor, k1, tmp_path):
    """Step 1 carries 4 whole groups with their tokens (trained at step 2, one update old). Resumed from step 1's
    checkpoint, steps 2-8 end with the straight run's weights bit for bit; negative control: the same checkpoint
    with its carried samples emptied resumes too, but step 2 then trains other groups and ends elsewhere."""
    save, hist, _ = k1
    assert hist[0]["partial/carried_samples"] > 0 and hist[1]["partial/tokens_age_1"] > 0, hist
    for name, drop in (("r", False), ("c", True)):
        _from_step_1(save, tmp_path / name, drop_carried=drop)
        _, p = _run(ppo_setup, eos_actor, tmp_path / name, *K1_LONG, "--load_checkpoint")
        assert "resumed from" in p.stdout + p.stderr, tail(p)
        assert _same(_weights(tmp_path / name), _weights(save)) is not drop, name


FILTER = ["--reward_fn", "_rule_reward:parity_reward", "--dynamic_filtering", "--dynamic_filtering_max_rounds", "4"]


def test_dynamic_filtering_k0_is_the_synchronous_filter_and_k1_fills_with_passing_groups(ppo_setup, eos_actor,
                                                                                         tmp_path):
    """--dynamic_filtering with --partial_rollout (a binary verifier, reply length parity, on groups of 2: about
    half the groups agree and are dropped). K = 0: each round is a whole batch run to its end, the synchronous
    step's filtering bit for bit (the same rounds, prompts and final weights). K = 1: rounds stop early and carry,
    further rounds at the same weights ask for the groups still missing, and the batch is filled with groups that
    pass: groups whose replies all scored alike were generated (pass rate < 1) and none was trained."""
    sync, _ = _run(ppo_setup, eos_actor, tmp_path / "sync", *FILTER)
    k0, _ = _run(ppo_setup, eos_actor, tmp_path / "k0", *FILTER, "--partial_rollout", "--max_staleness", "0")
    keys = ("dynamic_filtering/rounds", "dynamic_filtering/prompts", "dynamic_filtering/pass_rate", "reward")
    assert [[h[k] for k in keys] for h in k0] == [[h[k] for k in keys] for h in sync]
    assert max(h["dynamic_filtering/rounds"] for h in sync) >= 2, sync  # the filter did drop groups
    assert _same(_weights(tmp_path / "k0"), _weights(tmp_path / "sync"))
    k1, _ = _run(ppo_setup, eos_actor, tmp_path / "k1f", *FILTER, *K1)
    assert sum(h["partial/aborted_samples"] for h in k1) > 0, k1
    carried = [json.loads((tmp_path / "k1f" / "checkpoints" / f"iter_000000{i}" / "trainer.json").read_text())
               ["extra"]["partial"]["carried"] for i in (1, 2)]
    assert any(s["response_ids"] for c in carried for g in c for s in g), carried  # replies carried mid-way
    assert any(h["dynamic_filtering/pass_rate"] < 1 for h in k1), k1
    # every trained group passed (none filled in), so no group has equal rewards: GRPO's advantages never vanish
    assert all(h["dynamic_filtering/filled"] == 0 and h["partial/trained_groups"] == 4 for h in k1), k1
    assert all(h["reward_equal_groups_frac"] == 0 for h in k1), k1


@pytest.fixture(scope="module")
def dp2(ppo_setup, eos_actor, tmp_path_factory):
    return _run(ppo_setup, eos_actor, tmp_path_factory.mktemp("dp2"), *K1, "--dist_timeout_s", "60", nproc=2)


def test_two_engines_stop_and_step_together(dp2):
    """Two ranks, one vLLM engine each (vLLM data parallel, --vllm_tensor_parallel_size 1): every engine step is
    collective there, so an engine that has its share of whole groups aborts the rest and keeps stepping (vLLM's
    dummy batches) until the other is done. Before that fix the first engine to stop left the loop and the job hung
    in its first step (a gloo timeout, then 'lost a peer in phase rollout')."""
    hist, p = dp2
    assert "2 engine(s) x TP 1" in p.stdout + p.stderr, tail(p)
    assert len(hist) == 3 and sum(h["partial/aborted_samples"] for h in hist) > 0, hist
    assert any(h.get("partial/tokens_age_1", 0) > 0 for h in hist[1:]), hist


def test_sigkill_anywhere_with_samples_carried_then_resume_is_exact(ppo_setup, eos_actor, k1, tmp_path, monkeypatch):
    """The crash harness's kill points with samples carried: the whole job SIGKILLed mid-save of step 1 (a
    checkpoint that holds carried samples), after step 2 (in its save or in step 3's round, which continues the
    carried replies) and mid-export; each relaunch (``--load_checkpoint``) resumes from what was published, and the
    final weights equal the uninterrupted K = 1 run's bit for bit."""
    from crash_harness import crash_and_resume

    save, hist, _ = k1
    assert hist[0]["partial/carried_samples"] > 0 and hist[1]["partial/carried_samples"] > 0, hist
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "out"
    records = crash_and_resume(PPO, 1, _args(ppo_setup, eos_actor, out, *K1_LONG), "ppo", str(out / "checkpoints"),
                               [("save", 1), ("step", 2), ("export", 0)], seed=7, total=8)
    assert all(r["killed"] for r in records[:-1]), ([(r["point"], r["killed"]) for r in records],  # the ended one:
        [r["log"][-1500:] for r in records[:-1] if not r["killed"]])
    exported = [r for r in records if r["point"] == ("export", 0)][0]["log"]  # killed mid-export, not after it
    assert "fault injection: hang at export" in exported and "exported HF model" not in exported, exported[-1500:]
    assert any(r.get("resumed_step") for r in records), [r["point"] for r in records]
    assert _same(_weights(out), _weights(save))


@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_lora_actor_and_vllm_tp2(ppo_setup, eos_actor, tmp_path, sync):
    """Two ranks, one vLLM engine over both (TP 2: every rank steps the same engine and sees the same outputs, so
    both stop and abort alike), a LoRA actor (the sync sends merged weights, or with --lora_sync adapter the base
    once and then the adapters alone): the round stops early and carries, and the log-prob drift tells fresh
    tokens (vLLM has this step's weights: 1e-7) from carried ones (one update old: 0.06 measured, the adapters
    moved)."""
    hist, p = _run(ppo_setup, eos_actor, tmp_path / "tp2", *K1, "--vllm_tensor_parallel_size", "2",
                   "--lora_rank", "4", "--lora_sync", sync, "--dist_timeout_s", "60", nproc=2)
    assert "1 engine(s) x TP 2" in p.stdout + p.stderr, tail(p)
    if sync == "adapter":  # after the first sync (base + adapters), each sync sends the adapters alone
        sent = [(h["weight_sync/bytes"], h["weight_sync/adapter_bytes"]) for h in hist]
        assert sent[0][0] > 5 * sent[0][1] and all(b == a > 0 for b, a in sent[1:]), sent
        assert "vLLM LoRA path (--lora_sync adapter)" in p.stdout + p.stderr, tail(p)
    assert len(hist) == 3 and sum(h["partial/aborted_samples"] for h in hist) > 0, hist
    assert all(h["partial/trained_groups"] == 4 for h in hist), hist
    # tokens of this step's weights: vLLM (synced merged weights) and the trainer agree; tokens one update old: the
    # trainer's weights have moved since (the adapters learn), so the generator's log-probs are off-policy
    fresh = [h for h in hist if h["partial/tokens_age_1"] == 0]
    stale = [h for h in hist if h["partial/tokens_age_0"] == 0]
    assert len(fresh) >= 2 and stale, hist
    assert all(h["rollout_logprob_drift"] < 1e-5 for h in fresh) and all(h["rollout_logprob_drift"] > 1e-3
                                                                            for h in stale), hist


def test_context_parallel_2_matches_data_parallel_2(ppo_setup, eos_actor, dp2, tmp_path):
    """CP 2 on two ranks has the same two vLLM engines as DP 2, so the same rounds stop at the same tokens and carry
    the same replies (rewards, lengths and partial counts equal); the updates, CP's split sequences against DP's
    split batch, agree to fp32 rounding."""
    want, _ = dp2
    got, p = _run(ppo_setup, eos_actor, tmp_path / "cp2", *K1, "--context_parallel_size", "2",
                  "--dist_timeout_s", "60", nproc=2)
    out = p.stdout + p.stderr
    assert "cp=2" in out and "2 engine(s) x TP 1" in out, tail(p)
    exact = ("reward", "response_length", "partial/aborted_samples", "partial/carried_samples",
             "partial/tokens_age_0", "partial/tokens_age_1")
    assert [[h[k] for k in exact] for h in got] == [[h[k] for k in exact] for h in want]
    # AMD EPYC (family 25, AVX2 only), 2026-11-27: grad norms 1.7e-7 relative apart at most, policy loss 3.3e-7,
    # drift 2.4e-7 (its fresh steps' drift is itself ~2e-7, hence abs): the bound leaves 300x for other kinds
    for a, b in zip(got, want):
        for k in ("actor/grad_norm", "actor/policy_loss", "rollout_logprob_drift"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (k, a[k], b[k])


def test_openrlhf_async_enable_alone_is_one_step_off(ppo_setup, eos_actor, tmp_path):
    """OpenRLHF's ``--train.async_enable`` without ``--train.partial_rollout_enable`` (its one-step-off pipeline):
    nothing is aborted, step 1 trains the first batch on-policy and every later step trains whole groups that the
    weights one update older generated (every token exactly 1 update old), corrected by AReaL's decoupled loss by
    default; the translated flag and the correction each say so in one log line."""
    hist, p = _run(ppo_setup, eos_actor, tmp_path / "off", "--train.async_enable")
    out = p.stdout + p.stderr
    assert "--train.async_enable (OpenRLHF) -> --async_one_step_off, which differs:" in out, tail(p)
    assert "tokens of earlier policies are corrected by AReaL's decoupled PPO loss" in out, tail(p)
    assert len(hist) == 3 and all(h["partial/aborted_samples"] == 0 for h in hist), hist
    assert hist[0]["partial/max_token_age"] == 0 and hist[0]["partial/tokens_age_1"] == 0, hist[0]
    assert all(h["partial/tokens_age_0"] == 0 and h["partial/tokens_age_1"] > 0 for h in hist[1:]), hist
    assert all(h["partial/trained_groups"] == 4 for h in hist), hist
    # the correction ran on the stale steps: the behaviour weight differs from 1 on carried tokens
    w = [h["actor/rollout_is_weight"] for h in hist]
    assert w[0] == pytest.approx(1.0, abs=1e-5) and all(abs(x - 1.0) > 1e-4 for x in w[1:]), w

