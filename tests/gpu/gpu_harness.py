"""What the GPU check's parts share (tests/gpu/gpu_check.py runs them; tests/gpu/gpu_speed.py holds the speed
parts): the report and its small result files, the check's context (deadline, launches, assets), the MFU figures
and the long texts of the speed parts. Both of those modules import this one; it imports neither."""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

MIN_START_S = 30.0
STEP_TIMEOUT_S = int(os.environ.get("RLHF_GPU_STEP_TIMEOUT_S", "110"))
"""Each launch's own limit: a hung launch ends as its check's FAIL (rc 124) with its log, the others still run."""
TAIL_LINES = 60
BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.0),
                    ("H200", 989.0), ("A100", 312.0), ("L40S", 362.0), ("B200", 2250.0))
"""Dense bf16 tensor-core peaks (NVIDIA's data sheets, without sparsity), by product name, most specific first."""


class OutOfTime(Exception):
    """A launch would start with under ``MIN_START_S`` left of the deadline, or the deadline cut it: its check is
    NOT RUN."""


# ------------------------------------------------------------------------------------------------ reporting
def failure_excerpt(text: str, traceback_lines: int = 14, last_lines: int = 8) -> list[str]:
    """The lines of a failing launch's log worth reading inline, ``...`` where lines are left out: the end of the
    rank's first traceback (up to its exception line), the trainer's ``error:`` lines and the last lines the rank
    wrote, all before torchrun's own report (a traceback of its launcher, ``ChildFailedError``), of which only the
    ``exitcode`` line is kept."""
    lines = [ln[:400] for ln in text.splitlines()]

    def block_end(start: int) -> int:  # the frames are indented; the exception line is the first that is not
        end = start + 1
        while end < len(lines) and (lines[end][:1] in (" ", "\t") or not lines[end].strip()):
            end += 1
        return min(end, len(lines) - 1)

    starts = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("Traceback (most recent call last)")]
    launcher = next((i for i in starts if any("ChildFailedError" in ln or "torch/distributed/run.py" in ln
                                              for ln in lines[i:block_end(i) + 1])), None)
    body = launcher if launcher is not None else len(lines)
    picked: set[int] = set()
    rank_tb = next((i for i in starts if i < body), None)
    if rank_tb is not None:
        block = list(range(rank_tb, block_end(rank_tb) + 1))
        picked.update(block if len(block) <= traceback_lines else [block[0]] + block[-(traceback_lines - 1):])
    picked.update(i for i in range(body) if lines[i].startswith("error:"))
    picked.update(range(max(body - last_lines, 0), body))
    if launcher is not None:
        picked.update(i for i in range(launcher, len(lines)) if lines[i].strip().startswith("exitcode"))
    order, out = sorted(picked), []
    for before, i in zip([None] + order[:-1], order):
        if before is not None and i != before + 1:
            out.append("...")
        out.append(lines[i])
    return out


def shown(path: str) -> str:
    """A path as the log shows it: relative to the checkout when inside it."""
    rel = os.path.relpath(path, REPO)
    return path if rel.startswith("..") else rel


