"""The GPU check's part ``speed`` (tests/gpu/gpu_check.py): one SFT step measured side by side, on the same GPU
and the same texts, through

* ``ours``: launch/sft.py, bf16, packed 8 rows of 2048 tokens to a micro-batch, with the fused kernels
  (``--use_liger_kernel``, rlhf/models/fused.py);
* ``hf+liger``: transformers' Llama after liger-kernel's ``apply_liger_kernel_to_llama()``
  (tests/gpu/gpu_hf_baseline.py: fp32 master weights, bf16 autocast as HF Trainer's ``bf16=True``, sdpa
  attention, fused AdamW);
* ``hf``: the same without Liger;
* ``ours_unfused``: launch/sft.py with ``--no-use_liger_kernel`` (what ran before the fused path);

at Llama-3.2-1B's shape (16 x 2048, vocabulary 128256) and SmolLM2-135M's (30 x 576, 49152), random weights,
16 rows of 2048 tokens a step, 8 micro-steps of 8 rows; the median tokens/s of steps 3-8, its MFU against the card's
bf16 peak, and the step's peak device memory (ours: ``mem/peak_gb``; HF: ``torch.cuda.max_memory_allocated``).
Rows for HF are the same texts tokenized the same way (prompt and text, cut at 2048 tokens); HF's loss covers every
token, ours the response (all but the few prompt tokens). A check PASSes when ours reaches its goal against
hf+liger (``GOALS``: tokens/s ratio, at no more peak memory); its line gives every figure either way. Ours-fused's
steps 9-10 are profiled (rlhf/observability/profiling.py) into the results folder, so a missed goal comes with its profile.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu_harness as harness  # noqa: E402
from gpu_hf_baseline import SHAPES  # noqa: E402

GOALS = {"llama32_1b": 1.15, "smollm2_135m": 1.0}
"""ours / (transformers + Liger) tokens/s the issue sets (docs/gpus.md), at no more peak memory."""
SHAPE = dict(max_len=2048, micro=8, batch=16, steps=8)
REHEARSAL = dict(max_len=128, micro=2, batch=4, steps=3)
PROFILE = (9, 10)
"""Ours-fused runs two steps past the timed ones, profiled (RLHF_PROFILE_STEPS), so the timing is not disturbed."""
VARIANTS = ("ours", "hf+liger", "hf", "ours_unfused")
SHORT = {"llama32_1b": "1b", "smollm2_135m": "135m"}
"""Each shape's name in the check names and file names."""


def _ours(c: harness.Check, name: str, model: str, data: str, shape: dict, fused: bool, n: int,
          env: dict | None = None, label: str | None = None) -> dict:
    label = label or f"speed_{name}_{'ours' if fused else 'ours_unfused'}"
    save = os.path.join(c.out, label)
    shutil.rmtree(save, ignore_errors=True)
    profile = fused and not c.rehearse and env is None
    steps = shape["steps"] + (PROFILE[1] - shape["steps"] if profile else 0)
    env = dict(env or {})
    if profile:
        env.update(RLHF_PROFILE_STEPS=f"{PROFILE[0]}-{PROFILE[1]}",
                   RLHF_PROFILE_DIR=os.path.join(c.report.results or c.out, f"profile_{name}"))
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        rc = c.torchrun("launch/sft.py", [
            "--pretrain", model, "--dataset", data, "--input_key", "input", "--output_key", "output",
            "--save_path", save, "--learning_rate", "1e-5", "--train_batch_size", str(shape["batch"]),
            "--micro_train_batch_size", str(shape["micro"]), "--max_len", str(shape["max_len"]), "--packing_samples",
            "--bf16", "--max_epochs", "1", "--max_samples", str(n), "--stop_after_steps", str(steps),
            "--lr_warmup_ratio", "0", "--seed", "1", "--logging_steps", "1",
            "--use_liger_kernel" if fused else "--no-use_liger_kernel"], label)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    from rlhf.observability.metrics import read_metrics_jsonl

    path = os.path.join(save, "metrics.jsonl")
    per_step = read_metrics_jsonl(path, "sft") if os.path.exists(path) else {}
    timed = {s: m for s, m in per_step.items() if s <= shape["steps"]}
    peaks = [m["mem/peak_gb"] for m in timed.values() if "mem/peak_gb" in m]  # CUDA only
    peak = max(peaks) if peaks else float("nan")
    return dict(rc=rc, steps=timed, peak_gib=peak)


