"""``--partial_rollout`` in a real PPO job (launch/ppo.py, one rank, vLLM in-process, GRPO with a rule reward).
Packed micro-batches formed by token count (``--use_dynamic_batch``) in every job. The tiny actor's
generation_config.json names 25 end-of-sequence tokens (as Llama 3 names several), so its random
replies end at very different lengths and a step's groups finish long before its longest reply:
- ``--max_staleness 0`` is the synchronous trainer, bit for bit (the same weights after 3 steps; negative control:
  ``--max_staleness 1``, which carries samples across updates, ends elsewhere);
- ``--max_staleness 1``: vLLM is stopped early (samples aborted and carried), carried tokens are trained one update
  old and never older, and every trained group is whole;
- a job resumed from the checkpoint after step 2, with samples carried, ends with the straight run's weights;
- two vLLM engines (data parallel) stop and step together.
Three steps each, five jobs, about 20-40 s a job on a 2-core machine."""
import json
import os
import shutil

import pytest
from helpers import REPO, require, run_torchrun, tail

from ppo_common import TINY_GRPO, ppo_args

require("vllm")
PPO = os.path.join(REPO, "launch", "ppo.py")
STEPS = ["--num_episodes", "1", "--max_samples", "12"]  # 12 prompts / 4 per step: 3 steps
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


def _run(ppo_setup, actor, save, *extra, timeout=600, nproc=1):
    args = ppo_args({**ppo_setup, "actor": actor}, str(save), **{
        **TINY_GRPO, "--reward_fn": "_rule_reward:char_code_reward", "--generate_max_len": "16",
        "--save_steps": "1", "--actor_learning_rate": "1e-3"}) + STEPS + DYNAMIC + list(extra)
    p = run_torchrun(PPO, nproc, args, timeout=timeout, PYTHONPATH=f"{REPO}{os.pathsep}{os.path.dirname(__file__)}")
    assert p.returncode == 0, tail(p)
    from rlhf.metrics import read_metrics_jsonl

    m = read_metrics_jsonl(os.path.join(save, "metrics.jsonl"), "ppo")
    return [m[s] for s in sorted(m)], p


def _weights(save):
    from safetensors.torch import load_file

    return load_file(os.path.join(save, "model.safetensors"))


def _same(a, b):
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.fixture(scope="module")
def k1(ppo_setup, eos_actor, tmp_path_factory):
    save = tmp_path_factory.mktemp("k1")
    hist, p = _run(ppo_setup, eos_actor, save, "--partial_rollout", "--max_staleness", "1",
                   "--partial_rollout_oversample", "1")
    return save, hist, p


def test_k0_is_the_synchronous_trainer_bit_for_bit(ppo_setup, eos_actor, k1, tmp_path):
    sync, _ = _run(ppo_setup, eos_actor, tmp_path / "sync")
    k0, _ = _run(ppo_setup, eos_actor, tmp_path / "k0", "--partial_rollout", "--max_staleness", "0")
    assert [h["reward"] for h in k0] == [h["reward"] for h in sync]
    assert [h["response_length"] for h in k0] == [h["response_length"] for h in sync]
    assert all(h["partial/aborted_samples"] == 0 and h["partial/carried_samples"] == 0 for h in k0), k0
    assert _same(_weights(tmp_path / "k0"), _weights(tmp_path / "sync"))
    assert not _same(_weights(k1[0]), _weights(tmp_path / "sync"))  # negative control: K = 1 carries, ends elsewhere


def test_k1_stops_early_carries_and_bounds_the_age(k1):
    _, hist, p = k1
    assert len(hist) == 3
    assert sum(h["partial/aborted_samples"] for h in hist) > 0, hist  # vLLM was stopped with samples unfinished
    assert any(h.get("partial/tokens_age_1", 0) > 0 for h in hist[1:]), hist  # carried tokens trained 1 update old
    assert all(not any(k.startswith("partial/tokens_age_") and int(k.rsplit("_", 1)[1]) > 1 and v for k, v in h.items())
               for h in hist)
    assert all(h["partial/trained_groups"] == 4 for h in hist)
    assert all(abs(h["rollout_logprob_drift"]) < 1 for h in hist if "rollout_logprob_drift" in h)


def test_resume_with_samples_carried_is_exact(ppo_setup, eos_actor, k1, tmp_path):
    save, hist, _ = k1
    assert hist[1]["partial/carried_samples"] > 0, hist  # the checkpoint after step 2 holds carried samples
    # The straight run's checkpoint after step 2 (--save_steps 1) is where a job stopped after step 2 would stand:
    # resume from it (the step-3 checkpoint and the final export removed, `latest` naming step 2).
    r = tmp_path / "r"
    shutil.copytree(save, r)
    ckpt = r / "checkpoints"
    shutil.rmtree(ckpt / "iter_0000003")
    os.remove(r / "model.safetensors")
    (ckpt / "latest").write_text("iter_0000002")
    resumed, p = _run(ppo_setup, eos_actor, tmp_path / "r", "--partial_rollout", "--max_staleness", "1",
                      "--partial_rollout_oversample", "1", "--load_checkpoint")
    assert "resumed from" in p.stdout + p.stderr, tail(p)
    assert _same(_weights(tmp_path / "r"), _weights(save))


def test_two_engines_stop_and_step_together(ppo_setup, eos_actor, tmp_path):
    """Two ranks, one vLLM engine each (vLLM data parallel, --vllm_tensor_parallel_size 1): every engine step is
    collective there, so an engine that has its share of whole groups aborts the rest and keeps stepping (vLLM's
    dummy batches) until the other is done. Before that fix the first engine to stop left the loop and the job hung
    in its first step (a gloo timeout, then 'lost a peer in phase rollout')."""
    hist, p = _run(ppo_setup, eos_actor, tmp_path / "dp", "--partial_rollout", "--max_staleness", "1",
                   "--partial_rollout_oversample", "1", "--dist_timeout_s", "60", nproc=2)
    assert "2 engine(s) x TP 1" in p.stdout + p.stderr, tail(p)
    assert len(hist) == 3 and sum(h["partial/aborted_samples"] for h in hist) > 0, hist
    assert any(h.get("partial/tokens_age_1", 0) > 0 for h in hist[1:]), hist
