"""Templates, response-only loss masks, RM pairs, PPO prompts, truncation counts and bad-data errors."""
import pytest
from _data_testlib import write_jsonl

from rlhf.data import DataConfig, build_prompt_dataset, build_rm_dataset, build_sft_dataset

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort three one two"}]


def _cfg(tmp_path, rows, **kw) -> DataConfig:
    return DataConfig(dataset=write_jsonl(tmp_path / "d.jsonl", rows), seed=0, **kw)


def _by_origin(samples):
    return {s.origin.rsplit(" ", 1)[1]: s for s in samples}  # line number -> sample


def test_sft_input_template_and_response_only_loss_mask(tmp_path, tok):
    rows = [{"input": "the quick fox", "output": "jumps over the lazy dog"},
            {"input": "apple", "output": "banana cherry"}]
    samples, stats = build_sft_dataset(_cfg(tmp_path, rows, input_template="User: {}\nAssistant: "), tok)
    assert stats.num_samples == 2 and stats.num_truncated == 0
    for line, row in [("1", rows[0]), ("2", rows[1])]:
        s = _by_origin(samples)[line]
        ids, mask = s.input_ids.tolist(), s.loss_mask
        assert tok.decode(ids) == f"User: {row['input']}\nAssistant: {row['output']}</s>"
        assert tok.decode(s.input_ids[mask].tolist()) == row["output"] + "</s>"
        assert tok.decode(ids[: s.prompt_len]) == f"User: {row['input']}\nAssistant: "
        assert mask[s.prompt_len:].all() and not mask[: s.prompt_len].any() and ids[-1] == tok.eos_token_id


def test_sft_chat_template_with_strings_messages_and_conversations(tmp_path, tok):
    rows = [{"input": "sort three one two", "output": "one two three"},
            {"input": CHAT, "output": [{"role": "assistant", "content": "one three two"}]}]
    samples, _ = build_sft_dataset(_cfg(tmp_path, rows, apply_chat_template=True), tok)
    s1, s2 = _by_origin(samples)["1"], _by_origin(samples)["2"]
    assert tok.decode(s1.input_ids[: s1.prompt_len].tolist()) == "user: sort three one two\nassistant:"
    assert tok.decode(s1.input_ids[s1.loss_mask].tolist()) == " one two three\n</s>"
    assert tok.decode(s2.input_ids[: s2.prompt_len].tolist()) == ("system: be brief\nuser: sort three one two\n"
                                                                    "assistant:")
    assert tok.decode(s2.input_ids[s2.loss_mask].tolist()) == " one three two\n</s>"

    conv = [{"messages": CHAT + [{"role": "assistant", "content": "one three two"}]}]
    (s3,), _ = build_sft_dataset(DataConfig(dataset=write_jsonl(tmp_path / "c.jsonl", conv), input_key="messages",
                                            output_key=None, apply_chat_template=True), tok)
    assert s3.input_ids.tolist() == s2.input_ids.tolist() and s3.prompt_len == s2.prompt_len


def test_sft_truncation_keeps_the_start_and_counts(tmp_path, tok):
    rows = [{"input": "a", "output": "one two"},                                  # short: untouched
            {"input": "the quick brown fox", "output": "jumps over the lazy dog " * 5},  # cut in the response
            {"input": "the quick brown fox " * 10, "output": "dog"}]              # prompt alone too long: dropped
    samples, stats = build_sft_dataset(_cfg(tmp_path, rows, max_len=30), tok)
    assert (stats.num_truncated, stats.num_dropped, stats.num_samples) == (2, 1, 2)
    cut = _by_origin(samples)["2"]
    full, _ = build_sft_dataset(_cfg(tmp_path, rows[1:2], max_len=1000), tok)
    assert len(cut.input_ids) == 30 and cut.input_ids.tolist() == full[0].input_ids[:30].tolist()
    assert cut.loss_mask.tolist() == full[0].loss_mask[:30].tolist()
    assert stats.as_metrics()["data/num_truncated"] == 2.0


