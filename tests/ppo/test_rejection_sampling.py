"""launch/rejection_sampling.py on 2 ranks (two vLLM engines, megatron DP=2) with two reward models and a rule
function: one row per prompt, each the argmax of the weighted score over its N samples, reward-model scores equal
to HF transformers' on the exported folders, and launch/sft.py trains on the output as it is."""
import json
import os

import pytest
import torch
from helpers import REPO, run_torchrun, tail, require
from ppo_common import write_prompts

HERE = os.path.dirname(os.path.abspath(__file__))
RS = os.path.join(REPO, "launch/rejection_sampling.py")
N, PROMPTS, W = 4, 7, (0.7, 0.3, 0.5)  # 7 prompts on 2 engines: the share is padded and the copy dropped
require("vllm")


def rs_args(setup, rms, out, **kw):
    args = {"--pretrain": setup["actor"], "--reward_pretrain": ",".join(rms), "--reward_weights": f"{W[0]},{W[1]}",
            "--reward_fn": "_rule_reward:length_reward", "--reward_fn_weight": W[2], "--dataset": out["prompts"],
            "--input_key": "prompt", "--best_of_n": N, "--max_new_tokens": 6, "--prompt_max_len": 32,
            "--output_path": out["rows"], "--candidates_path": out["cands"], "--seed": 3, "--tp": 1,
            "--vllm_kv_cache_mb": 32, "--micro_batch_size": 8}
    args.update(kw)
    return [str(x) for kv in args.items() for x in kv]


@pytest.fixture(scope="module")
def sampled(ppo_setup, reward_pair, tmp_path_factory):
    work = tmp_path_factory.mktemp("rs")
    out = {"prompts": write_prompts(work / "prompts.jsonl", PROMPTS, seed=7), "rows": str(work / "rs.jsonl"),
           "cands": str(work / "candidates.jsonl"), "work": work}
    p = run_torchrun(RS, 2, rs_args(ppo_setup, reward_pair, out), timeout=600,
                     PYTHONPATH=f"{REPO}{os.pathsep}{HERE}")
    assert p.returncode == 0, tail(p)
    out["rows_data"] = [json.loads(ln) for ln in open(out["rows"])]
    out["cands_data"] = [json.loads(ln) for ln in open(out["cands"])]
    return out


def test_best_of_n_is_the_weighted_argmax_and_scores_match_hf(sampled, reward_pair):
    import transformers

    from _rule_reward import length_reward

    rows, cands = sampled["rows_data"], sampled["cands_data"]
    prompts = [json.loads(ln)["prompt"] for ln in open(sampled["prompts"])]
    assert len(rows) == PROMPTS and len(cands) == PROMPTS * N
    assert sorted(r["input"] for r in rows) == sorted(prompts)  # the raw prompt field, every prompt once
    # Independent scores: HF *ForSequenceClassification on the reward-model folders, the rule on the text.
    rms = [transformers.AutoModelForSequenceClassification.from_pretrained(p).eval() for p in reward_pair]
    with torch.no_grad():
        for c in cands:
            ids = torch.tensor([c["prompt_ids"] + c["response_ids"]])
            for name, m in zip(("rm0", "rm1"), rms):
                assert abs(m(ids).logits.item() - c["scores"][name]) < 1e-4, (name, c)
            assert c["scores"]["fn"] == pytest.approx(length_reward([""], [c["output"]])[0], abs=1e-6)
    for p in range(PROMPTS):
        group = [c for c in cands if c["prompt_index"] == p]
        assert len(group) == N and sum(c["kept"] for c in group) == 1
        total = [W[0] * c["scores"]["rm0"] + W[1] * c["scores"]["rm1"] + W[2] * c["scores"]["fn"] for c in group]
        for c, t in zip(group, total):
            assert c["score"] == pytest.approx(t, abs=1e-5)
        best = group[max(range(N), key=lambda i: total[i])]
        assert best["kept"]
        row = rows[p]
        assert row["output"] == best["output"] and row["score"] == pytest.approx(best["score"], abs=1e-6)
    # Every prompt gets its own random stream: no sampled sequence shows up under two prompts (vLLM seeds sample
    # k of a request with seed + k; prompt seeds spaced by 1 made prompt i+1 repeat prompt i's samples).
    owners = {}
    for c in cands:
        owners.setdefault(tuple(c["response_ids"]), set()).add(c["prompt_index"])
    assert all(len(v) == 1 for v in owners.values()), owners


