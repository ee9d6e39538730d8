"""The whole GRPO step side by side on one GPU: ours against Hugging Face TRL's ``GRPOTrainer``,
with and without its ``use_liger_kernel``, on the speed check's random-weight models (tests/gpu/gpu_speed.py).

* ``ours``: ``launch/ppo.py``, GRPO (``--advantage_estimator group_norm``, no KL), every role colocated on the one GPU
  (``--colocate_all``), bf16, the megatron generator (``--rollout_backend megatron``: the GPU machine has no vLLM;
  with vLLM the rollout phase would be vLLM's), one update per rollout batch;
* ``trl``, ``trl+liger``: ``bench/_trl_grpo.py`` (TRL 1.12.0, transformers' ``generate``, bf16, ``beta`` 0, one
  update per generation batch), ``use_liger_kernel`` off and on.

The same prompts (rlhf/demo/arith_task.py's questions, no chat template), prompts per step, samples per prompt, reply
length (``--generate_max_len`` / ``max_completion_length``), micro-batch, learning rate and reward
(``rlhf.rewards.verifiers.math_reward``). Per configuration: the median step seconds of steps 2.. (the first warms
up), generated tokens/s of the whole step, peak device memory, and ours' seconds per phase (its ``time/*``
metrics). With random weights the replies are noise: this compares speed, not learning (the held-out accuracy
needs a real model on the machine; see docs/gpus.md). Not yet run on a GPU; rehearsed on the CPU at a tiny shape.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import gpu_harness as harness
from gpu_harness import REPO

GRPO = dict(prompts=8, n=8, tokens=256, steps=4, micro=16)
GRPO_REHEARSAL = dict(prompts=2, n=4, tokens=16, steps=2, micro=4)
TRL_VENV_PY = os.path.join(REPO, "bench", ".venv-trl", "bin", "python")
"""TRL's interpreter on a CPU rehearsal (bench/setup_trl.sh); on the GPU machine TRL comes as carried wheels."""


def _data(c: harness.Check, s: dict) -> str:
    from rlhf.demo.arith_task import write

    return write(os.path.join(c.out, "grpo_data"), seed=1, n_train=s["prompts"] * s["steps"], n_heldout=8)["train"]


def _ours(c: harness.Check, name: str, model: str, train: str, s: dict) -> dict:
    from rlhf.observability.metrics import read_metrics_jsonl

    save = os.path.join(c.out, f"grpo_{name}_ours")
    batch = s["prompts"] * s["n"]
    rc = c.torchrun("launch/ppo.py", [
        "--pretrain", model, "--prompt_data", train, "--input_key", "prompt", "--label_key", "answer",
        "--reward_fn", "rlhf.rewards.verifiers:math_reward", "--advantage_estimator", "group_norm",
        "--init_kl_coef", "0", "--rollout_batch_size", str(s["prompts"]), "--n_samples_per_prompt", str(s["n"]),
        "--train_batch_size", str(batch), "--micro_train_batch_size", str(s["micro"]),
        "--micro_rollout_batch_size", str(batch), "--max_epochs", "1", "--generate_max_len", str(s["tokens"]),
        "--prompt_max_len", "64", "--temperature", "1.0", "--actor_learning_rate", "1e-6", "--lr_scheduler",
        "constant", "--lr_warmup_ratio", "0", "--max_samples", str(s["prompts"] * s["steps"]), "--num_episodes", "1",
        "--seed", "1", "--save_path", save, "--save_steps", "-1", "--colocate_all", "--rollout_backend", "megatron",
        "--bf16", "--stop_after_steps", str(s["steps"])], f"grpo_{name}_ours")
    path = os.path.join(save, "metrics.jsonl")
    steps = read_metrics_jsonl(path, "ppo") if rc == 0 and os.path.exists(path) else {}
    if not steps:
        return dict(rc=rc)
    rows = [steps[k] for k in sorted(steps)]
    timed = rows[1:] or rows
    tokens = [r.get("response_length", float("nan")) * batch for r in timed]
    secs = [r["time/step"] for r in timed]
    phases = {k[len("time/"):]: round(statistics.median(r[k] for r in timed), 3) for k in timed[0]
              if k.startswith("time/") and all(k in r for r in timed)}
    peak = max((v for r in rows for k, v in r.items() if k.startswith("mem/") and k.endswith("peak_gb")), default=None)
    return dict(rc=rc, step_s=statistics.median(secs), tokens_per_s=statistics.median(t / x for t, x in
                                                                                       zip(tokens, secs)),
                phase_s=phases, peak_gib=peak, steps=len(rows))


