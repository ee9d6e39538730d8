"""bf16 rollout/trainer log-prob drift on a real model: a stale or mis-cast weight sync, or bf16 arithmetic?

    .venv/bin/python -m torch.distributed.run --nproc_per_node 1 tools/check_bf16_drift.py --out /tmp/bf16drift \
        [--model DIR] [--updates 3] [--lr 1e-5] [--gemm bf16|auto] [--vllm_dtype bfloat16|float32] [--no_layers]

One rank: the megatron actor in bf16 (``--gemm bf16`` forces bf16's own GEMMs on the trainer, as on CPUs with
AMX; ``auto`` is this CPU's default) and vLLM in bf16 at TP 1, SmolLM2-135M-Instruct by default (prepared once
under --out). In order:

1. vLLM loads the HF folder itself (``load_format=auto``): its weights, read back through its own GEMMs
   (``rlhf.compat.vllm.read_engine_weights``), against the trainer's (``engine_layout`` of the sync's HF tensors,
   cast as vLLM's loader casts), bit for bit; the sampled log-prob drift (PPO's ``rollout_logprob_drift``).
2. Our weight sync at step 0 (no update): the same comparisons, and the synced engine against the disk-loaded one.
   Whether the tied head is the embedding's parameter (vLLM warns ``ParallelLMHead: Failed to load weights`` at
   every reload of a tied model) and whether its packed GEMM copy equals the embedding.
3. ``--updates`` SFT updates at ``--lr``, each followed by a sync: the same comparisons and drift after each.
4. Where the drift arises, on fixed sequences (step 0's samples): the residual stream after every layer and the
   teacher-forced log-probs of HF transformers in fp32 (the reference) and in bf16, megatron bf16 and vLLM bf16;
   then the LM head alone in fp32 on each side's final hidden states.

Prints one table per part and writes ``<out>/bf16_drift_<gemm>_<vllm_dtype>.json`` (after each part).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

QUESTIONS = ["What is 17 + 25?", "What is 9 x 7?", "What is 64 + 38?", "What is 12 x 11?"]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/bf16_drift")
    p.add_argument("--model", default=None, help="an HF folder (default: SmolLM2-135M-Instruct, prepared once)")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--gemm", choices=("bf16", "auto"), default="bf16", help="RLHF_CPU_BF16_GEMM of the trainer")
    p.add_argument("--max_tokens", type=int, default=24)
    p.add_argument("--no_layers", action="store_true", help="skip part 4 (per-layer comparison)")
    p.add_argument("--vllm_dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="float32: the engine computes in fp32 on the synced bf16 weights (--bf16 on CPUs without "
                        "fast bf16 products)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    os.environ["RLHF_CPU_BF16_GEMM"] = args.gemm
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    from examples.rlvr.run import smollm2_or

    hf_dir = smollm2_or(args.model, out)
    import torch
    import transformers

    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.runtime.role import ModelRole, OptimConfig
    from rlhf.rollout import RolloutConfig, shutdown
    from rlhf.rollout.vllm_generator import VLLMRollout
    from rlhf.rollout.weight_sync import WeightSync, compare_engine_weights, engine_layout

    mesh = initialize_mesh(1, 1, DistEnv.from_environ(), seed=1)
    actor = ModelRole(mesh, hf_dir, optim=OptimConfig(lr=args.lr, warmup_ratio=0.0, scheduler="constant"),
                        bf16=True, name="actor")
    spec = actor.spec
    cfg = RolloutConfig(tensor_parallel_size=1, kv_cache_bytes=64 << 20, max_model_len=256, backend="vllm",
                        dtype=args.vllm_dtype)
    engine = VLLMRollout(mesh, actor, cfg, hf_dir, load_format="auto")
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in QUESTIONS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    sync = WeightSync(actor, mesh)
    report: dict = {"cpu": cpu_name(), "gemm": args.gemm, "vllm_dtype": args.vllm_dtype, "lr": args.lr,
                    "model": hf_dir, "stages": {}}

    def save():  # after every part: a run cut short keeps what it measured
        with open(os.path.join(out, f"bf16_drift_{args.gemm}_{args.vllm_dtype}.json"), "w") as f:
            json.dump(report, f, indent=1)

    def expected():
        return engine_layout({n: t.detach().clone() for n, t in sync.iter_hf_tensors()}, spec, 1, 0)

    def stage(name: str, want: dict) -> dict:
        got = engine.read_weights()
        cmp = compare_engine_weights(got, want)
        tied = engine.llm.apply_model(lambda m: m.lm_head.weight is m.model.embed_tokens.weight)[0]
        d = drift(engine, actor, mesh, prompts, args.max_tokens)
        r = {"compared": cmp["compared"], "mismatched": cmp["mismatched"], "missing": cmp["missing"],
             "unexpected": cmp["unexpected"], "head_is_embedding_param": tied, **d}
        report["stages"][name] = r
        save()
        print(f"[{name}] tensors compared {cmp['compared']}, mismatched {len(cmp['mismatched'])} "
              f"{dict(list(cmp['mismatched'].items())[:4])}, missing {cmp['missing'][:4]}, "
              f"head is the embedding's parameter: {tied}; sampled drift mean {d['drift_mean']:.4f} "
              f"max {d['drift_max']:.4f} over {d['tokens']} tokens", flush=True)
        return got

    want0 = expected()
    disk = stage("disk_load", want0)
    sync.sync(engine)
    synced = stage("sync_step0", want0)
    same = [n for n in disk if n in synced and not torch.equal(disk[n], synced[n])]
    report["sync_vs_disk_differing"] = same
    print(f"[sync_step0 vs disk_load] engine tensors differing: {len(same)} of {len(disk)} {same[:4]}", flush=True)
    del disk, synced
    samples = engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, seed=7)
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    if not args.no_layers:
        report["layers"] = per_layer(engine, actor, hf_dir, seqs, [len(s.prompt_ids) for s in samples])
        save()

    from rlhf.algo.losses import sft_loss

    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(s), dtype=torch.long) for s in seqs], batch_first=True)
    mb = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    before = want0
    for u in range(1, args.updates + 1):
        actor.train_step([mb], lambda b, logits: sft_loss(logits, b["input_ids"], b["loss_mask"],
                                                           vocab_size=spec.vocab_size), ("loss",))
        want = expected()
        moved = sum(int((want[n] != before[n]).sum()) for n in want if not n.endswith(".param"))
        total = sum(want[n].numel() for n in want if not n.endswith(".param"))
        sync.sync(engine)
        stage(f"update{u}", want)
        report["stages"][f"update{u}"]["bf16_elements_changed"] = [moved, total]
        print(f"[update{u}] engine weight elements changed by the update: {moved} of {total} (a tied embedding "
              "counts twice: embedding and head)", flush=True)
        before = want
        save()
    shutdown(mesh, engine)
    return 0


def cpu_name() -> str:
    from rlhf.compat.onednn import cpu_flags

    name = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))
    return f"{name} ({' '.join(flags) or 'no avx512/amx'})"


def drift(engine, actor, mesh, prompts, max_tokens: int) -> dict:
    """PPO's rollout_logprob_drift on the engine's own samples (temperature 1): mean and max |vLLM - trainer|."""
    from rlhf.ppo.experience import collate_sequences, forward_role, select_rows
    from rlhf.ppo.experience import generator_logprobs

    samples = engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=1)
    batch = collate_sequences(samples, 0, max_tokens)
    lp = forward_role(actor, "actor", [select_rows(batch, range(len(samples)), trim=True)], 1.0)
    gen = generator_logprobs(samples, lp.shape[1])
    m = batch["action_mask"].bool()
    d = (lp - gen).abs()[m]
    return {"drift_mean": d.mean().item(), "drift_max": d.max().item(), "tokens": int(m.sum())}


def per_layer(engine, actor, hf_dir: str, seqs: list[list[int]], prompt_lens: list[int]) -> dict:
    """Residual stream after each layer and teacher-forced log-probs (every position after the prompt) of HF fp32
    (reference), HF bf16, megatron bf16 and vLLM bf16 on ``seqs``; relative RMS error per layer against the
    reference, and log-prob errors, also with each side's head recomputed in fp32."""
    import torch
    import transformers
    from vllm import SamplingParams

    import rlhf.kernels as kernels

    n_layers = actor.spec.num_layers
    res: dict = {}

    def hf_states(dtype):
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
        states, lps, finals = [], [], []
        for s in seqs:
            cap = []
            hooks = [layer.register_forward_hook(lambda m, i, o: cap.append(o[0] if isinstance(o, tuple) else o))
                     for layer in model.model.layers]
            hooks.append(model.model.norm.register_forward_hook(lambda m, i, o: cap.append(o)))
            with torch.no_grad():
                logits = model(torch.tensor([s])).logits[0]
            for h in hooks:
                h.remove()
            states.append(torch.stack([c[0].float() for c in cap[:n_layers]]))  # (L, S, H)
            finals.append(cap[n_layers][0])
            lps.append(torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor(s[1:])[:, None])[:, 0])
        return states, lps, finals, model.lm_head.weight.detach()

    ref_states, ref_lps, _, _ = hf_states(torch.float32)
    bf_states, bf_lps, bf_finals, bf_head = hf_states(torch.bfloat16)

    # megatron: the residual stream after each TransformerLayer, the final hidden and the trainer's log-probs
    mg_states, mg_lps, mg_finals = [], [], []
    layers = actor.model.decoder.layers
    for s in seqs:
        cap = []
        hooks = [layer.register_forward_hook(lambda m, i, o: cap.append(o[0] if isinstance(o, tuple) else o))
                 for layer in layers]
        with torch.no_grad():
            hidden = actor.model(torch.tensor([s]), output="hidden")  # (1, S, H)
        for h in hooks:
            h.remove()
        mg_states.append(torch.stack([c[:, 0].float() for c in cap[:n_layers]]))
        mg_finals.append(hidden[0])
        w = actor.model.output_weight()
        with torch.no_grad():
            mg_lps.append(kernels.fused_linear_logprobs(hidden[0, :-1].to(w.dtype), w, torch.tensor(s[1:]),
                                                        vocab_size=actor.spec.vocab_size))

    # vLLM: hooks on its decoder layers (output (hidden, residual): the stream is their sum) and its final norm
    def add_hooks(model):
        model._rlhf_cap = {"layers": [], "norm": []}
        hs = []
        for layer in model.model.layers:
            hs.append(layer.register_forward_hook(
                lambda m, i, o: model._rlhf_cap["layers"].append((o[0].float() + o[1].float()).clone())))
        hs.append(model.model.norm.register_forward_hook(
            lambda m, i, o: model._rlhf_cap["norm"].append((o[0] if isinstance(o, tuple) else o).clone())))
        model._rlhf_hooks = hs
        return True

    def take(model):
        for h in model._rlhf_hooks:
            h.remove()
        return model._rlhf_cap

    vl_states, vl_lps, vl_finals = [], [], []
    for s in seqs:
        engine.llm.apply_model(add_hooks)
        o = engine.llm.generate([{"prompt_token_ids": s}], SamplingParams(max_tokens=1, temperature=1.0,
                                                                         prompt_logprobs=0, detokenize=False),
                                use_tqdm=False)[0]
        cap = engine.llm.apply_model(take)[0]
        first = [c for c in cap["layers"] if c.shape[0] == len(s)][: n_layers]
        vl_states.append(torch.stack(first))
        vl_finals.append([c for c in cap["norm"] if c.shape[0] == len(s)][0])
        vl_lps.append(torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])]))

    def rel(a, b):  # per layer: ||a - b|| / ||b|| over the sequences' tokens
        num = sum(((x - y) ** 2).sum(dim=(1, 2)) for x, y in zip(a, b))
        den = sum((y ** 2).sum(dim=(1, 2)) for y in b)
        return (num / den).sqrt().tolist()

    res["layer_rel_err"] = {"hf_bf16": rel(bf_states, ref_states), "megatron_bf16": rel(mg_states, ref_states),
                            "vllm_bf16": rel(vl_states, ref_states), "vllm_vs_megatron": rel(vl_states, mg_states),
                            "hf_bf16_vs_megatron": rel(bf_states, mg_states)}

    def resp(lps):  # response positions only (log p of token t + 1 at position t)
        return torch.cat([lp[pl - 1:] for lp, pl in zip(lps, prompt_lens)])

    def fp32_head(finals, head):
        return [torch.log_softmax(f[:-1].float() @ head.float().T, -1).gather(1, torch.tensor(s[1:])[:, None])[:, 0]
                for f, s in zip(finals, seqs)]

    ref = resp(ref_lps)
    cmp = {"hf_bf16": resp(bf_lps), "megatron_bf16": resp(mg_lps), "vllm_bf16": resp(vl_lps),
           "hf_bf16_head_fp32": resp(fp32_head(bf_finals, bf_head)),
           "megatron_bf16_head_fp32": resp(fp32_head(mg_finals, actor.model.output_weight())),
           "vllm_bf16_head_fp32": resp(fp32_head(vl_finals, bf_head))}
    res["logprob_err_vs_hf_fp32"] = {k: [(v - ref).abs().mean().item(), (v - ref).abs().max().item()]
                                     for k, v in cmp.items()}
    pairs = {"vllm_vs_megatron": ("vllm_bf16", "megatron_bf16"), "hf_bf16_vs_megatron": ("hf_bf16", "megatron_bf16"),
             "vllm_vs_hf_bf16": ("vllm_bf16", "hf_bf16"),
             "vllm_vs_megatron_heads_fp32": ("vllm_bf16_head_fp32", "megatron_bf16_head_fp32")}
    res["logprob_pairs"] = {k: [(cmp[a] - cmp[b]).abs().mean().item(), (cmp[a] - cmp[b]).abs().max().item()]
                            for k, (a, b) in pairs.items()}
    res["tokens"] = int(ref.numel())
    logits_abs = [f[:-1].float() @ bf_head.float().T for f in bf_finals]
    res["target_logit_abs_mean"] = torch.cat([lg.gather(1, torch.tensor(s[1:])[:, None])[:, 0]
                                              for lg, s in zip(logits_abs, seqs)]).abs().mean().item()
    print("[per layer] relative error of the residual stream vs HF fp32 (layer: hf_bf16 megatron_bf16 vllm_bf16 | "
          "vllm-vs-megatron):", flush=True)
    e = res["layer_rel_err"]
    for i in range(n_layers):
        print(f"  {i:2d}: {e['hf_bf16'][i]:.2e} {e['megatron_bf16'][i]:.2e} {e['vllm_bf16'][i]:.2e} | "
              f"{e['vllm_vs_megatron'][i]:.2e}", flush=True)
    print("[log-probs vs HF fp32, mean / max over %d response tokens]" % res["tokens"], flush=True)
    for k, (mean, mx) in res["logprob_err_vs_hf_fp32"].items():
        print(f"  {k:26s} {mean:.4f} / {mx:.4f}", flush=True)
    for k, (mean, mx) in res["logprob_pairs"].items():
        print(f"  {k:26s} {mean:.4f} / {mx:.4f}", flush=True)
    print(f"  mean |target logit| {res['target_logit_abs_mean']:.2f}", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(main())
