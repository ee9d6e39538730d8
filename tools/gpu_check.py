"""The single-GPU check: one machine, one GPU, one rank. Run it through ``tools/gpu_check.sh`` (which installs the
wheels the machine lacks); see that script's header. Prints an environment header, one ``PASS <check> ...`` or
``FAIL <check> ...`` line per check, and ends with ``N passed, M failed`` (exit 0 only if M is 0). Without a
usable GPU it stops at its first GPU-only step with one ``STOP:`` line and exit status 2.

Checks, each against an independent reference or an uninterrupted run:
* kernels at real shapes, fp32 and bf16, forward and backward, with times against plain torch: vocab-parallel
  log-probs (N=4096, V=32000) and the fused linear log-probs, against fp64 ``log_softmax``; varlen attention
  (head size 64 and 128, GQA, sequences up to 1k) against fp64 per-sequence causal attention;
* SFT, RM and PPO (vLLM if importable, else the megatron generator, said in the line) through their entry points
  in fp32 and bf16, PPO with --colocate_all --ref_reward_offload --adam_offload: finite losses, phase times, the
  device memory each offload phase freed, and PPO's rollout_logprob_drift;
* a resume on CUDA: SFT stopped at step 2 and resumed equals an uninterrupted run bit for bit;
* one timed SFT run at SmolLM2-135M's size (bf16, packed): tokens/s and MFU against the GPU's bf16 peak.

    bash tools/gpu_check.sh [--out DIR] [--only kernels,sft,rm,ppo,resume,mfu]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
RESULTS: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def header() -> None:
    import torch

    def version(mod: str) -> str:
        try:
            import importlib.metadata as md

            return md.version(mod)
        except Exception:
            return "absent"

    print(f"# gpu_check {time.strftime('%Y-%m-%d %H:%M:%S')} python {platform.python_version()}")
    print(f"# torch {torch.__version__} (CUDA build {torch.version.cuda}); setup.py pins torch 2.13.0")
    for mod in ("triton", "transformers", "megatron-core", "vllm", "transformer-engine", "flash-attn"):
        print(f"# {mod} {version(mod)}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception:
            driver = "unknown"
        print(f"# GPU {props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}, driver "
              f"{driver}")
    sys.stdout.flush()


def require_gpu() -> None:
    """The first GPU-only step: a clear stop, before any heavy work, where there is no usable GPU."""
    import torch

    if not torch.cuda.is_available():
        print("STOP: no CUDA device (torch.cuda.is_available() is False): the remaining checks need a GPU. "
              "On a GPU machine whose driver torch cannot use, see the device error of the trainer "
              "(RLHF_DEVICE=cuda python -c 'from rlhf.distributed.device import select_device; "
              "select_device(0)').", flush=True)
        sys.exit(2)


def timed(fn, reps: int = 5) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


# -------------------------------------------------------------------------------------------------- kernels
def check_logprobs() -> None:
    import torch

    import kernels

    N, V, H, T = 4096, 32000, 1024, 0.8
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = (torch.randn(N, V, device="cuda", generator=g) * 3).to(dtype).requires_grad_(True)
        targets = torch.randint(0, V, (N,), device="cuda", generator=g)
        lp = kernels.token_logprobs(logits, targets, temperature=T)
        ref = torch.log_softmax(logits.detach().double() / T, -1).gather(-1, targets[:, None])[:, 0]
        err = (lp.double() - ref).abs().max().item()
        lp.sum().backward()
        ref_grad = torch.autograd.grad(torch.log_softmax(logits.double() / T, -1).gather(-1, targets[:, None]).sum(),
                                       logits)[0]
        gerr = (logits.grad.double() - ref_grad.double()).abs().max().item()
        t_k = timed(lambda: kernels.token_logprobs(logits.detach(), targets, temperature=T))
        t_t = timed(lambda: torch.log_softmax(logits.detach().float() / T, -1).gather(-1, targets[:, None]))
        report(f"kernels.token_logprobs[{str(dtype)[6:]}]", err < tol and gerr < tol,
               f"N={N} V={V}: max|lp-ref|={err:.1e} max|grad-ref|={gerr:.1e}; {t_k * 1e3:.2f} ms vs torch "
               f"log_softmax {t_t * 1e3:.2f} ms")
        hidden = (torch.randn(N, H, device="cuda", generator=g)).to(dtype).requires_grad_(True)
        weight = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5).to(dtype).requires_grad_(True)
        flp = kernels.fused_linear_logprobs(hidden, weight, targets, temperature=T)
        fref = torch.log_softmax((hidden.detach().double() @ weight.detach().double().T) / T, -1)
        ferr = (flp.double() - fref.gather(-1, targets[:, None])[:, 0]).abs().max().item()
        flp.sum().backward()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        kernels.fused_linear_logprobs(hidden.detach(), weight.detach(), targets, temperature=T)
        extra = (torch.cuda.max_memory_allocated() - base) / 2**20
        ok = ferr < tol * 5 and torch.isfinite(hidden.grad).all().item() and torch.isfinite(weight.grad).all().item()
        report(f"kernels.fused_linear_logprobs[{str(dtype)[6:]}]", bool(ok),
               f"N={N} H={H} V={V}: max|lp-ref|={ferr:.1e}, forward extra memory {extra:.0f} MiB (full logits "
               f"{N * V * 4 / 2**20:.0f} MiB in fp32)")


def _attention_reference(q, k, v, cu, scale):
    import torch

    out = torch.empty_like(q, dtype=torch.float64)
    rep = q.shape[1] // k.shape[1]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = q[s:e].double(), k[s:e].double().repeat_interleave(rep, 1), v[s:e].double().repeat_interleave(
            rep, 1)
        att = torch.einsum("thd,shd->hts", qs, ks) * scale
        mask = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        out[s:e] = torch.einsum("hts,shd->thd", att, vs)
    return out


def check_varlen_attention() -> None:
    import torch

    import kernels

    lengths = [1024, 517, 63, 1, 300]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    T = int(cu[-1])
    for d in (64, 128):
        for dtype, tol in ((torch.float32, 2e-4), (torch.bfloat16, 3e-2)):
            g = torch.Generator(device="cuda").manual_seed(d)
            q = torch.randn(T, 8, d, device="cuda", generator=g).to(dtype).requires_grad_(True)
            k = torch.randn(T, 2, d, device="cuda", generator=g).to(dtype).requires_grad_(True)  # GQA 4:1
            v = torch.randn(T, 2, d, device="cuda", generator=g).to(dtype).requires_grad_(True)
            scale = d ** -0.5
            out = kernels.varlen_attention(q, k, v, cu, max(lengths), softmax_scale=scale)
            ref = _attention_reference(q.detach(), k.detach(), v.detach(), cu, scale)
            err = (out.double() - ref).abs().max().item()
            out.float().pow(2).sum().backward()
            qd, kd, vd = (x.detach().double().requires_grad_(True) for x in (q, k, v))
            _attention_reference(qd, kd, vd, cu, scale).pow(2).sum().backward()
            gerr = max((a.grad.double() - b.grad).abs().max().item() / max(b.grad.abs().max().item(), 1e-6)
                       for a, b in ((q, qd), (k, kd), (v, vd)))
            t_k = timed(lambda: kernels.varlen_attention(q.detach(), k.detach(), v.detach(), cu, max(lengths),
                                                         softmax_scale=scale))
            report(f"kernels.varlen_attention[d{d},{str(dtype)[6:]}]", err < tol and gerr < tol * 10,
                   f"T={T} seqs={lengths} GQA 8:2: max|out-ref|={err:.1e}, max relative grad error {gerr:.1e}; "
                   f"{t_k * 1e3:.2f} ms")


# ------------------------------------------------------------------------------------------------- trainers
STEP_TIMEOUT_S = int(os.environ.get("RLHF_GPU_STEP_TIMEOUT_S", "110"))
"""Each launch's own limit: a hung step ends as that check's FAIL (rc 124) with its log, and the others still run
inside the machine's one 10-minute call."""