def _hf(c: harness.Check, name: str, shape_name: str, rows_file: str, shape: dict, liger: bool,
        label: str | None = None) -> dict:
    label = label or f"speed_{name}_hf{'_liger' if liger else ''}"
    out = os.path.join(c.out, f"{label}.json")
    if os.path.exists(out):
        os.remove(out)
    rc = c.launch([sys.executable, os.path.join(HERE, "gpu_hf_baseline.py"), "--shape", shape_name, "--liger",
                   str(int(liger)), "--steps", str(shape["steps"]), "--micro_rows", str(shape["micro"]),
                   "--batch_rows", str(shape["batch"]), "--seq_len", str(shape["max_len"]), "--rows_file", rows_file,
                   "--device", "cpu" if c.rehearse else "cuda", "--json", out], label)
    if rc != 0 or not os.path.exists(out):
        return dict(rc=rc)
    with open(out) as f:
        r = json.load(f)
    steps = {i + 1: {"tokens_per_s": t} for i, t in enumerate(r["tokens_per_s"])}
    return dict(rc=rc, steps=steps, peak_gib=r.get("peak_mem_gib", r.get("peak_rss_gib")))


def check_speed(c: harness.Check, shape_name: str) -> None:
    name = SHORT[shape_name]
    shape = REHEARSAL if c.rehearse else SHAPE
    model, data, rows_file, n, flops, dev, peak_tflops = _prepare(c, name, shape_name, shape)
    skip = 2 if shape["steps"] > 3 else 0
    results: dict[str, dict] = {}
    figures: dict = dict(device=dev, peak_tflops=peak_tflops, flops_per_token=flops, shape=shape)
    for v in VARIANTS:
        if c.rehearse and v == "hf+liger":
            results[v] = dict(rc=None, why="liger-kernel needs a GPU (rehearsal)")
            continue
        try:
            r = _ours(c, name, model, data, shape, fused=v == "ours", n=n) if v.startswith("ours") else \
                _hf(c, name, "tiny" if c.rehearse else shape_name, rows_file, shape, liger=v == "hf+liger")
        except harness.OutOfTime as e:
            results[v] = dict(rc=None, why=str(e))
            continue
        r.update(harness.mfu_of(r.pop("steps", {}), flops, peak_tflops, skip=skip))
        results[v] = r
        figures[v] = r
        c.report.figures["checks"].setdefault(c.current, {}).update(figures)
        c.report.write()
    _verdict(c, name, shape_name, shape, results, figures)


def _prepare(c: harness.Check, name: str, shape_name: str, shape: dict):
    """The model (random weights at the shape), our data and HF's rows for one shape; made once per work folder."""
    import torch
    import transformers

    from rlhf.models.tiny import make_tiny_hf

    dims = dict(SHAPES["tiny" if c.rehearse else shape_name])
    tok_dir = c.assets()["tokenizer"]
    n = shape["batch"] * (PROFILE[1] + 1)  # more rows than the longest run takes: no epoch end, no checkpoint
    os.makedirs(c.out, exist_ok=True)
    key = f"{shape['max_len']}x{n}"  # the texts are the same for every shape and variant: made once
    data, rows_file = os.path.join(c.out, f"speed_{key}.jsonl"), os.path.join(c.out, f"speed_{key}_rows.json")
    if not os.path.exists(rows_file):
        tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
        prompt = "between a and z ="
        texts = harness.long_texts(tok, n, shape["max_len"] + 16)
        with open(data, "w") as f:
            for t in texts:
                f.write(json.dumps({"input": prompt, "output": t}) + "\n")
        with open(rows_file + ".tmp", "w") as f:
            json.dump([tok(prompt + " " + t)["input_ids"][:shape["max_len"]] for t in texts], f)
        os.replace(rows_file + ".tmp", rows_file)
    model = os.path.join(c.out, f"speed_model_{name}")
    if not os.path.exists(os.path.join(model, "config.json")):
        make_tiny_hf(model, "llama", seed=0, tokenizer_dir=tok_dir, dtype=torch.bfloat16, max_position_embeddings=4096,
                     **dims)
    cfg = transformers.AutoConfig.from_pretrained(model).to_dict()
    flops = harness.train_flops_per_token(cfg, (shape["max_len"] + 1) / 2)
    dev = torch.cuda.get_device_properties(0).name if torch.cuda.is_available() else "cpu"
    peak_tflops = harness.bf16_peak_tflops(dev)
    return model, data, rows_file, n, flops, dev, peak_tflops