def test_rm_pairs_margin_and_truncation(tmp_path, tok):
    rows = [{"prompt": "sort two one", "chosen": "one two", "rejected": "two one", "margin": 0.5},
            {"prompt": "apple", "chosen": "banana " * 20, "rejected": "cherry", "margin": 1}]
    cfg = _cfg(tmp_path, rows, prompt_key="prompt", margin_key="margin", input_template="Q: {}\nA: ", max_len=40)
    samples, stats = build_rm_dataset(cfg, tok)
    s1, s2 = _by_origin(samples)["1"], _by_origin(samples)["2"]
    assert tok.decode(s1.chosen_ids.tolist()) == "Q: sort two one\nA: one two</s>"
    assert tok.decode(s1.rejected_ids.tolist()) == "Q: sort two one\nA: two one</s>"
    assert (s1.margin, s2.margin) == (0.5, 1.0)
    assert (stats.num_truncated, stats.num_dropped) == (1, 0)
    assert len(s2.chosen_ids) == 40 and tok.decode(s2.rejected_ids.tolist()) == "Q: apple\nA: cherry</s>"

    convs = [{"chosen": CHAT + [{"role": "assistant", "content": "one two three"}],
              "rejected": CHAT + [{"role": "assistant", "content": "three"}]}]
    (p,), _ = build_rm_dataset(DataConfig(dataset=write_jsonl(tmp_path / "c.jsonl", convs),
                                          apply_chat_template=True), tok)
    assert tok.decode(p.chosen_ids.tolist()).endswith("assistant: one two three\n</s>")
    assert tok.decode(p.rejected_ids.tolist()).startswith("system: be brief\n")


def test_ppo_prompts_left_truncate_and_count(tmp_path, tok):
    rows = [{"input": "sort one two", "label": "one two"}, {"input": "the quick brown fox " * 10, "label": "x"}]
    samples, stats = build_prompt_dataset(_cfg(tmp_path, rows, apply_chat_template=True, prompt_max_len=40,
                                               label_key="label"), tok)
    assert stats.num_truncated == 1
    short, long = _by_origin(samples)["1"], _by_origin(samples)["2"]
    assert tok.decode(short.prompt_ids.tolist()) == "user: sort one two\nassistant:" and short.label == "one two"
    full = tok.encode(long.prompt, add_special_tokens=False)
    assert len(long.prompt_ids) == 40 and long.prompt_ids.tolist() == full[-40:]
    assert tok.decode(long.prompt_ids.tolist()).endswith("fox \nassistant:")


@pytest.mark.parametrize("row, key, problem", [
    ({"input": "hi"}, "output", "missing key 'output'"),
    ({"input": "  \n", "output": "x"}, "input", "key 'input' is empty or blank"),
    ({"input": "hi", "output": None}, "output", r"key 'output' is empty \(null\)"),
    ({"input": "hi", "output": 3}, "output", "key 'output' must be a string or a list of messages, got int"),
    ({"input": [{"role": "user", "content": "hi"}], "output": "x"}, "input",
     "key 'input' holds a list of messages; pass --apply_chat_template"),
])
def test_bad_sft_records_name_file_line_and_key(tmp_path, tok, row, key, problem):
    good = {"input": "apple", "output": "banana"}
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, row], blank_lines=(1,))  # the bad row is on line 4
    with pytest.raises(ValueError, match=rf"d\.jsonl: line 4: {problem}.*--skip_bad_samples") as e:
        build_sft_dataset(DataConfig(dataset=path), tok)
    assert f"'{key}'" in str(e.value)


def test_bad_records_in_chat_rm_and_prompt_data(tmp_path, tok):
    path = write_jsonl(tmp_path / "rm.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b", "margin": 0},
                                               {"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"}])
    with pytest.raises(ValueError, match=r"rm\.jsonl: line 2: key 'margin' must be a number, got str"):
        build_rm_dataset(DataConfig(dataset=path, prompt_key="prompt", margin_key="margin"), tok)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"chosen": msgs, "rejected": msgs}])
    with pytest.raises(ValueError, match=r"chat\.jsonl: line 1: key 'chosen': message 2 has empty content"):
        build_rm_dataset(DataConfig(dataset=path, apply_chat_template=True), tok)
    path = write_jsonl(tmp_path / "p.jsonl", [{"input": "x"}, '{"input": "x"'])
    with pytest.raises(ValueError, match=r"p\.jsonl: line 2: invalid JSON"):
        build_prompt_dataset(DataConfig(dataset=path), tok)


