"""The converter and compare_logits command lines: round trip, TP2xPP2 logits on 4 ranks, bad input."""
import json
import os
import shutil

import pytest
import torch
from helpers import REPO, run_python, run_torchrun, tail
from safetensors.torch import load_file

CONVERT = os.path.join(REPO, "tools/convert_hf_to_megatron.py")
BACK = os.path.join(REPO, "tools/convert_megatron_to_hf.py")
COMPARE = os.path.join(REPO, "tools/compare_logits.py")


@pytest.mark.parametrize("name,auto,layout", [
    ("llama", "AutoModelForCausalLM", (2, 2, 1)),
    ("qwen2-cls", "AutoModelForSequenceClassification", (2, 2, 1)),
    ("qwen3", "AutoModelForCausalLM", (2, 2, 1)),  # q/k norms, head_dim != hidden/heads
    ("llama-kv1", "AutoModelForCausalLM", (2, 2, 1)),  # 1 KV head split over TP 2
    ("mixtral", "AutoModelForCausalLM", (1, 2, 2)),  # experts over EP 2 (block_sparse_moe.experts.E.w1/w2/w3)
    ("qwen3_moe", "AutoModelForCausalLM", (2, 1, 2)),  # TP2 x EP2 (mlp.experts.E.gate_proj/up_proj/down_proj)
])
def test_round_trip_is_bit_exact_and_loads_in_transformers(tiny_models, tmp_path, name, auto, layout):
    import transformers

    tp, pp, ep = layout
    hf = os.path.join(tiny_models, "hf", name)
    mg, back = str(tmp_path / "mg"), str(tmp_path / "back")
    p = run_python([CONVERT, "--hf", hf, "--out", mg, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep)])
    assert p.returncode == 0, tail(p)
    # the command line forks its ranks after importing their modules once (rlhf.models.convert.rank_start_method)
    assert f"{tp * pp * ep} local rank(s), started by fork" in p.stdout + p.stderr, tail(p)
    manifest = json.load(open(os.path.join(mg, "rlhf_manifest.json")))
    assert (manifest["saved_at_tp"], manifest["saved_at_pp"], manifest["saved_at_ep"]) == layout
    assert manifest["model_type"] == name.split("-")[0]
    assert os.path.exists(os.path.join(mg, "tokenizer.json"))
    p = run_python([BACK, "--ckpt", mg, "--out", back])
    assert p.returncode == 0, tail(p)
    a, b = load_file(os.path.join(hf, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    model = getattr(transformers, auto).from_pretrained(back)
    assert type(model).__name__ == json.load(open(os.path.join(hf, "config.json")))["architectures"][0]
    assert transformers.AutoTokenizer.from_pretrained(back)("hello world").input_ids


def _compare(tiny_models, tmp_path, model: str, nproc: int, layout: list[str]):
    """Convert ``model`` at TP1 PP1, run compare_logits at ``layout`` on ``nproc`` ranks, check its last line
    (within 1e-4 of transformers); returns the process and the HF folder."""
    hf = os.path.join(tiny_models, "hf", model)
    mg = str(tmp_path / "mg")
    assert run_python([CONVERT, "--hf", hf, "--out", mg, "--tp", "1", "--pp", "1"]).returncode == 0
    p = run_torchrun(COMPARE, nproc, ["--hf", hf, "--ckpt", mg, *layout])
    assert p.returncode == 0, tail(p)
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("max_abs_logit_diff="), last
    assert float(last.split("=")[1]) <= 1e-4
    return p, hf


def test_compare_logits_tp2pp2_on_4_ranks(tiny_models, tmp_path):
    _compare(tiny_models, tmp_path, "llama", 4, ["--tp", "2", "--pp", "2"])


def test_compare_logits_cp2_on_2_ranks(tiny_models, tmp_path):
    """compare_logits --cp: each sequence split over 2 ranks (30 tokens: the split pads to 32)."""
    p, _ = _compare(tiny_models, tmp_path, "llama", 2, ["--cp", "2", "--seq_len", "30"])
    assert "cp=2" in p.stdout + p.stderr


def test_compare_logits_tp2_ep2_moe_on_4_ranks(tiny_models, tmp_path):
    """The MoE path of the tools: converted at TP1 (every expert on one rank), compared at TP2 x EP2."""
    _, hf = _compare(tiny_models, tmp_path, "mixtral", 4, ["--tp", "2", "--ep", "2"])
    _one_line_error(run_python([CONVERT, "--hf", hf, "--out", str(tmp_path / "x"), "--ep", "3"]),
                    "--expert_model_parallel_size 3 does not divide num_experts=4")


def _one_line_error(p, needle):
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], p.stderr[-2000:]


def test_bad_input_fails_fast_with_one_line(tiny_models, tmp_path):
    hf = os.path.join(tiny_models, "hf", "llama")  # 4 heads, 2 KV heads, vocab 259 -> padded 384
    out = str(tmp_path / "out")
    _one_line_error(run_python([CONVERT, "--hf", str(tmp_path / "nope"), "--out", out]), "not found")
    # (--tp 4 over 2 KV heads is valid: megatron replicates them; test_spec covers a TP that fits neither way)
    _one_line_error(run_python([CONVERT, "--hf", hf, "--out", out, "--pp", "3"]), "num_hidden_layers=4")
    _one_line_error(run_python([CONVERT, "--hf", hf, "--out", out, "--tp", "3"]), "num_attention_heads=4")
    _one_line_error(run_python([CONVERT, "--hf", hf, "--out", out, "--tp", "2",
                                "--make_vocab_size_divisible_by", "259"]), "vocab size 259")
    weird = tmp_path / "gpt2"
    shutil.copytree(hf, weird)
    cfg = json.load(open(weird / "config.json"))
    cfg["model_type"] = "gpt2"
    json.dump(cfg, open(weird / "config.json", "w"))
    _one_line_error(run_python([CONVERT, "--hf", str(weird), "--out", out]), "model_type='gpt2'")
    _one_line_error(run_python([BACK, "--ckpt", str(tmp_path / "nope"), "--out", out]), "not found")
    _one_line_error(run_python([CONVERT, "--hf", hf, "--out", out, "--cp", "0"]), "--context_parallel_size must be >= 1")
    assert not os.path.exists(out)  # nothing half-written


def test_unknown_checkpoint_key_is_named(tiny_models, tmp_path):
    from safetensors.torch import save_file

    src = os.path.join(tiny_models, "hf", "llama")
    bad = tmp_path / "extra"
    shutil.copytree(src, bad)
    sd = load_file(os.path.join(src, "model.safetensors"))
    sd["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(sd, str(bad / "model.safetensors"))
    _one_line_error(run_python([CONVERT, "--hf", str(bad), "--out", str(tmp_path / "o")]), "extra_proj")


def test_ranks_are_spawned_where_a_fork_could_inherit_a_thread():
    """rank_start_method: ``fork`` in a fresh one-thread process (the command line), ``spawn`` once the process
    has a second thread (a fork would copy a lock that thread might hold) or a process group."""
    code = ("import threading, time\n"
            "from rlhf.models.convert import rank_start_method\n"
            "a = rank_start_method()\n"
            "t = threading.Thread(target=time.sleep, args=(5,), daemon=True); t.start()\n"
            "print(a, rank_start_method())\n")
    p = run_python(["-c", code])
    assert p.returncode == 0, tail(p)
    assert p.stdout.split() == ["fork", "spawn"], tail(p)
