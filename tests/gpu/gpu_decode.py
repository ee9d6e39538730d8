"""The megatron generator's decode side by side with transformers' ``generate``: the generator a
GPU machine without vLLM runs.

* ``ours``: ``rlhf.rollout.megatron_generator.MegatronRollout`` on megatron's actor in bf16 (``ModelRole``), with its
  decode cache (megatron-core's ``StaticInferenceContext``: the prompt fed once, then one token per forward); it
  samples the replies of prompts of one length as one batch (up to ``max_batch_rows``; ``--max_batch_rows 1``: a
  prompt's at a time), drawn on the device;
* ``hf``: transformers' ``generate`` (bf16 weights, sdpa, its dynamic KV cache), every prompt's replies in one batch
  of ``--prompts`` x ``--n_samples_per_prompt`` rows, as TRL's ``GRPOTrainer`` generates without vLLM;
* ``hf_static``: the same with ``cache_implementation="static"`` (transformers' preallocated KV cache).

Every configuration samples at temperature 1, top-p 1, exactly ``--tokens`` new tokens per reply (EOS ignored), from
the same ``--prompts`` prompts of ``--prompt_len`` random tokens. One warm-up round of 4 tokens, then ``--rounds``
timed rounds; tokens/s = prompts x replies x tokens / the median round's seconds; peak device memory. One configuration
per process:

    torchrun --nproc_per_node 1 tests/gpu/gpu_decode.py --impl ours --model DIR --json OUT
    python tests/gpu/gpu_decode.py --impl hf|hf_static --model DIR --json OUT

Not yet run on a GPU; rehearsed on the CPU at a tiny shape (``--device cpu``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from gpu_rl_update import _peak, _sync  # noqa: E402 (the device's sync and peak memory, as the RL update bench's)


def prompts_of(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def _timed(fn, device, rounds: int) -> list[float]:
    fn(4)  # warm-up: kernels chosen, caches allocated
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        fn(None)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def run_ours(a) -> dict:
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.rollout.megatron_generator import MegatronRollout
    from rlhf.rollout.types import RolloutConfig
    from rlhf.runtime.role import ModelRole

    mesh = initialize_mesh(1, 1, DistEnv.from_environ(), seed=1)
    actor = ModelRole(mesh, a.model, value_head=False, name="actor", bf16=True)
    gen = MegatronRollout(mesh, actor, RolloutConfig(backend="megatron"), announce=False)
    if a.max_batch_rows:
        gen.max_batch_rows = a.max_batch_rows
    prompts = prompts_of(actor.spec.vocab_size, a.prompts, a.prompt_len)
    lengths = []

    def once(tokens):
        out = gen.generate(prompts, n=a.n_samples_per_prompt, temperature=1.0, top_p=1.0,
                           max_tokens=tokens or a.tokens, seed=0, ignore_eos=True)
        lengths.append(sum(len(s.response_ids) for s in out))

    times = _timed(once, mesh.device, a.rounds)
    return _result(a, times, lengths[-1], _peak(mesh.device), impl="ours", decode_cache=gen.cache_refusal is None,
                   max_batch_rows=gen.max_batch_rows)


def run_hf(a) -> dict:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(a.model)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, config=cfg, dtype=torch.bfloat16).to(a.device)
    model.eval()
    prompts = prompts_of(cfg.vocab_size, a.prompts, a.prompt_len)
    # prompt-major, as ours
    ids = torch.tensor([p for p in prompts for _ in range(a.n_samples_per_prompt)], device=a.device)
    extra = {"cache_implementation": "static"} if a.impl == "hf_static" else {}
    lengths = []

    def once(tokens):
        t = tokens or a.tokens
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=0, max_new_tokens=t, min_new_tokens=t, pad_token_id=0, **extra)
        lengths.append(int(out.shape[0] * (out.shape[1] - ids.shape[1])))

    times = _timed(once, a.device, a.rounds)
    return _result(a, times, lengths[-1], _peak(a.device), impl=a.impl)


def _result(a, times, new_tokens: int, peak, **what) -> dict:
    want = a.prompts * a.n_samples_per_prompt * a.tokens
    if new_tokens != want:
        raise RuntimeError(f"{what['impl']} drew {new_tokens} tokens in its last round, not {want}")
    s = statistics.median(times)
    return dict(what, seconds=times, median_s=s, tokens_per_s=want / s, peak_gib=peak, prompts=a.prompts,
                n=a.n_samples_per_prompt, prompt_len=a.prompt_len, tokens=a.tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=["ours", "hf", "hf_static"], required=True)
    p.add_argument("--model", required=True, help="an HF folder (tests/gpu/gpu_speed.py makes them at the two shapes)")
    p.add_argument("--json", required=True)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n_samples_per_prompt", type=int, default=8, help="replies per prompt (OpenRLHF's flag)")
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256, help="new tokens per reply")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max_batch_rows", type=int, default=None,
                   help="ours: rows sampled together (default the generator's; 1: each prompt's replies alone)")
    a = p.parse_args(argv)
    for flag in ("prompts", "n_samples_per_prompt", "prompt_len", "tokens", "rounds"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag} must be at least 1, got {getattr(a, flag)}")
    r = run_ours(a) if a.impl == "ours" else run_hf(a)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
        print(f"{a.impl}: {r['tokens_per_s']:.0f} new tokens/s ({a.prompts} x {a.n_samples_per_prompt} replies of "
              f"{a.tokens} tokens, median {r['median_s']:.2f} s), peak {r['peak_gib']:.2f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