def _verdict(c: harness.Check, name: str, shape_name: str, shape: dict, results: dict, figures: dict) -> None:
    ours, ref = results["ours"], results["hf+liger"]
    parts = []
    for v in VARIANTS:
        r = results[v]
        if r.get("tokens_per_s"):
            parts.append(f"{v} {r['tokens_per_s']:.0f} tok/s MFU {r['mfu']:.3f} peak {r['peak_gib']:.1f} GiB")
        else:
            parts.append(f"{v} not measured (rc={r.get('rc')}{', ' + r['why'] if r.get('why') else ''})")
    ratios = {f"ours/{v}": ours["tokens_per_s"] / results[v]["tokens_per_s"] for v in VARIANTS[1:]
              if ours.get("tokens_per_s") and results[v].get("tokens_per_s")}
    figures["ratios"] = ratios
    goal = GOALS[shape_name]
    ok = bool(ours.get("tokens_per_s")) and (c.rehearse or (
        "ours/hf+liger" in ratios and ratios["ours/hf+liger"] >= goal and ours["peak_gib"] <= ref["peak_gib"]))
    c.report.add(f"speed_{name}", ok, f"{shape_name} {shape['batch']} x {shape['max_len']} tokens a step: "
                 + "; ".join(parts) + "; " + ", ".join(f"{k} {x:.3f}" for k, x in ratios.items())
                 + f" (goal ours/hf+liger >= {goal} at no more peak memory)", figures,
                 c.log(f"speed_{name}_ours"))


VARIANT_RUNS = (
    # (label, shape, kind, RLHF_FUSED_PARTS or None, rows per micro-batch)
    ("1b_ours_no_norm", "llama32_1b", "ours", "swiglu,rope,head", 8),  # the default, beside the next line
    ("1b_ours_wgrad", "llama32_1b", "ours", "swiglu,rope,head,wgrad", 8),  # weight gradients into main_grad
    ("135m_ours_no_norm", "smollm2_135m", "ours", "swiglu,rope,head", 8),
    ("135m_ours_wgrad", "smollm2_135m", "ours", "swiglu,rope,head,wgrad", 8),
    ("135m_ours_swiglu_rope", "smollm2_135m", "ours", "swiglu,rope", 8),
    ("135m_ours_micro16", "smollm2_135m", "ours", None, 16),
    ("135m_hf_liger_micro16", "smollm2_135m", "hf+liger", None, 16),
    ("135m_hf_micro16", "smollm2_135m", "hf", None, 16),
    ("135m_ours_swiglu_rope_micro16", "smollm2_135m", "ours", "swiglu,rope", 16),
)
"""Which fused kernel pays at which shape (``RLHF_FUSED_PARTS``), and 16 rows a micro-batch against 8; most telling
first (the weight gradients into main_grad, beside the default at both shapes), as a deadline cuts the last."""


def check_variants(c: harness.Check) -> None:
    """Each of ``VARIANT_RUNS``: its median tokens/s and peak memory, one line for all (PASS when all ran)."""
    results: dict[str, dict] = {}
    base = REHEARSAL if c.rehearse else SHAPE
    for label, shape_name, kind, parts, micro in VARIANT_RUNS:
        if c.rehearse and kind == "hf+liger":
            continue
        name = SHORT[shape_name]
        shape = dict(base, micro=min(micro, base["batch"]))
        try:
            model, data, rows_file, n, flops, dev, peak_tflops = _prepare(c, name, shape_name, shape)
            if kind == "ours":
                env = {"RLHF_FUSED_PARTS": parts} if parts is not None else {}
                r = _ours(c, name, model, data, shape, fused=True, n=n, env=env, label=f"variant_{label}")
            else:
                r = _hf(c, name, "tiny" if c.rehearse else shape_name, rows_file, shape, liger=kind == "hf+liger",
                        label=f"variant_{label}")
        except harness.OutOfTime as e:
            results[label] = dict(rc=None, why=str(e))
            continue
        r.update(harness.mfu_of(r.pop("steps", {}), flops, peak_tflops, skip=2 if shape["steps"] > 3 else 0))
        results[label] = r
        c.report.figures["checks"].setdefault(c.current, {}).update(results)
        c.report.write()
    text = "; ".join(f"{k} {r['tokens_per_s']:.0f} tok/s peak {r['peak_gib']:.1f} GiB" if r.get("tokens_per_s")
                     else f"{k} not measured (rc={r.get('rc')})" for k, r in results.items())
    c.report.add("speed_variants", all(r.get("tokens_per_s") for r in results.values()), text, results)


def launch_each(c: harness.Check, runs: list[tuple[str, list[str], str]]) -> dict[str, dict]:
    """Each ``(variant, argv, log label)`` launched in turn, its ``--json`` file (the argv's last item) read back:
    its figures, or its exit status, or why it did not start; the figures are written after each launch."""
    results: dict[str, dict] = {}
    for v, argv, label in runs:
        out = argv[-1]
        try:
            rc = c.launch(argv, label)
        except harness.OutOfTime as e:
            results[v] = dict(rc=None, why=str(e))
            continue
        results[v] = json.load(open(out)) if rc == 0 and os.path.exists(out) else dict(rc=rc)
        c.report.figures["checks"].setdefault(c.current, {}).update(results)
        c.report.write()
    return results


