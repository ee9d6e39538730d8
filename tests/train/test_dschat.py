"""The seed systems' own launch commands: launch/dschat.py (DeepSpeed-Chat's steps mapped onto ours by
rlhf/config/migration.py: the flags, its --data_split, the flags refused by name, and its three steps chained end to end
on a Hub-named dataset from the local HF cache), and AIAK-RLHF's reward-model launch through
``python -m torch.distributed.launch``."""
from __future__ import annotations

import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.config.migration import dschat_to_ours, split_parts


def _flag(argv, name):
    return argv[argv.index(name) + 1]


@pytest.fixture
def rm_static(tmp_path, monkeypatch):
    """A cached Hub snapshot of a Dahoas/rm-static-like dataset (prompt, response, chosen, rejected)."""
    snap = tmp_path / "hub" / "datasets--Dahoas--rm-static" / "snapshots" / "r1" / "data"
    snap.mkdir(parents=True)
    rows = [{"prompt": f"\n\nHuman: sort {i} {i + 2} {i + 1}\n\nAssistant:", "response": f" {i} {i + 1} {i + 2}",
             "chosen": f" {i} {i + 1} {i + 2}", "rejected": f" {i + 2} {i} {i + 1}"} for i in range(60)]
    pq.write_table(pa.Table.from_pylist(rows), snap / "train-00000-of-00001.parquet")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return rows


def test_data_split_partitions_each_dataset():
    parts = split_parts(100, "2,4,4", seed=1234)
    assert [len(p) for p in parts] == [20, 40, 40]
    assert sorted(sum(parts, [])) == list(range(100))
    assert parts == split_parts(100, "2,4,4", seed=1234) and parts != split_parts(100, "2,4,4", seed=1)
    with pytest.raises(ValueError, match="--data_split must be three"):
        split_parts(10, "5,5", 0)


def test_steps_map_to_our_flags(rm_static, tmp_path):
    common = ["--data_path", "Dahoas/rm-static", "--data_output_path", str(tmp_path / "data"), "--dtype", "bf16"]
    s1 = dschat_to_ours(1, ["--model_name_or_path", "m", "--per_device_train_batch_size", "4",
                            "--gradient_accumulation_steps", "2", "--output_dir", "o1", "--lora_dim", "8", *common], 2)
    assert (_flag(s1, "--train_batch_size"), _flag(s1, "--micro_train_batch_size"), _flag(s1, "--lora_rank")) == \
        ("16", "4", "8") and "--bf16" in s1 and _flag(s1, "--output_key") == "chosen"
    parts = [len(open(_flag(dschat_to_ours(k, args + common, 1), "--dataset" if k < 3 else "--prompt_data"))
                  .readlines())
             for k, args in ((1, ["--model_name_or_path", "m", "--output_dir", "o"]),
                             (2, ["--model_name_or_path", "m", "--output_dir", "o"]),
                             (3, ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c",
                                  "--output_dir", "o"]))]
    assert parts == [12, 24, 24]  # 60 rows at 2,4,4
    s3 = dschat_to_ours(3, ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir",
                            "o3", "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "2",
                            "--ppo_epochs", "2", "--offload_reference_model", "--enable_hybrid_engine", "--enable_ema",
                            "--unsupervised_dataset_name", "Dahoas/rm-static", "--unsup_coef", "0.5", *common], 2)
    got = [_flag(s3, f) for f in ("--rollout_batch_size", "--train_batch_size", "--max_epochs", "--critic_pretrain",
                                  "--save_path")]
    assert got == ["8", "4", "2", "c", os.path.join("o3", "actor")]
    assert "--ref_reward_offload" in s3 and _flag(s3, "--ema_beta") == "0.992"
    assert (_flag(s3, "--pretrain_data"), _flag(s3, "--ptx_coef")) == ("Dahoas/rm-static", "0.5")


@pytest.mark.parametrize("flags,needle", [(["--dropout", "0.1"], "--dropout: dropout is taken from the model's config"),
                                          (["--dtype", "fp16"], "--dtype fp16: fp16 mixed precision is not supported")])