START = time.monotonic()
DEADLINE_S = float(os.environ.get("RLHF_GPU_DEADLINE_S", "560"))
"""The whole check's budget (the machine's call allows 600 s): a launch that would start with under 20 s left is
skipped (rc 125, reported as not run) so the summary line is always printed."""


def run(cmd: list[str], log_path: str, timeout: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="8", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    left = DEADLINE_S - (time.monotonic() - START)
    if left < 20:
        with open(log_path, "w") as f:
            f.write(f"skipped: {left:.0f} s left of the check's {DEADLINE_S:.0f} s\n")
        return subprocess.CompletedProcess(cmd, 125, "", "skipped: out of time")
    timeout = int(min(timeout or STEP_TIMEOUT_S, left))
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # the ranks die with their launcher (PDEATHSIG)
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        p = subprocess.CompletedProcess(cmd, 124, out, err + f"\nTIMEOUT after {timeout} s")
    with open(log_path, "w") as f:
        f.write(p.stdout + "\n--- stderr ---\n" + p.stderr)
    return p


def torchrun(script: str, args: list[str], log_path: str) -> subprocess.CompletedProcess:
    from rlhf.distributed.env import free_port

    return run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
                str(free_port()), os.path.join(REPO, script), *args], log_path)


def last_metrics(save: str, prefix: str) -> dict[str, float]:
    from rlhf.metrics import read_metrics_jsonl

    steps = read_metrics_jsonl(os.path.join(save, "metrics.jsonl"), prefix)
    return steps[max(steps)] if steps else {}