def ratios_to_ours(tps: dict[str, float | None]) -> dict[str, float]:
    """``ours/<variant>`` for every variant measured beside ours."""
    return {f"ours/{v}": tps["ours"] / t for v, t in tps.items() if v != "ours" and t and tps.get("ours")}


def check_rl(c: harness.Check, shape_name: str) -> None:
    """The RL update side by side (tests/gpu/gpu_rl_update.py) on the speed check's model at ``shape_name``: ours fused,
    transformers + Liger's fused linear GRPO loss, transformers; tokens/s, peak memory, ratios. A PASS when all
    three ran (no goal is set for the update)."""
    name = SHORT[shape_name]
    shape = REHEARSAL if c.rehearse else SHAPE
    model = _prepare(c, name, shape_name, shape)[0]
    script = os.path.join(HERE, "gpu_rl_update.py")
    common = ["--model", model, "--steps", str(shape["steps"]), "--micro_rows", str(shape["micro"]), "--batch_rows",
              str(shape["batch"]), "--seq_len", str(shape["max_len"]), "--device", "cpu" if c.rehearse else "cuda"]
    from rlhf.distributed.env import free_port

    runs = [(v, [sys.executable, *cmd, *common, "--json", os.path.join(c.out, f"rl_{name}_{v}.json")], f"rl_{name}_{v}")
            for v, cmd in (("ours", ["-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                                     str(free_port()), script, "--impl", "ours", "--fused", "1"]),
                           ("hf+liger", [script, "--impl", "hf", "--liger", "1"]), ("hf", [script, "--impl", "hf"]))
            if not (c.rehearse and v == "hf+liger")]
    results = launch_each(c, runs)
    tps = {v: r.get("median_tokens_per_s") for v, r in results.items()}
    ratios = ratios_to_ours(tps)
    text = "; ".join(f"{v} {r['median_tokens_per_s']:.0f} tok/s peak {r['peak_gib']:.1f} GiB"
                     if r.get("median_tokens_per_s") else f"{v} not measured (rc={r.get('rc')})"
                     for v, r in results.items())
    c.report.add(f"rl_{name}", all(t for t in tps.values()), f"{shape_name} actor update, {shape['batch']} x "
                 f"{shape['max_len']} tokens a step: {text}; " + ", ".join(f"{k} {x:.3f}" for k, x in ratios.items()),
                 dict(results=results, ratios=ratios), c.log(f"rl_{name}_ours"))


DECODE = dict(prompts=4, n_samples_per_prompt=8, prompt_len=128, tokens=256, rounds=2)
DECODE_REHEARSAL = dict(prompts=2, n_samples_per_prompt=2, prompt_len=16, tokens=16, rounds=1)


def check_decode(c: harness.Check, shape_name: str) -> None:
    """The megatron generator's decode side by side (tests/gpu/gpu_decode.py) on the speed check's model at
    ``shape_name``: ours (decode cache) against transformers' generate with its dynamic and its static KV cache; new
    tokens/s, peak memory, ratios. A PASS when all three ran (no goal is set for decode)."""
    name = SHORT[shape_name]
    model = _prepare(c, name, shape_name, REHEARSAL if c.rehearse else SHAPE)[0]
    script = os.path.join(HERE, "gpu_decode.py")
    common = [x for k, v in (DECODE_REHEARSAL if c.rehearse else DECODE).items() for x in (f"--{k}", str(v))]
    common += ["--model", model, "--device", "cpu" if c.rehearse else "cuda"]
    from rlhf.distributed.env import free_port

    runs = [(v, [sys.executable, *cmd, *common, "--json", os.path.join(c.out, f"decode_{name}_{v}.json")],
             f"decode_{name}_{v}")
            for v, cmd in (("ours", ["-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                                     str(free_port()), script, "--impl", "ours"]),
                           ("hf", [script, "--impl", "hf"]), ("hf_static", [script, "--impl", "hf_static"]))]
    results = launch_each(c, runs)
    tps = {v: r.get("tokens_per_s") for v, r in results.items()}
    ratios = ratios_to_ours(tps)
    text = "; ".join(f"{v} {r['tokens_per_s']:.0f} new tok/s peak {r['peak_gib']:.1f} GiB" if r.get("tokens_per_s")
                     else f"{v} not measured (rc={r.get('rc')})" for v, r in results.items())
    c.report.add(f"decode_{name}", all(t for t in tps.values()), f"{shape_name} decode: {text}; "
                 + ", ".join(f"{k} {x:.3f}" for k, x in ratios.items()), dict(results=results, ratios=ratios),
                 c.log(f"decode_{name}_ours"))
