"""--packing_samples for SFT and RM: a packed step equals a padded one (loss, gradients, weights), the flag reaches
the trainer, and packing-incompatible models are refused before any work.

The equivalence runs in one 2-rank torchrun job (tests/train/_packing_equiv_worker.py, about 30 s): TP1 (DP2),
TP2 and PP2 (packed rows filled to one length with a dummy sequence).
"""
import argparse
import json
import os
import random

import pytest
from helpers import REPO, run_torchrun, tail

LAYOUTS = ["tp1", "tp2", "pp2"]
WORDS = "apple banana cherry delta echo golf hotel india juliet kilo lima mike oscar papa romeo tango".split()


def write_varied(path, n: int, seed: int, rm: bool) -> str:
    """1 to 12 words per sample, so that padded micro-batches carry plenty of padding."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ws = [rng.choice(WORDS) for _ in range(rng.randint(1, 12))]
            if rm:
                row = {"prompt": "sort: " + " ".join(ws) + " =", "chosen": " " + " ".join(sorted(ws)),
                       "rejected": " " + " ".join(sorted(ws, reverse=True)[: rng.randint(1, len(ws))])}
            else:
                row = {"input": "repeat: " + " ".join(ws) + " =", "output": " " + " ".join(ws[: rng.randint(1, 12)])}
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def result(train_setup, tmp_path_factory):
    work = tmp_path_factory.mktemp("packing")
    sft, rm = write_varied(work / "sft.jsonl", 24, 0, False), write_varied(work / "rm.jsonl", 24, 1, True)
    out = str(work / "packing_equiv.json")
    p = run_torchrun(os.path.join(REPO, "tests/train/_packing_equiv_worker.py"), 2,
                     [train_setup["model"], sft, rm, out], timeout=600)
    assert p.returncode == 0, tail(p)
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("task", ["sft", "rm"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_step_matches_padded(result, layout, task):
    r = result[f"{layout}/{task}"]
    assert r["padding_frac"] > 0.2 and r["real_tokens"] > 0  # the padded run did carry padding
    if layout != "pp2":  # no dummy padding without PP: exactly the real tokens
        assert r["packed_tokens"] == r["real_tokens"]
    assert r["grad_min_ref_norm"] > 0  # every parameter got a gradient
    # fp32; only the order of the sums differs. The RM gradient enters at one token per sequence and is
    # ill-conditioned: the padded fp32 gradient itself is ~3e-5 off an fp64 run, where packed and padded agree to
    # 3e-14 (checked when this test was written).
    assert r["loss_rel_diff"] <= 1e-6, r
    assert r["grad_max_rel_diff"] <= (1e-5 if task == "sft" else 1e-4), r
    assert r["weight_max_abs_diff"] <= 1e-6, r


def test_flag_reaches_the_trainer_pp2(train_setup, tmp_path):
    """launch/sft.py --packing_samples at PP2: packed rows of different lengths per step run through the
    pipeline (filled to one length), and the log says packing is on."""
    p = run_torchrun(os.path.join(REPO, "launch/sft.py"), 2, [
        "--pretrain", train_setup["model"], "--dataset", train_setup["sft"], "--save_path", str(tmp_path / "o"),
        "--train_batch_size", "8", "--micro_train_batch_size", "2", "--max_len", "64", "--max_samples", "32",
        "--pipeline_model_parallel_size", "2", "--packing_samples", "--stop_after_steps", "2"])
    assert p.returncode == 0, tail(p)
    log = p.stderr + p.stdout
    assert "--packing_samples: each micro-batch runs as one padding-free row" in log, tail(p)
    assert "[sft 2/" in log, tail(p)


def test_sliding_window_model_is_refused(tmp_path):
    from rlhf.supervised import sft
    from rlhf.config.job import SupervisedJob, validate_common
    from rlhf.models.tiny import make_tiny_hf

    model = make_tiny_hf(str(tmp_path / "mistral"), "mistral", num_hidden_layers=1, sliding_window=16)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input": "a", "output": "b"}) + "\n")
    p = argparse.ArgumentParser()
    sft.add_args(p)
    args = p.parse_args(["--pretrain", model, "--dataset", str(data), "--save_path", str(tmp_path / "o"),
                         "--max_len", "64", "--train_batch_size", "8", "--micro_train_batch_size", "8"])
    validate_common(SupervisedJob.from_args(args), 1)  # fine unpacked
    args.packing_samples = True
    with pytest.raises(ValueError, match="--packing_samples.*sliding_window=16.*--max_len 64"):
        validate_common(SupervisedJob.from_args(args), 1)