def test_skip_bad_samples_counts_and_all_bad_is_an_error(tmp_path, tok):
    rows = [{"input": "apple", "output": "banana"}, {"input": "x"}, {"input": "", "output": "y"},
            "not json", {"input": "cherry", "output": "delta"}]
    samples, stats = build_sft_dataset(_cfg(tmp_path, rows, skip_bad_samples=True), tok)
    assert (stats.num_records, stats.num_bad_skipped, stats.num_samples) == (5, 3, 2)
    assert sorted(s.origin.rsplit(" ", 1)[1] for s in samples) == ["1", "5"]
    with pytest.raises(ValueError, match=r"all 2 records are bad.*line 1: missing key 'response'"):
        build_sft_dataset(_cfg(tmp_path, rows[:2], output_key="response", skip_bad_samples=True), tok)


def test_errors_come_before_tokenizing(tmp_path, tok):
    good = write_jsonl(tmp_path / "good.jsonl", [{"input": "a", "output": "b"}] * 3)

    class NoTokenizing:  # any tokenizer call would fail the test
        eos_token_id, name_or_path = 2, "stub"

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"input": "a", "output": "b"}, {"input": "a"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2: missing key 'output'"):
        build_sft_dataset(DataConfig(dataset=f"{good},{bad}"), NoTokenizing())
    with pytest.raises(ValueError, match=r"missing\.jsonl.*does not exist"):
        build_sft_dataset(DataConfig(dataset=f"{good},{tmp_path / 'missing.jsonl'}"), NoTokenizing())


def test_config_template_checks(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"input": "a", "output": "b"}])
    with pytest.raises(ValueError, match="--input_template must contain exactly one"):
        DataConfig(dataset=path, input_template="User: ")
    with pytest.raises(ValueError, match="--input_template .* and --apply_chat_template are exclusive"):
        DataConfig(dataset=path, input_template="User: {}", apply_chat_template=True)
    with pytest.raises(ValueError, match="--output_key is required unless --apply_chat_template"):
        build_sft_dataset(DataConfig(dataset=path, output_key=None), None)


@pytest.fixture(scope="module")
def bos_tok(tok, tmp_path_factory):
    """The tiny tokenizer with a post-processor that prepends BOS, like Llama's."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("bos_tok"))
    tok.save_pretrained(path)
    t = AutoTokenizer.from_pretrained(path)
    t.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return t


def test_bos_goes_on_the_prompt_only_and_survives_left_truncation(tmp_path, bos_tok):
    (s,), _ = build_sft_dataset(_cfg(tmp_path, [{"input": "apple", "output": "banana"}]), bos_tok)
    assert s.input_ids.tolist().count(1) == 1 and s.input_ids[0] == 1 and s.prompt_len == 6
    assert bos_tok.decode(s.input_ids[s.loss_mask].tolist()) == "banana</s>"
    (p,), stats = build_prompt_dataset(_cfg(tmp_path, [{"input": "the quick brown fox"}], prompt_max_len=8),
                                       bos_tok)
    assert stats.num_truncated == 1 and p.prompt_ids.tolist() == [1] + bos_tok.encode("own fox",
                                                                                     add_special_tokens=False)


def test_pretrain_mode_trains_on_every_token(tmp_path, tok):
    """--pretrain_mode: the record's text alone, the loss on all of it (and EOS); the tokenizer's BOS is the only
    position without a target. Checked against the tokenizer by hand."""
    from _data_testlib import write_jsonl

    from rlhf.data import DataConfig, build_sft_dataset

    text = "the quick brown fox jumps"
    path = write_jsonl(tmp_path / "raw.jsonl", [{"text": text, "other": 1}])
    samples, _ = build_sft_dataset(DataConfig(dataset=path, input_key="text", output_key=None,
                                              pretrain_mode=True), tok)
    want = tok.encode("", add_special_tokens=True) + tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    assert samples[0].input_ids.tolist() == want
    n_bos = len(tok.encode("", add_special_tokens=True))
    assert samples[0].loss_mask.tolist() == [False] * n_bos + [True] * (len(want) - n_bos)
