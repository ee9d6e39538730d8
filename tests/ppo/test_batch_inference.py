"""launch/batch_inference.py's body in this process (one rank, the megatron generator): generate-only output that
a killed run resumes to the uninterrupted run's file, and reward-only scores equal to HF's sequence classifier on
the same texts."""
from __future__ import annotations

import json

import pytest
import torch


def _run(argv, monkeypatch) -> int:
    from helpers import free_port
    from rlhf.offline.batch_inference import main

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    return main(argv)


def _gen_args(setup, out, *extra):
    return ["--mode", "generate", "--pretrain", setup["actor"], "--dataset", setup["prompts"], "--input_key", "prompt",
            "--max_samples", "6", "--n_samples_per_prompt", "2", "--chunk_size", "2", "--max_new_tokens", "4",
            "--prompt_max_len", "32", "--rollout_backend", "megatron", "--seed", "5", "--output_path", str(out),
            *extra]


@pytest.fixture(scope="module")
def generated(ppo_setup, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    out = tmp_path_factory.mktemp("bi") / "gen.jsonl"
    assert _run(_gen_args(ppo_setup, out), mp) == 0
    mp.undo()
    return out


def test_generate_resumes_to_the_uninterrupted_file(ppo_setup, generated, tmp_path, monkeypatch):
    rows = [json.loads(ln) for ln in open(generated)]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, s) for p in range(6) for s in range(2)]
    out = tmp_path / "gen.jsonl"
    assert _run(_gen_args(ppo_setup, out, "--stop_after_chunks", "1"), monkeypatch) == 0
    assert len(open(out).readlines()) == 4  # one chunk of 2 prompts x 2 samples
    with open(out, "a") as f:
        f.write('{"prompt_index": 2, "sam')  # a torn write from a killed run
    assert _run(_gen_args(ppo_setup, out), monkeypatch) == 0
    assert open(out).read() == open(generated).read()


def test_reward_scores_equal_hf(ppo_setup, generated, tmp_path, monkeypatch):
    import transformers

    out = tmp_path / "scored.jsonl"
    argv = ["--mode", "reward", "--reward_pretrain", ppo_setup["rm"], "--dataset", str(generated), "--input_key",
            "input", "--output_key", "output", "--chunk_size", "5", "--output_path", str(out)]
    assert _run(argv, monkeypatch) == 0
    rows = [json.loads(ln) for ln in open(out)]
    assert len(rows) == 12 and all(r["scores"]["rm0"] == r["reward"] for r in rows)
    tok = transformers.AutoTokenizer.from_pretrained(ppo_setup["rm"])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(ppo_setup["rm"]).eval()
    with torch.no_grad():
        for r in rows:
            ids = tok.encode(r["input"]) + tok.encode(r["output"], add_special_tokens=False) + [tok.eos_token_id]
            want = model(input_ids=torch.tensor([ids])).logits.item()
            assert r["reward"] == pytest.approx(want, abs=2e-5)
