"""SFT and RM end to end through launch/*.py on 2 ranks: learning, HF export, resume exactness, bad data."""
import json
import os
import re

import pytest
import torch
from crash_harness import assert_resumed
from helpers import REPO, run_torchrun, tail

SFT = os.path.join(REPO, "launch/sft.py")
RM = os.path.join(REPO, "launch/rm.py")


def common(save, **kw):
    args = {"--save_path": save, "--train_batch_size": "16", "--micro_train_batch_size": "4",
            "--max_len": "64", "--lr_warmup_ratio": "0.0", "--seed": "7"}
    args.update({k: str(v) for k, v in kw.items()})
    out = []
    for k, v in args.items():
        out += [k] if v == "" else [k, v]
    return out


def test_sft_loss_falls_tp2(train_setup, tmp_path):
    save = str(tmp_path / "sft")
    p = run_torchrun(SFT, 2, ["--pretrain", train_setup["model"], "--dataset", train_setup["sft"],
                              "--eval_dataset", train_setup["sft_eval"], "--max_epochs", "3",
                              "--learning_rate", "3e-3", "--tensor_model_parallel_size", "2"] + common(save))
    assert p.returncode == 0, tail(p)
    res = json.load(open(os.path.join(save, "train_result.json")))
    first = [ln for ln in p.stderr.splitlines() + p.stdout.splitlines() if "[sft 1/" in ln]
    assert first, tail(p)
    loss0 = float(first[0].split("loss=")[1].split()[0])
    assert res["eval"]["loss"] < 0.5 * loss0, (loss0, res)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(save)
    assert model.config.architectures == ["LlamaForCausalLM"]
    _same_as_the_converter(save, save, tmp_path / "converted")


def _same_as_the_converter(save: str, hf: str, out) -> None:
    """The HF export written in the job (rlhf/runtime/export.py: the weight sync's gather, in process) holds the tensors and
    config that tools/convert_megatron_to_hf.py makes of the job's megatron copy (``<save>/megatron``), bit for bit
    (the converter ran at every export until 2026-11-28; here in this process, its own one-rank mesh)."""
    from safetensors.torch import load_file

    from rlhf.models.convert import megatron_to_hf

    megatron_to_hf(os.path.join(save, "megatron"), str(out))
    a, b = load_file(os.path.join(hf, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a), \
        sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))
    ca, cb = (json.load(open(os.path.join(d, "config.json"))) for d in (hf, out))
    assert ca == cb, {k: (ca.get(k), cb.get(k)) for k in set(ca) | set(cb) if ca.get(k) != cb.get(k)}


def test_rm_accuracy_export_and_scores(train_setup, tmp_path):
    save = str(tmp_path / "rm")
    p = run_torchrun(RM, 2, ["--pretrain", train_setup["model"], "--dataset", train_setup["rm"],
                             "--eval_dataset", train_setup["rm_eval"], "--max_epochs", "2",
                             "--learning_rate", "2e-3", "--prompt_key", "prompt", "--chosen_key", "chosen",
                             "--rejected_key", "rejected", "--export_format", "openrlhf"] + common(save))
    assert p.returncode == 0, tail(p)
    res = json.load(open(os.path.join(save, "train_result.json")))
    assert res["eval"]["acc"] >= 0.9, res
    assert res["reward_std"] > 0
    import transformers

    from rlhf.models.reward_format import from_openrlhf

    # --export_format openrlhf: OpenRLHF's folder (value_head.weight, its statistics as mean/std), which our
    # converter turns back into an HF sequence classifier for the checks below.
    cfg = json.load(open(os.path.join(save, "config.json")))
    assert cfg["value_head_prefix"] == "value_head" and cfg["mean"] == pytest.approx(res["reward_mean"])
    assert "value_head.weight" in _final_weights(save)
    exported = save
    save = from_openrlhf(save, str(tmp_path / "rm_hf"))
    _same_as_the_converter(exported, save, tmp_path / "converted")  # the value head's export too
    model = transformers.AutoModelForSequenceClassification.from_pretrained(save).eval()
    tok = transformers.AutoTokenizer.from_pretrained(save)
    assert model.config.rlhf["reward_mean"] == pytest.approx(res["reward_mean"])
    # The exported HF model prefers the held-out chosen answers as the trained model did.
    rows = [json.loads(ln) for ln in open(train_setup["rm_eval"])][:16]
    wins = 0
    with torch.no_grad():
        for r in rows:
            c = model(**tok(r["prompt"] + r["chosen"] + tok.eos_token, return_tensors="pt")).logits.item()
            j = model(**tok(r["prompt"] + r["rejected"] + tok.eos_token, return_tensors="pt")).logits.item()
            wins += c > j
    assert wins / len(rows) >= 0.9


def _final_weights(save):
    from safetensors.torch import load_file

    return load_file(os.path.join(save, "model.safetensors"))


def _resume_base(train_setup, zero_stage):
    return ["--pretrain", train_setup["model"], "--dataset", train_setup["sft"], "--max_epochs", "1",
            "--learning_rate", "1e-3", "--max_samples", "96", "--zero_stage", str(zero_stage)]