def make_assets(out: str) -> dict[str, str]:
    """A small Llama (head size 64: the real kernels run) and the bundled task's data."""
    from rlhf.demo.sort_task import corpus, make_all
    from rlhf.models.tiny import make_tiny_hf, make_tokenizer

    tok = os.path.join(out, "tokenizer")
    make_tokenizer(tok, vocab_size=384, seed=0, texts=corpus())
    dims = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, tokenizer_dir=tok)
    paths = make_all(os.path.join(out, "data"), seed=0, n_sft=512, n_pref=512, n_train_prompts=64,
                     n_eval_prompts=8, n_eval_pref=32)
    paths["actor"] = make_tiny_hf(os.path.join(out, "actor"), "llama", seed=0, **dims)
    paths["rm"] = make_tiny_hf(os.path.join(out, "rm"), "llama", seq_cls=True, seed=1, **dims)
    return paths


def check_trainers(out: str, assets: dict[str, str], precisions: list[str], only: set[str]) -> None:
    common = ["--train_batch_size", "32", "--micro_train_batch_size", "8", "--max_len", "96", "--seed", "1",
              "--lr_warmup_ratio", "0", "--max_epochs", "1", "--max_samples", "128"]
    for prec in precisions:
        flag = ["--bf16"] if prec == "bf16" else []
        if "sft" in only:
            save = os.path.join(out, f"sft_{prec}")
            p = torchrun("launch/sft.py", ["--pretrain", assets["actor"], "--dataset", assets["sft"], "--input_key",
                                           "input", "--output_key", "output", "--save_path", save,
                                           "--learning_rate", "1e-4", *common, *flag], save + ".log")
            m = last_metrics(save, "sft") if p.returncode == 0 else {}
            report(f"sft[{prec}]", p.returncode == 0 and math.isfinite(m.get("loss", math.nan)),
                   f"rc={p.returncode} loss={m.get('loss')} tokens/s={m.get('tokens_per_s')} (log {save}.log)")
            save = os.path.join(out, f"sft_{prec}_packed")  # packed (THD) attention through megatron
            p = torchrun("launch/sft.py", ["--pretrain", assets["actor"], "--dataset", assets["sft"], "--input_key",
                                           "input", "--output_key", "output", "--save_path", save,
                                           "--learning_rate", "1e-4", "--packing_samples", *common, *flag],
                         save + ".log")
            m = last_metrics(save, "sft") if p.returncode == 0 else {}
            report(f"sft[{prec},packed]", p.returncode == 0 and math.isfinite(m.get("loss", math.nan)),
                   f"rc={p.returncode} loss={m.get('loss')} tokens/s={m.get('tokens_per_s')} (log {save}.log)")
        if "rm" in only:
            save = os.path.join(out, f"rm_{prec}")
            p = torchrun("launch/rm.py", ["--pretrain", assets["actor"], "--dataset", assets["pref"],
                                          "--save_path", save, "--learning_rate", "1e-4", *common, *flag],
                         save + ".log")
            m = last_metrics(save, "rm") if p.returncode == 0 else {}
            report(f"rm[{prec}]", p.returncode == 0 and math.isfinite(m.get("loss", math.nan)),
                   f"rc={p.returncode} loss={m.get('loss')} acc={m.get('acc')} (log {save}.log)")
        if "ppo" in only:
            check_ppo(out, assets, prec, flag)


