"""Conditional SFT (``launch/sft.py --conditional``): quantile buckets against hand values, the bucket prefix in the
tokenized prompt and out of the loss, eval samples on the training edges, bad input before any model. The run with
a reward model (scores on the megatron stack, edges in config.json) is in tests/ppo/test_rejection_sampling.py,
on rejection sampling's output."""
import argparse

import pytest
from _train_testlib import write_jsonl

# Hand-computed: sorted 0 .5 1 1.5 2 2.5 3 4 (n = 8); the q-quantile sits at position 7q, linearly interpolated:
# q=.25 -> 1.75 -> .5 + .75 * .5 = .875; q=.5 -> 3.5 -> 1.75; q=.75 -> 5.25 -> 2.5 + .25 * .5 = 2.625.
SCORES = [0.5, 3.0, 1.0, 2.0, 4.0, 0.0, 2.5, 1.5]
EDGES = [0.875, 1.75, 2.625]
BUCKETS = [0, 3, 1, 2, 3, 0, 2, 1]


def test_quantile_edges_and_buckets_by_hand():
    from rlhf.supervised.conditional import bucket_of, quantile_edges

    assert quantile_edges(SCORES, 4) == pytest.approx(EDGES, abs=1e-12)
    assert [bucket_of(s, EDGES) for s in SCORES] == BUCKETS
    assert bucket_of(1.75, EDGES) == 2  # on an edge: the upper bucket
    assert quantile_edges([1.0, 2.0, 3.0], 2) == [2.0]


def sft_args(argv):
    from rlhf.supervised.sft import add_args

    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(argv)


def test_prefix_in_prompt_not_in_loss_and_eval_on_train_edges(train_setup, tmp_path):
    from transformers import AutoTokenizer

    from rlhf.supervised.conditional import load_conditional_split
    from rlhf.supervised.sft import SFTTask

    rows = [{"input": f"repeat: w{i} =", "output": f" w{i}", "score": s} for i, s in enumerate(SCORES)]
    data = write_jsonl(tmp_path / "scored.jsonl", rows)
    evals = write_jsonl(tmp_path / "eval.jsonl", [{"input": "repeat: hi =", "output": " hi", "score": 99.0},
                                                  {"input": "repeat: lo =", "output": " lo", "score": -5.0}])
    args = sft_args(["--pretrain", train_setup["model"], "--dataset", data, "--eval_dataset", evals, "--save_path",
                     str(tmp_path / "o"), "--conditional", "--score_key", "score", "--reward_buckets", "4"])
    from rlhf.supervised.loop import build_job

    job = build_job(args, SFTTask())  # the flags' own checks
    SFTTask().validate(job)
    tok = AutoTokenizer.from_pretrained(train_setup["model"])
    train, ev, stats, info = load_conditional_split(job, tok)
    assert info["edges"] == pytest.approx(EDGES) and info["train_bucket_counts"] == [2, 2, 2, 2]
    assert info["top_prefix"] == "<rm_score>: 3 " and stats["num_samples"] == 8
    for s in train:
        i = int(s.origin.rsplit(" ", 1)[1]) - 1  # "path: line N"
        prompt = f"<rm_score>: {BUCKETS[i]} " + rows[i]["input"]
        p_ids = tok(prompt)["input_ids"]
        assert s.input_ids[:s.prompt_len].tolist() == p_ids and s.prompt_len == len(p_ids)
        assert not s.loss_mask[:s.prompt_len].any() and s.loss_mask[s.prompt_len:].all()  # prefix out of the loss
        assert tok.decode(s.input_ids[:s.prompt_len], skip_special_tokens=True).startswith(f"<rm_score>: {BUCKETS[i]} ")
    heads = sorted(tok.decode(s.input_ids[:s.prompt_len], skip_special_tokens=True)[:13] for s in ev)
    assert heads == ["<rm_score>: 0", "<rm_score>: 3"]  # bucketed with the training edges


def test_prefix_of_a_message_list():
    from rlhf.supervised.conditional import prefix_prompt

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert prefix_prompt(msgs, "<rm_score>: 4 ")[1]["content"] == "<rm_score>: 4 hi"
    assert msgs[1]["content"] == "hi"  # not modified in place


@pytest.fixture
def no_models(monkeypatch):
    import rlhf.distributed
    import rlhf.distributed.mesh
    import rlhf.runtime.role

    def boom(*a, **k):
        raise AssertionError("a model or process group was built before the input was checked")

    monkeypatch.setattr(rlhf.runtime.role.ModelRole, "__init__", boom)
    monkeypatch.setattr(rlhf.distributed.mesh, "initialize_mesh", boom)
    monkeypatch.setattr(rlhf.distributed, "initialize_mesh", boom)
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("flags,needle", [
    (["--conditional"], "--conditional needs exactly one score source"),
    (["--conditional", "--score_key", "score", "--reward_pretrain", "RM"], "exactly one score source"),
    (["--reward_pretrain", "RM"], "--reward_pretrain is a --conditional flag"),
    (["--conditional", "--score_key", "score", "--reward_buckets", "1"], "--reward_buckets must be >= 2, got 1"),
    (["--conditional", "--score_key", "score", "--conditional_template", "best: "], "must contain {bucket}"),
    (["--conditional", "--score_key", "score", "--conditional_template", "{score} "], "--conditional_template"),
    (["--conditional", "--reward_pretrain", "RM,RM"], "one reward model"),
    (["--conditional", "--reward_pretrain", "MODEL"], "ForSequenceClassification"),
    (["--conditional", "--score_key", "nokey"], "--score_key 'nokey' must be a number"),
])
def test_bad_input(train_setup, tmp_path, no_models, capsys, flags, needle):
    from rlhf.supervised import sft
    from rlhf.models.tiny import make_tiny_hf
    from rlhf.supervised.loop import main

    rm = make_tiny_hf(str(tmp_path / "rm"), "llama", seq_cls=True, tokenizer_dir=train_setup["model"],
                      num_hidden_layers=1, hidden_size=64)
    flags = [{"RM": rm, "RM,RM": f"{rm},{rm}", "MODEL": train_setup["model"]}.get(f, f) for f in flags]
    data = write_jsonl(tmp_path / "d.jsonl", [{"input": "a", "output": " b", "score": 1.0}] * 8)
    code = main(sft, ["--pretrain", train_setup["model"], "--dataset", data, "--save_path", str(tmp_path / "o"),
                      "--train_batch_size", "8", "--micro_train_batch_size", "2", *flags])
    err = capsys.readouterr().err
    assert code == 2 and "error:" in err and needle in err, err