class Report:
    """The check's results: printed as they come and, with ``results``, rewritten there after every check."""

    def __init__(self, results: str | None, part: str) -> None:
        self.results, self.part = results, part
        self.lines: list[str] = []
        self.figures: dict[str, Any] = {"part": part, "env": {}, "checks": {}}
        self.status: dict[str, str] = {}
        if results:
            os.makedirs(results, exist_ok=True)
            open(os.path.join(results, "tails.txt"), "w").close()

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)
        self.write()

    def add(self, name: str, ok: bool, detail: str, figures: dict[str, Any] | None = None,
            log: str | None = None) -> None:
        self.status[name] = "PASS" if ok else "FAIL"
        self.figures["checks"].setdefault(name, {}).update(status=self.status[name], **(figures or {}))
        text = f"{self.status[name]} {name} {detail}" + (f" (log {shown(log)})" if log else "")
        if not ok and log and os.path.exists(log):
            with open(log, errors="replace") as f:
                text += "".join(f"\n    | {ln}" for ln in failure_excerpt(f.read()))
        self.say(text)

    def failed(self, name: str, exc: BaseException) -> None:
        """A check that raised: its FAIL line with the traceback's last frames inline."""
        tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
        self.status[name] = "FAIL"
        raised = f"{type(exc).__name__}: {exc}"[:2000]
        self.figures["checks"].setdefault(name, {}).update(status="FAIL", raised=raised)
        first = str(exc).splitlines()[0] if str(exc) else ""
        self.say(f"FAIL {name} raised {type(exc).__name__}: {first}" +
                 "".join(f"\n    | {ln}" for ln in failure_excerpt("".join(tb))))

    def not_run(self, name: str, why: str) -> None:
        self.status[name] = "NOT RUN"
        self.figures["checks"].setdefault(name, {}).update(status="NOT RUN", why=why)
        self.say(f"NOT RUN {name} {why}")

    def tail(self, label: str, log: str) -> None:
        """Append the last ``TAIL_LINES`` lines of one launch's log to ``tails.txt``."""
        if not self.results:
            return
        with open(log, errors="replace") as f:
            lines = f.read().splitlines()[-TAIL_LINES:]
        with open(os.path.join(self.results, "tails.txt"), "a") as f:
            f.write(f"===== {label}: last {len(lines)} lines of {shown(log)}\n")
            f.write("\n".join(lines) + "\n\n")

    def totals(self) -> str:
        counts = [sum(s == k for s in self.status.values()) for k in ("PASS", "FAIL", "NOT RUN")]
        return f"{counts[0]} passed, {counts[1]} failed, {counts[2]} not run"

    def write(self) -> None:
        if not self.results:
            return
        for name, text in (("summary.txt", "\n".join(self.lines) + "\n"),
                           ("figures.json", json.dumps(self.figures, indent=1, default=str) + "\n")):
            tmp = os.path.join(self.results, name + ".tmp")
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, os.path.join(self.results, name))


def offload_freed_gb(metrics: dict[str, float]) -> dict[str, float]:
    """``{phase: GB}`` from PPO's ``offload/<phase>_device_freed_gb`` metrics."""
    prefix, suffix = "offload/", "_device_freed_gb"
    return {k[len(prefix):-len(suffix)]: round(v, 3) for k, v in metrics.items()
            if k.startswith(prefix) and k.endswith(suffix)}


def bf16_peak_tflops(device_name: str) -> float | None:
    return next((v for k, v in BF16_PEAK_TFLOPS if k in device_name), None)


def train_flops_per_token(cfg: dict[str, Any], mean_context: float) -> float:
    """Model FLOPs of one trained token (forward + backward = 3x forward, no recompute), PaLM's MFU convention:
    6 x the matmul weights (layers and LM head; the embedding lookup is free) plus causal attention,
    12 x layers x query width x the mean attended context."""
    h, layers, inter, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    head = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter  # QKV, output projection, SwiGLU MLP
    return 6.0 * (layers * per_layer + h * vocab) + 12.0 * layers * q * mean_context