def test_flags_without_a_meaning_here_are_named(rm_static, tmp_path, flags, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        dschat_to_ours(1, ["--model_name_or_path", "m", "--output_dir", "o", "--data_path", "Dahoas/rm-static",
                           "--data_output_path", str(tmp_path / "d"), *flags], 1)


def test_ranks_writing_the_split_at_once_each_leave_the_whole_file(rm_static, tmp_path, monkeypatch):
    """Every rank of a dschat job writes the same split files. One rank writing its copy start to end between the
    other's write and rename (that interleaving, forced here) fails neither, and leaves the whole file."""
    from rlhf.config import migration

    argv = ["--model_name_or_path", "m", "--output_dir", "o", "--data_path", "Dahoas/rm-static",
            "--data_output_path", str(tmp_path / "d")]
    ds = migration.dschat_parser(2).parse_args(argv)
    real = os.replace

    def the_other_rank_in_between(src, dst):
        monkeypatch.setattr(os, "replace", real)
        migration.prepare_dschat_data(ds, 2)
        real(src, dst)

    monkeypatch.setattr(os, "replace", the_other_rank_in_between)
    path, rows = migration.prepare_dschat_data(ds, 2)
    got = [json.loads(ln) for ln in open(path)]
    want = [rm_static[j] for j in split_parts(60, ds.data_split, ds.seed)[1]]
    assert rows == 24 and got == [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in want]
    assert os.listdir(tmp_path / "d") == [os.path.basename(path)]


def test_three_steps_chain(rm_static, tmp_path, monkeypatch):
    """DeepSpeed-Chat's pipeline with its own command lines: step 1 (SFT) and step 2 (RM) in this process, step 3
    (PPO, its actor from step 1 and its critic/reward from step 2) through torchrun on 2 ranks with vLLM."""
    from helpers import REPO, free_port, run_torchrun, tail

    from rlhf.models.tiny import make_tiny_hf

    sys.path.insert(0, os.path.join(REPO, "launch"))
    import dschat

    # head_dim 32: one that vLLM's CPU attention supports
    base = make_tiny_hf(str(tmp_path / "base"), "llama", seed=0, num_hidden_layers=2, hidden_size=64,
                        num_attention_heads=2, num_key_value_heads=2, intermediate_size=128)
    data = ["--data_path", "Dahoas/rm-static", "--data_output_path", str(tmp_path / "data"), "--dtype", "fp32"]
    for step in (1, 2):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        argv = ["--step", str(step), "--model_name_or_path", base, "--per_device_train_batch_size",
                "4", "--max_seq_len", "64", "--learning_rate", "1e-3", "--output_dir", str(tmp_path / f"step{step}"),
                "--local_rank=0", *data]
        assert dschat.main(argv) == 0
        assert json.load(open(tmp_path / f"step{step}" / "train_result.json"))["train"]["loss"] > 0
    assert json.load(open(tmp_path / "step2" / "config.json"))["architectures"] == ["LlamaForSequenceClassification"]
    p = run_torchrun(os.path.join(REPO, "launch/dschat.py"), 2, [
        "--step", "3", "--actor_model_name_or_path", str(tmp_path / "step1"), "--critic_model_name_or_path",
        str(tmp_path / "step2"), "--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2",
        "--max_answer_seq_len", "4", "--max_prompt_seq_len", "32", "--actor_learning_rate", "1e-3",
        "--critic_learning_rate", "1e-3", "--output_dir", str(tmp_path / "step3"), "--enable_hybrid_engine", *data],
        timeout=600, HF_HUB_CACHE=os.environ["HF_HUB_CACHE"])
    assert p.returncode == 0, tail(p)
    hist = json.load(open(tmp_path / "step3" / "actor" / "ppo_result.json"))["history"]
    assert len(hist) == 6 and all(h["rollout_logprob_drift"] < 1e-3 for h in hist)  # 24 prompts, 4 per step


def test_aiak_rm_under_torch_distributed_launch(train_setup, tmp_path):
    """AIAK-RLHF starts reward-model training with ``python3 -m torch.distributed.launch`` (which adds
    ``--local-rank=N``) and its node counts: the same command line trains and exports here."""

    from helpers import REPO, free_port, run_tagged, tail

    out = tmp_path / "rm"
    cmd = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2", "--master_port",
           str(free_port()), os.path.join(REPO, "launch/rm.py"), "--pretrain", train_setup["model"], "--dataset",
           train_setup["rm"], "--save_path", str(out), "--train_batch_size", "16", "--micro_train_batch_size", "8",
           "--max_samples", "64", "--max_len", "64", "--num_nodes", "1", "--num_gpus_per_node", "2"]
    p = run_tagged(cmd, 600)
    assert p.returncode == 0, tail(p)
    assert json.load(open(out / "config.json"))["rlhf"]["reward_std"] > 0
