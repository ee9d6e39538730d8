"""Score a policy on held-out prompts of the demo task: the rule's gold reward and the learned RM's reward.

    python tools/eval_demo.py --policy outputs/demo/sft --rm outputs/demo/rm --prompts prompts_eval.jsonl \
        [--n 4 --temperature 1.0 --max_new_tokens 8 --seed 0] [--json out.json]

Samples with vLLM (one process), scores replies with rlhf.demo.sort_task.gold_reward and with the reward
model (HF transformers, ``prompt + reply + eos`` exactly as in training). Prints one line per metric.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def evaluate(policy: str, rm: str, prompts_file: str, n: int = 4, temperature: float = 1.0,
             max_new_tokens: int = 8, seed: int = 0) -> dict:
    import torch
    import transformers
    from vllm import LLM, SamplingParams

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
    a = p.parse_args()
    r = evaluate(a.policy, a.rm, a.prompts, a.n, a.temperature, a.max_new_tokens, a.seed)
    print(f"{a.policy}: gold={r['gold']:.3f} rm={r['rm']:.3f} exact_sorted={r['exact_sorted']:.3f} "
          f"({r['samples']} samples)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