def mfu_of(steps: dict[int, dict[str, float]], flops_per_token: float, peak_tflops: float | None,
           skip: int = 2) -> dict[str, float]:
    """Median tokens/s of the steps after the first ``skip`` (compilation, allocator warm-up) and its MFU."""
    tps = sorted(m["tokens_per_s"] for s, m in steps.items() if s > skip)
    if not tps:
        return {}
    median = tps[len(tps) // 2]
    mfu = flops_per_token * median / (peak_tflops * 1e12) if peak_tflops else math.nan
    return {"tokens_per_s": median, "timed_steps": len(tps), "mfu": mfu}


# -------------------------------------------------------------------------------------------------- context
class Check:
    """What every check gets: the work folder, the report, the deadline, the shared assets."""

    def __init__(self, out: str, report: Report, deadline_s: float, rehearse: bool) -> None:
        self.out, self.report, self.rehearse = out, report, rehearse
        self.start, self.deadline_s = time.monotonic(), deadline_s
        self.current = ""
        self._assets: dict[str, str] | None = None

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.start)

    def launch(self, cmd: list[str], label: str, timeout: float | None = None) -> int:
        """Run one launch with its log in the work folder (written as it runs); its tail goes to the results.
        Returns its exit status (124: killed at its limit). Raises ``OutOfTime`` when too little time is left."""
        left = self.left()
        if left < MIN_START_S:
            raise OutOfTime(f"{left:.0f} s left of the part's {self.deadline_s:.0f} s")
        env = dict(os.environ, OMP_NUM_THREADS="8", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if self.rehearse:
            env.update(RLHF_DEVICE="cpu", OMP_NUM_THREADS="1")
        own = (timeout or STEP_TIMEOUT_S) * (4 if self.rehearse else 1)
        limit = int(min(own, left))
        log = os.path.join(self.out, label + ".log")
        t0 = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # its own group: a timeout ends ranks and converters
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks also die with their launcher (PDEATHSIG)
            proc.wait()
            rc = 124
            with open(log, "a") as f:  # at the end, after whatever the killed processes wrote
                f.write(f"\nTIMEOUT after {limit} s\n")
        self.report.figures["checks"].setdefault(self.current, {}).setdefault("launch_s", {})[label] = round(
            time.monotonic() - t0, 1)
        self.report.tail(label, log)
        if rc == 124 and limit < own:  # the part's deadline, not the launch's own limit, ended it
            raise OutOfTime(f"{label} cut at the part's {self.deadline_s:.0f} s deadline after {limit} s (log "
                            f"{shown(log)})")
        return rc

    def torchrun(self, script: str, args: list[str], label: str) -> int:
        from rlhf.distributed.env import free_port

        return self.launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                            "--master_port", str(free_port()), os.path.join(REPO, script), *args], label)

    def log(self, label: str) -> str:
        return os.path.join(self.out, label + ".log")

    def assets(self) -> dict[str, str]:
        """A small Llama (head size 64: the real kernels run), its reward model, a small Mixtral and the bundled
        task's data; made once per work folder (a warm machine keeps it between calls)."""
        if self._assets is None:
            done = os.path.join(self.out, "assets", "done.json")
            if os.path.exists(done):
                with open(done) as f:
                    self._assets = json.load(f)
            if self._assets is None or not ASSETS <= set(self._assets):  # none yet, or an older check's
                shutil.rmtree(os.path.join(self.out, "assets"), ignore_errors=True)
                self._assets = make_assets(os.path.join(self.out, "assets"))
                with open(done, "w") as f:
                    json.dump(self._assets, f)
        return self._assets


ASSETS = {"tokenizer", "actor", "rm", "moe", "sft", "pref", "prompts"}


def make_assets(out: str) -> dict[str, str]:
    from rlhf.demo.sort_task import corpus, make_all
    from rlhf.models.tiny import make_tiny_hf, make_tokenizer

    tok = os.path.join(out, "tokenizer")
    make_tokenizer(tok, vocab_size=384, seed=0, texts=corpus())
    dims = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, tokenizer_dir=tok)
    paths = make_all(os.path.join(out, "data"), seed=0, n_sft=512, n_pref=512, n_train_prompts=64,
                     n_eval_prompts=8, n_eval_pref=32)
    paths["tokenizer"] = tok
    paths["actor"] = make_tiny_hf(os.path.join(out, "actor"), "llama", seed=0, **dims)
    paths["rm"] = make_tiny_hf(os.path.join(out, "rm"), "llama", seq_cls=True, seed=1, **dims)
    paths["moe"] = make_tiny_hf(os.path.join(out, "moe"), "mixtral", seed=2, tie_word_embeddings=False,
                                num_local_experts=4, num_experts_per_tok=2, **dims)
    return paths


def last_metrics(save: str, prefix: str) -> dict[str, float]:
    from rlhf.observability.metrics import read_metrics_jsonl

    path = os.path.join(save, "metrics.jsonl")
    steps = read_metrics_jsonl(path, prefix) if os.path.exists(path) else {}
    return steps[max(steps)] if steps else {}


# ----------------------------------------------------------------------------- MFU (tests/gpu/gpu_speed.py)
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)


def long_texts(tokenizer, n: int, min_tokens: int, seed: int = 0) -> list[str]:
    """``n`` generated texts of at least ``min_tokens`` tokens (the sort task's sentences, shuffled)."""
    from rlhf.demo.sort_task import corpus

    rng, lines, texts = random.Random(seed), corpus(), []
    for _ in range(n):
        words: list[str] = []
        while True:
            words += [rng.choice(lines) for _ in range(64)]
            text = " ".join(words)
            if len(tokenizer(text)["input_ids"]) >= min_tokens:
                break
        texts.append(text)
    return texts
