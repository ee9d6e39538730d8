"""A --pretrain folder that holds a model but no tokenizer files. transformers 5 builds a tokenizer from
config.json alone for some families (Qwen2: one token, every text becomes nothing), and the run used to stop at
its first update on 'non-finite loss=nan', advising a lower learning rate. Now the folder is refused before
anything loads, a tokenizer that still turns text into nothing is refused when loaded, and samples that
tokenize to no trainable token are refused with a count by the data layer itself."""
import os

import pytest

from _train_testlib import sft_rows, write_jsonl


@pytest.fixture(scope="module")
def vocabless(tmp_path_factory):
    """A tiny Qwen2 HF folder with config.json and weights only."""
    from rlhf.models.tiny import make_tiny_hf

    d = str(tmp_path_factory.mktemp("vocabless") / "qwen2")
    make_tiny_hf(d, "qwen2", seed=0, num_hidden_layers=1, hidden_size=64)
    for f in os.listdir(d):
        if f not in ("config.json", "model.safetensors", "generation_config.json"):
            os.remove(os.path.join(d, f))
    return d


def test_transformers_builds_an_empty_tokenizer_there(vocabless):
    """The premise (negative control of the checks below): without them this tokenizer loads and is empty."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vocabless)
    assert len(tok) == 1 and tok.encode("hello world", add_special_tokens=False) == []


def test_the_folder_is_refused_before_anything_loads(vocabless, tmp_path, capsys):
    from rlhf.supervised import sft
    from rlhf.supervised.loop import main

    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(16, 0))
    out = tmp_path / "out"
    assert main(sft, ["--pretrain", vocabless, "--dataset", data, "--save_path", str(out), "--train_batch_size",
                      "8", "--micro_train_batch_size", "4"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and err[0].startswith(f"error: --pretrain {vocabless}: no tokenizer files"), err
    assert not out.exists()  # refused before the process group, the data and the model


def test_load_tokenizer_refuses_a_tokenizer_that_makes_nothing(vocabless, tmp_path):
    from rlhf.models.source import load_tokenizer

    with pytest.raises(ValueError, match="--pretrain .*: no tokenizer files"):
        load_tokenizer(vocabless)
    # a vocabulary file that holds nothing: past the file check, refused by what it does to a sentence
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(vocabless).save_pretrained(str(tmp_path / "empty"))
    assert os.path.exists(tmp_path / "empty" / "tokenizer.json")
    with pytest.raises(ValueError, match=r"--reward_pretrain .*empty: its tokenizer \(Qwen2Tokenizer, 1 tokens\) "
                                         r"turns 'The quick"):
        load_tokenizer(str(tmp_path / "empty"), "--reward_pretrain")


@pytest.mark.parametrize("kind", ["sft", "rm", "kto", "prompt"])
def test_samples_with_no_trainable_token_are_refused_with_a_count(vocabless, train_setup, tmp_path, kind):
    from transformers import AutoTokenizer

    from rlhf.data import DataConfig, build_prompt_dataset, build_rm_dataset, build_sft_dataset
    from rlhf.data.preference import build_kto_dataset

    tok = AutoTokenizer.from_pretrained(vocabless)  # the empty tokenizer, as before the folder check
    rows = [{"input": f"say {i}", "output": f"word {i}", "prompt": f"q {i}", "chosen": "yes", "rejected": "no",
             "label": True} for i in range(12)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(dataset=str(path), input_key="input", output_key="output", prompt_key="prompt",
                     chosen_key="chosen", rejected_key="rejected", max_len=64, prompt_max_len=64)
    build = {"sft": lambda: build_sft_dataset(cfg, tok), "rm": lambda: build_rm_dataset(cfg, tok),
             "kto": lambda: build_kto_dataset(cfg, tok, "label"),
             "prompt": lambda: build_prompt_dataset(cfg, tok)}[kind]
    what = "prompts" if kind == "prompt" else "samples"
    with pytest.raises(ValueError, match=rf"^--dataset: 12 of 12 {what} tokenize to no trainable token \(first: "
                                         rf".*d.jsonl: line \d+\); .*tokenizer of --pretrain"):
        build()
    # the same data with a working tokenizer builds: the refusal is the tokenizer's doing
    tok = AutoTokenizer.from_pretrained(train_setup["model"])
    samples, stats = build()
    assert len(samples) == 12 and stats.num_untrainable == 0