def _trl(c: harness.Check, name: str, model: str, train: str, s: dict, liger: bool) -> dict:
    label = f"grpo_{name}_trl{'_liger' if liger else ''}"
    out = os.path.join(c.out, label + ".json")
    py = TRL_VENV_PY if c.rehearse else sys.executable
    rc = c.launch([py, os.path.join(REPO, "bench", "_trl_grpo.py"), "--model", model, "--train", train,
                   "--steps", str(s["steps"]), "--prompts_per_step", str(s["prompts"]), "--generations", str(s["n"]),
                   "--max_new_tokens", str(s["tokens"]), "--micro", str(s["micro"]), "--lr", "1e-6", "--seed", "1",
                   "--bf16", "--plain_prompts", "--device", "cpu" if c.rehearse else "cuda",
                   *(["--liger"] if liger else []), "--threads", "1" if c.rehearse else "8", "--out", out], label)
    if rc != 0 or not os.path.exists(out):
        return dict(rc=rc)
    r = json.load(open(out))
    timed = list(zip(r["step_seconds"], r["logs"]))[1:] or list(zip(r["step_seconds"], r["logs"]))
    tokens = [lg.get("completions/mean_length", float("nan")) * r["samples_per_step"] for _, lg in timed]
    secs = [x for x, _ in timed]
    return dict(rc=rc, step_s=statistics.median(secs), tokens_per_s=statistics.median(t / x for t, x in
                                                                                       zip(tokens, secs)),
                peak_gib=r.get("peak_gib"), steps=len(r["step_seconds"]))


def check_grpo(c: harness.Check, shape_name: str) -> None:
    """Ours, TRL and TRL + Liger at ``shape_name``: one line with each one's step seconds, generated tokens/s and
    peak memory, ours' phases, and the ratios; a PASS when all three ran (no goal is set for the whole step)."""
    import gpu_speed

    name = gpu_speed.SHORT[shape_name]
    s = GRPO_REHEARSAL if c.rehearse else GRPO
    model = gpu_speed._prepare(c, name, shape_name, gpu_speed.REHEARSAL if c.rehearse else gpu_speed.SHAPE)[0]
    train = _data(c, s)
    results: dict[str, dict] = {}
    for v in ("ours", "trl", "trl+liger"):
        if c.rehearse and v == "trl+liger":
            continue  # liger-kernel's Triton kernels need a GPU
        try:
            results[v] = _ours(c, name, model, train, s) if v == "ours" else \
                _trl(c, name, model, train, s, liger=v == "trl+liger")
        except harness.OutOfTime as e:
            results[v] = dict(rc=None, why=str(e))
        c.report.figures["checks"].setdefault(c.current, {}).update(results)
        c.report.write()
    tps = {v: r.get("tokens_per_s") for v, r in results.items()}
    ratios = gpu_speed.ratios_to_ours(tps)
    text = "; ".join(f"{v} {r['step_s']:.2f} s a step, {r['tokens_per_s']:.0f} generated tok/s, peak "
                     f"{r['peak_gib'] if r.get('peak_gib') is not None else float('nan'):.1f} GiB"
                     if r.get("tokens_per_s") else f"{v} not measured (rc={r.get('rc')})" for v, r in results.items())
    phases = results.get("ours", {}).get("phase_s")
    c.report.add(f"grpo_{name}", all(t for t in tps.values()) and len(tps) >= 2,
                 f"{shape_name} GRPO, {s['prompts']} prompts x {s['n']} replies of {s['tokens']} tokens a step: "
                 f"{text}; "
                 + ", ".join(f"{k} {x:.3f}" for k, x in ratios.items()) + f"; ours' phases (s) {json.dumps(phases)}",
                 dict(results=results, ratios=ratios, settings=s), c.log(f"grpo_{name}_ours"))
