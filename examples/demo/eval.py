"""Score a policy on held-out prompts of the demo task: the rule's gold reward and the learned RM's reward.

    python examples/demo/eval.py --policy outputs/demo/sft --rm outputs/demo/rm --prompts prompts_eval.jsonl \
        [--n 4 --temperature 1.0 --max_new_tokens 8 --seed 0] [--json out.json] \
        [--pairs pref_eval.jsonl --ref outputs/demo/sft]

Samples with vLLM (one process), scores replies with rlhf.demo.sort_task.gold_reward and with the reward
model (HF transformers, ``prompt + reply + eos`` exactly as in training). Prints one line per metric.

``--pairs``: held-out preference accuracy, the fraction of pairs whose chosen reply has the larger implicit reward
``logp(reply) - ref_logp(reply)`` (DPO's, with ``--ref`` as the reference; beta > 0 does not change the order),
ties counted half; so a policy equal to its reference scores 0.5. ``logp_pref_acc``: the same with the policy's
own sequence log-prob (no reference).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def evaluate(policy: str, rm: str, prompts_file: str, n: int = 4, temperature: float = 1.0,
             max_new_tokens: int = 8, seed: int = 0) -> dict:
    import torch
    import transformers
    from vllm import LLM, SamplingParams

    from rlhf.compat.quiet import quiet_vllm

    quiet_vllm()  # vLLM's start-up warnings that mean nothing here, each said once

    from rlhf.demo.sort_task import gold_reward

    prompts = [json.loads(ln)["prompt"] for ln in open(prompts_file) if ln.strip()]
    tok = transformers.AutoTokenizer.from_pretrained(policy)
    llm = LLM(model=policy, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_model_len=128,
              seed=seed, enable_prefix_caching=False)
    ids = [tok(p)["input_ids"] for p in prompts]
    params = SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, seed=seed)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    gold, rm_scores, exact = [], [], []
    with torch.no_grad():
        for p, pid, o in zip(prompts, ids, outs):
            for c in o.outputs:
                reply = tok.decode(c.token_ids, skip_special_tokens=True)
                g = gold_reward(p, reply)
                gold.append(g)
                exact.append(float(g == 1.0))
                seq = list(pid) + list(c.token_ids)
                if not c.token_ids or c.token_ids[-1] != tok.eos_token_id:
                    seq.append(tok.eos_token_id)
                rm_scores.append(model(torch.tensor([seq])).logits.item())
    del llm
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"gold": mean(gold), "rm": mean(rm_scores), "exact_sorted": mean(exact), "samples": len(gold)}


def preference_accuracy(policy: str, pairs_file: str, ref: str | None = None) -> dict:
    """Held-out preference accuracy by implicit reward against ``ref`` (see the module docstring)."""
    import torch
    import transformers

    rows = [json.loads(ln) for ln in open(pairs_file) if ln.strip()]
    tok = transformers.AutoTokenizer.from_pretrained(policy)

    def seq_logps(model_dir: str) -> list[tuple[float, float]]:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        out = []
        with torch.no_grad():
            for r in rows:
                sides = []
                for reply in (r["chosen"], r["rejected"]):  # tokenized as in training (rlhf/data/formatting.py)
                    p = tok(r["prompt"])["input_ids"]
                    resp = tok(reply, add_special_tokens=False)["input_ids"]
                    if not resp or resp[-1] != tok.eos_token_id:
                        resp = resp + [tok.eos_token_id]
                    ids = torch.tensor([p + resp])
                    lp = model(ids).logits[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
                    sides.append(lp[len(p) - 1:].sum().item())
                out.append((sides[0], sides[1]))
        return out

    pol = seq_logps(policy)
    refs = seq_logps(ref) if ref else [(0.0, 0.0)] * len(rows)
    score = lambda m: 1.0 if m > 0 else 0.5 if m == 0 else 0.0  # noqa: E731
    margins = [(pc - rc) - (pr - rr) for (pc, pr), (rc, rr) in zip(pol, refs)]
    return {"pref_acc": sum(score(m) for m in margins) / len(rows),
            "logp_pref_acc": sum(score(pc - pr) for pc, pr in pol) / len(rows),
            "implicit_margin": sum(margins) / len(rows), "pairs": len(rows)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True)
    p.add_argument("--rm", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--pairs", default=None, help="held-out preference pairs (prompt/chosen/rejected jsonl)")
    p.add_argument("--ref", default=None, help="reference model of the implicit reward (with --pairs)")
    a = p.parse_args()
    r = evaluate(a.policy, a.rm, a.prompts, a.n, a.temperature, a.max_new_tokens, a.seed)
    print(f"{a.policy}: gold={r['gold']:.3f} rm={r['rm']:.3f} exact_sorted={r['exact_sorted']:.3f} "
          f"({r['samples']} samples)")
    if a.pairs:
        r.update(preference_accuracy(a.policy, a.pairs, a.ref))
        print(f"{a.policy}: pref_acc={r['pref_acc']:.3f} logp_pref_acc={r['logp_pref_acc']:.3f} "
              f"implicit_margin={r['implicit_margin']:.3f} ({r['pairs']} held-out pairs, ref {a.ref})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