@pytest.fixture(scope="module")
def straight_run(train_setup, tmp_path_factory):
    """The uninterrupted 6-step run (DP2) for a --zero_stage, made once per module."""
    runs = {}

    def get(zero_stage: int) -> str:
        if zero_stage not in runs:
            save = str(tmp_path_factory.mktemp(f"straight{zero_stage}"))
            p = run_torchrun(SFT, 2, _resume_base(train_setup, zero_stage) + common(save))
            assert p.returncode == 0, tail(p)
            runs[zero_stage] = save
        return runs[zero_stage]

    return get


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_resume_is_exact(train_setup, tmp_path, zero_stage, straight_run):
    """6 steps straight == 3 steps, stop, resume to 6: bit-identical weights (DP2, 2 ranks). --zero_stage 1 is
    megatron's distributed optimizer: each DP rank holds half of the Adam state."""
    base = _resume_base(train_setup, zero_stage)
    straight, resumed = straight_run(zero_stage), str(tmp_path / "resumed")
    p = run_torchrun(SFT, 2, base + common(resumed, **{"--save_steps": 3, "--stop_after_steps": 3}))
    assert p.returncode == 0, tail(p)
    assert open(os.path.join(resumed, "checkpoints", "latest")).read().strip() == "iter_0000003"
    # the free-space check's estimate before a first save (parameters once per DP group; Adam states replicated
    # at stage 0, sharded at stage 1) against the bytes written
    written, estimate = map(int, re.search(r"step 3 published, (\d+) bytes \(.*bytes: (\d+)\)", p.stdout + p.stderr)
                            .groups())
    assert 0.75 * written < estimate < 1.25 * written, (written, estimate)
    if zero_stage == 0:  # negative control: the same relaunch without --load_checkpoint fails the resume check
        q = run_torchrun(SFT, 2, base + common(str(tmp_path / "control"), **{
            "--save_steps": 3, "--stop_after_steps": 1, "--ckpt_path": os.path.join(resumed, "checkpoints")}))
        assert q.returncode == 0, tail(q)
        with pytest.raises(AssertionError, match="did not resume"):
            assert_resumed(q.stdout + q.stderr, "sft", step=3)
    p = run_torchrun(SFT, 2, base + common(resumed, **{"--save_steps": 3, "--load_checkpoint": ""}))
    assert p.returncode == 0, tail(p)
    assert_resumed(p.stdout + p.stderr, "sft", step=3, total=6)
    a, b = _final_weights(straight), _final_weights(resumed)
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def crash_points(seed: int, steps: int, slow: bool) -> list[tuple[str, float]]:
    """Seeded kill points in increasing order of progress: start-up, then steps and saves at distinct seeded
    steps, then the export. CI: 5 points; RLHF_CRASH_SLOW=1: every step and every save."""
    import random

    rng = random.Random(seed)
    if slow:
        mid = [p for k in range(1, steps + 1) for p in (("step", k), ("save", k))]
    else:
        a, b, c = sorted(rng.sample(range(1, steps + 1), 3))
        mid = [("step", a), ("save", b), ("step", c)]
    return [("startup", rng.uniform(2.0, 6.0))] + mid + [("export", 0)]


def test_sigkill_anywhere_then_resume_is_exact(train_setup, tmp_path, straight_run):
    """The whole job (torchrun, both ranks, the export's subprocess) is SIGKILLed at seeded moments: during
    start-up, mid-step, mid-save and mid-export; each relaunch resumes with --load_checkpoint from whatever was
    published (none after the start-up kill). The final weights equal the uninterrupted run's bit for bit."""
    from crash_harness import crash_and_resume

    save = str(tmp_path / "crashed")
    points = crash_points(seed=11, steps=6, slow=os.environ.get("RLHF_CRASH_SLOW") == "1")
    records = crash_and_resume(SFT, 2, _resume_base(train_setup, 0) + common(save, **{"--save_steps": 1}), "sft",
                               os.path.join(save, "checkpoints"), points, seed=11, total=6)
    assert [r["point"] for r in records[:-1]] == points
    assert all(r["killed"] for r in records[:-1]), ([(r["point"], r["killed"]) for r in records],  # the ended one:
        [r["log"][-1500:] for r in records[:-1] if not r["killed"]])
    exported = [r for r in records if r["point"] == ("export", 0)][0]["log"]  # killed mid-export, not after it
    assert "fault injection: hang at export" in exported and "exported HF model" not in exported, exported[-1500:]
    # every launch after the first published save resumed (crash_and_resume checked each: 'resumed from ...
    # (step k)', k > 0, only the steps after k)
    assert not records[0]["had_checkpoint"] and records[-1]["resumed_step"] > 0
    a, b = _final_weights(straight_run(0)), _final_weights(save)
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("row,needle", [({"input": "hi"}, "output"), ({"input": "hi", "output": "  "}, "output")])
def test_bad_data_names_file_line_key(train_setup, tmp_path, row, needle):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"input": "a", "output": "b"})
    path.write_text("\n".join([good, good, json.dumps(row)]) + "\n")
    p = run_torchrun(SFT, 1, ["--pretrain", train_setup["model"], "--dataset", str(path)] +
                     common(str(tmp_path / "o"), **{"--train_batch_size": 1, "--micro_train_batch_size": 1}))
    assert p.returncode != 0
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert err and "bad.jsonl" in err[0] and "3" in err[0] and needle in err[0], p.stderr[-2000:]


def test_bad_flags_fail_before_loading(train_setup, tmp_path):
    p = run_torchrun(SFT, 2, ["--pretrain", train_setup["model"], "--dataset", train_setup["sft"]] +
                     common(str(tmp_path / "o"), **{"--train_batch_size": 10, "--micro_train_batch_size": 4}))
    assert p.returncode != 0 and "--train_batch_size 10" in p.stderr
    p = run_torchrun(SFT, 2, ["--pretrain", str(tmp_path / "missing"), "--dataset", train_setup["sft"]] +
                     common(str(tmp_path / "o")))
    assert p.returncode != 0 and "--pretrain" in p.stderr