def test_conditional_sft_trains_on_the_output(sampled, ppo_setup, reward_pair):
    """launch/sft.py reads the written file with its default keys (input/output); here in --conditional mode with a
    reward model on 2 ranks, one step: the exported bucket edges are the quantiles of HF's scores of the rows."""
    import transformers

    from rlhf.supervised.conditional import quantile_edges
    from rlhf.data import DataConfig, build_sft_dataset

    tok = transformers.AutoTokenizer.from_pretrained(ppo_setup["actor"])
    plain, _ = build_sft_dataset(DataConfig(dataset=sampled["rows"]), tok)  # plain SFT takes it as it is
    assert len(plain) == PROMPTS
    save = str(sampled["work"] / "csft")
    p = run_torchrun(os.path.join(REPO, "launch/sft.py"), 2, [
        "--pretrain", ppo_setup["actor"], "--dataset", sampled["rows"], "--save_path", save, "--conditional",
        "--reward_pretrain", reward_pair[0], "--reward_buckets", "3", "--train_batch_size", "4",
        "--micro_train_batch_size", "2", "--max_epochs", "1", "--max_len", "64", "--learning_rate", "1e-3",
        "--lr_warmup_ratio", "0"], timeout=600)
    assert p.returncode == 0, tail(p)
    cond = json.load(open(os.path.join(save, "config.json")))["rlhf"]["conditional"]
    rm = transformers.AutoModelForSequenceClassification.from_pretrained(reward_pair[0]).eval()
    scores = []
    with torch.no_grad():
        for r in sampled["rows_data"]:  # prompt (+ BOS) + response + eos, as SFT renders it
            ids = tok(r["input"])["input_ids"] + tok(r["output"], add_special_tokens=False)["input_ids"]
            scores.append(rm(torch.tensor([ids + [tok.eos_token_id]])).logits.item())
    assert cond["edges"] == pytest.approx(quantile_edges(scores, 3), abs=1e-4)
    assert cond["top_bucket"] == 2 and cond["top_prefix"] == "<rm_score>: 2 " and sum(cond["train_bucket_counts"]) == 7
    assert json.load(open(os.path.join(save, "train_result.json")))["train"]["loss"] > 0


def test_bad_input_before_any_model(ppo_setup, reward_pair, tmp_path, monkeypatch, capsys):
    import rlhf.runtime.role
    from rlhf.offline.rejection_sampling import main

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(rlhf.runtime.role.ModelRole, "__init__", boom)
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(k, v)
    out = {"prompts": write_prompts(tmp_path / "p.jsonl", 4), "rows": str(tmp_path / "r.jsonl"),
           "cands": str(tmp_path / "c.jsonl")}
    for flags, needle in (({"--reward_weights": "0.5"}, "--reward_weights 0.5"),
                          ({"--reward_fn": "nosuchmodule:f"}, "--reward_fn nosuchmodule:f"),
                          ({"--reward_fn": "_rule_reward:NOT_CALLABLE"}, "not callable"),
                          ({"--best_of_n": 0}, "--best_of_n"),
                          ({"--output_path": str(tmp_path / "no" / "r.jsonl")}, "--output_path")):
        monkeypatch.syspath_prepend(HERE)
        assert main(rs_args(ppo_setup, reward_pair, out, **flags)) == 2
        err = capsys.readouterr().err
        assert "error:" in err and needle in err, (flags, err)