def check_ppo(out: str, assets: dict[str, str], prec: str, flag: list[str]) -> None:
    import importlib.util

    generator = "vllm" if importlib.util.find_spec("vllm") else "megatron"
    save = os.path.join(out, f"ppo_{prec}")
    p = torchrun("launch/ppo.py", ["--pretrain", assets["actor"], "--reward_pretrain", assets["rm"],
                                   "--prompt_data", assets["prompts"], "--input_key", "prompt", "--save_path", save,
                                   "--rollout_backend", generator, "--vllm_tensor_parallel_size", "1",
                                   "--rollout_batch_size", "16", "--n_samples_per_prompt", "4",
                                   "--train_batch_size", "64", "--micro_train_batch_size", "16",
                                   "--micro_rollout_batch_size", "32", "--generate_max_len", "16",
                                   "--prompt_max_len", "32", "--max_samples", "48", "--colocate_all",
                                   "--ref_reward_offload", "--adam_offload", "--vllm_kv_cache_mb", "512",
                                   "--lr_warmup_ratio", "0", *flag], save + ".log")
    m = last_metrics(save, "ppo") if p.returncode == 0 else {}
    phases = {k[5:]: round(v, 3) for k, v in m.items() if k.startswith("time/")}
    freed = {k[8:-17]: round(v, 3) for k, v in m.items() if k.endswith("_device_freed_gb")}
    drift = m.get("rollout_logprob_drift_max", math.nan)
    ok = p.returncode == 0 and math.isfinite(m.get("reward", math.nan)) and bool(freed) and \
        drift <= (5e-2 if prec == "bf16" else 1e-3)
    report(f"ppo[{prec},{generator}]", ok, f"rc={p.returncode} reward={m.get('reward')} drift_max={drift:.1e} "
           f"phase seconds {json.dumps(phases)} device GB freed per offload phase {json.dumps(freed)} "
           f"(log {save}.log)")


BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}
"""Dense bf16 tensor-core peaks (NVIDIA's data sheets, SXM parts, without sparsity), by product name."""
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, tie_word_embeddings=True)


