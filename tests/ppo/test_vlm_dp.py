"""GRPO on a tiny Qwen2.5-VL at DP 2 with different images on each rank (docs/vlm.md): after each of 2 steps the
vision tower's weights are the same on both ranks, and the tower's weights and gradients equal a one-rank job's on
the two ranks' samples together.

The vehicle is the RL job itself, not an SFT step: vLLM seeds each prompt's samples from its index in the global
rollout (``rlhf.rollout.vllm_generator``), so the one-rank job (one engine, the same global prompts) draws the two
ranks' replies token for token; the test asserts it on the jobs' dumps (``--dump_experience``) rather than
assuming it. The ranks' towers are read by a test hook after each optimizer step (tests/ppo/_vlm_tower_worker.py:
a checkpoint holds one replica of a replicated tensor); the jobs' own exports are compared too. Gradients are
compared as well as weights: Adam divides a gradient by its own size, so a tower gradient halved at DP 2 moved the
weights by only 3e-3 of their largest (the gradients by 0.5).

Tolerances, against what was measured (2-core Xeon): the gradients 1e-4 (measured 2e-6, the reduction order), the
weights 1e-4 (2.4e-6: Adam's g / (|g| + eps) magnifies the gradients' rounding where |g| is near eps), both as the
largest difference over the tensor's largest entry; the two ranks' towers bit for bit.

Two launches (20-40 s together on a 2-core CPU); the planted bugs that must fail it: tests/mutants/vlm.py."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from helpers import REPO, run_torchrun, tail

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_vlm_tower_worker.py")
STEPS = 2


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rlhf.demo.vision_task import corpus, write
    from rlhf.models.tiny import make_tiny_vlm

    work = tmp_path_factory.mktemp("vlm_dp")
    paths = write(str(work / "data"), seed=0, n_train=16, n_heldout=1, n_sft=1)
    make_tiny_vlm(str(work / "model"), seed=0, texts=corpus(), vocab_size=300)
    return work, paths


def _grpo(task, name: str, nproc: int) -> tuple[dict, dict, str]:
    """A 2-step GRPO job with images on ``nproc`` ranks, each with its own vLLM engine; ({step: {dp_rank: tower
    record}}, {step: {dp_rank: dump}}, the save folder)."""
    work, paths = task
    out, dump, tower = work / name, work / f"{name}_dump", work / f"{name}_tower"
    proc = run_torchrun(WORKER, nproc, [
        "--pretrain", str(work / "model"), "--prompt_data", paths["train"], "--input_key", "prompt",
        "--label_key", "answer", "--apply_chat_template", "--reward_fn", "_rule_reward:char_code_reward",
        "--advantage_estimator", "group_norm", "--init_kl_coef", "0", "--rollout_batch_size", "4",
        "--n_samples_per_prompt", "4", "--train_batch_size", "16", "--micro_train_batch_size", "4",
        "--micro_rollout_batch_size", "8", "--generate_max_len", "6", "--prompt_max_len", "64", "--max_samples",
        str(4 * STEPS), "--num_episodes", "1", "--actor_learning_rate", "1e-3", "--lr_warmup_ratio", "0",
        "--vllm_kv_cache_mb", "32", "--vllm_tensor_parallel_size", "1", "--save_path", str(out),
        "--save_steps", "-1", "--dump_experience", str(dump)], timeout=300,
        RLHF_TEST_VLM_TOWER_DIR=str(tower), PYTHONPATH=f"{REPO}{os.pathsep}{os.path.dirname(__file__)}")  # _rule_reward
    assert proc.returncode == 0, tail(proc)
    towers: dict = {}
    for f in glob.glob(os.path.join(tower, "step*_rank*.pt")):
        rec = torch.load(f)
        towers.setdefault(rec["step"], {})[rec["dp_rank"]] = rec
    dumps: dict = {}
    for f in glob.glob(os.path.join(dump, "step*_rank*.pt")):
        rec = torch.load(f)
        dumps.setdefault(rec["step"], {})[rec["dp_rank"]] = rec
    want = {s: list(range(nproc)) for s in range(1, STEPS + 1)}
    assert {s: sorted(v) for s, v in towers.items()} == want, towers.keys()
    assert {s: sorted(v) for s, v in dumps.items()} == want, dumps.keys()
    return towers, dumps, str(out)


def _tensors(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def _rows(exp: dict) -> list[tuple]:
    """Each sample of a dump as (prompt_index, prompt tokens, reply tokens)."""
    out = []
    for b in range(exp["prompt_index"].shape[0]):
        ids = exp["input_ids"][b][exp["attention_mask"][b].bool()].tolist()
        reply = exp["response_ids"][b][exp["action_mask"][b].bool()].tolist()
        out.append((int(exp["prompt_index"][b]), tuple(ids[:len(ids) - len(reply)]), tuple(reply)))
    return out


def _close(a: dict, b: dict, rtol: float) -> list[str]:
    """Names of the tensors of ``a`` and ``b`` further apart than ``rtol`` of their size (max abs over max abs)."""
    assert sorted(a) == sorted(b) and a
    return [n for n in a if (a[n].double() - b[n].double()).abs().max() > rtol * b[n].double().abs().max()]


def test_vision_tower_at_dp2_with_different_images_equals_one_rank(task):
    dp2, dump2, out2 = _grpo(task, "dp2", 2)
    dp1, dump1, out1 = _grpo(task, "dp1", 1)
    for step in range(1, STEPS + 1):
        # the ranks trained on different prompts and different images, the one-rank job on both ranks' samples
        r0, r1 = (_rows(dump2[step][r]["experience"]) for r in (0, 1))
        assert {p for p, *_ in r0}.isdisjoint(p for p, *_ in r1), step
        assert sorted(r0 + r1) == sorted(_rows(dump1[step][0]["experience"])), step  # the same replies
        px0, px1 = set(dp2[step][0]["pixels"]), set(dp2[step][1]["pixels"])
        assert len(px0) >= 2 and px0.isdisjoint(px1), (step, px0, px1)
        assert px0 | px1 == set(dp1[step][0]["pixels"]), step
        # the same tower on both ranks, bit for bit, and the one-rank job's
        w0, w1, w = dp2[step][0]["weights"], dp2[step][1]["weights"], dp1[step][0]["weights"]
        assert all(torch.equal(w0[n], w1[n]) for n in w0), [n for n in w0 if not torch.equal(w0[n], w1[n])]
        g0, g1, g = dp2[step][0]["grads"], dp2[step][1]["grads"], dp1[step][0]["grads"]
        assert all(torch.equal(g0[n], g1[n]) for n in g0), [n for n in g0 if not torch.equal(g0[n], g1[n])]
        assert all(g[n].abs().max() > 0 for n in g), [n for n in g if not g[n].abs().max() > 0]
        assert not _close(g0, g, 1e-4), (step, _close(g0, g, 1e-4))
        assert not _close(w0, w, 1e-4), (step, _close(w0, w, 1e-4))
        m2, m1 = dp2[step][0]["metrics"], dp1[step][0]["metrics"]
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5), (step, m2, m1)
    start = _tensors(os.path.join(task[0], "model"))
    assert any(not torch.equal(start[n], w[n]) for n in w)  # the tower trained
    # the jobs' own exports: the same tower as the hook read, the two-rank job's equal to the one-rank job's
    e2, e1 = _tensors(out2), _tensors(out1)
    vis = {n for n in e2 if n.startswith("visual.")}
    assert vis == set(w), sorted(vis ^ set(w))
    assert all(torch.equal(e2[n], w0[n]) for n in vis)
    assert not _close({n: e2[n] for n in vis}, {n: e1[n] for n in vis}, 1e-4)