def check_mfu(out: str, assets: dict[str, str]) -> None:
    """One timed SFT run at SmolLM2-135M's size (random weights, the assets' tokenizer, bf16, packed, 2048-token
    rows): tokens/s of the last steps and the model FLOPs utilisation 6 * N * tokens/s / the GPU's bf16 peak
    (attention's FLOPs left out, so it is a lower bound)."""
    import torch

    from rlhf.models.tiny import make_tiny_hf

    model = make_tiny_hf(os.path.join(out, "assets", "smollm2_size"), "llama", seed=0,
                         tokenizer_dir=assets["actor"], dtype=torch.bfloat16, max_position_embeddings=4096,
                         **SMOLLM2_135M)
    n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(
        model).parameters())
    save = os.path.join(out, "mfu_bf16")
    p = torchrun("launch/sft.py", ["--pretrain", model, "--dataset", assets["sft"], "--input_key", "input",
                                   "--output_key", "output", "--save_path", save, "--learning_rate", "1e-4",
                                   "--train_batch_size", "64", "--micro_train_batch_size", "16", "--max_len", "2048",
                                   "--packing_samples", "--bf16", "--max_epochs", "1", "--max_samples", "512",
                                   "--lr_warmup_ratio", "0", "--seed", "1", "--logging_steps", "1"], save + ".log")
    from rlhf.metrics import read_metrics_jsonl

    steps = read_metrics_jsonl(os.path.join(save, "metrics.jsonl"), "sft") if p.returncode == 0 else {}
    tps = sorted(steps[s]["tokens_per_s"] for s in steps if s > 1)
    name = torch.cuda.get_device_properties(0).name
    peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
    if not tps:
        report("mfu[bf16,135M]", False, f"rc={p.returncode} no timed steps (log {save}.log)")
        return
    median = tps[len(tps) // 2]
    mfu = 6 * n_params * median / (peak * 1e12) if peak else math.nan
    report("mfu[bf16,135M]", True, f"{median:.0f} tokens/s (median of {len(tps)} steps after the first), "
           f"{n_params / 1e6:.1f}M params, MFU {mfu:.3f} of {name}'s {peak} TFLOPS bf16 peak (log {save}.log)")


def check_resume(out: str, assets: dict[str, str]) -> None:
    from safetensors.torch import load_file

    base = ["--pretrain", assets["actor"], "--dataset", assets["sft"], "--input_key", "input", "--output_key",
            "output", "--learning_rate", "1e-4", "--train_batch_size", "32", "--micro_train_batch_size", "8",
            "--max_len", "96", "--seed", "1", "--lr_warmup_ratio", "0", "--max_epochs", "1", "--max_samples", "128"]
    straight, resumed = os.path.join(out, "resume_straight"), os.path.join(out, "resume_resumed")
    rcs = [torchrun("launch/sft.py", base + ["--save_path", straight], straight + ".log").returncode,
           torchrun("launch/sft.py", base + ["--save_path", resumed, "--save_steps", "2", "--stop_after_steps", "2"],
                    resumed + "_a.log").returncode,
           torchrun("launch/sft.py", base + ["--save_path", resumed, "--save_steps", "2", "--load_checkpoint"],
                    resumed + "_b.log").returncode]
    if any(rcs):
        report("resume[cuda]", False, f"return codes {rcs}")
        return
    a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (straight, resumed))
    same = a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    report("resume[cuda]", same, "stop at 2 + resume == straight, bit for bit" if same else "weights differ")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "outputs", "gpu_check"))
    ap.add_argument("--only", default="kernels,sft,rm,ppo,resume,mfu")
    ap.add_argument("--precisions", default="fp32,bf16")
    a = ap.parse_args(argv)
    only = set(a.only.split(","))
    header()
    require_gpu()
    os.makedirs(a.out, exist_ok=True)
    steps = []
    if "kernels" in only:
        steps += [("kernels.logprobs", check_logprobs), ("kernels.varlen_attention", check_varlen_attention)]
    assets: dict[str, str] = {}
    if only & {"sft", "rm", "ppo", "resume", "mfu"}:
        steps.append(("assets", lambda: assets.update(make_assets(os.path.join(a.out, "assets")))))
        steps.append(("trainers", lambda: check_trainers(a.out, assets, a.precisions.split(","), only)))
        if "resume" in only:
            steps.append(("resume", lambda: check_resume(a.out, assets)))
        if "mfu" in only:
            steps.append(("mfu", lambda: check_mfu(a.out, assets)))
    for name, fn in steps:
        if name in ("trainers", "resume", "mfu") and not assets:
            report(name, False, "skipped: the assets step failed")
            continue
        try:
            fn()
        except Exception as e:  # a crash in one check (or in making the assets) is its FAIL; the others still run
            report(name, False, f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    passed = sum(ok for _, ok, _ in RESULTS)
    print(f"{passed} passed, {len(RESULTS) - passed} failed", flush=True)
    return 0 if passed == len(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
