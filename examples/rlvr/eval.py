"""Held-out accuracy of any HF causal LM folder on the arithmetic task (rlhf/demo/arith_task.py), with transformers'
own ``generate``: independent of both trainers, so ours and TRL's final models are measured the same way.

    python examples/rlvr/eval.py --model outputs/rlvr/grpo_s1 --heldout outputs/rlvr/data/heldout.jsonl [--k 4]

``--k`` replies per question at ``--temperature`` (0.6), up to ``--max_new_tokens`` (24), the chat template,
scored by ``rlhf.rewards.verifiers.math_reward``; prints one JSON line: accuracy (mean over every reply) and pass@k (mean
over questions of the best of k).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def sample_replies(model_dir: str, rows: list[dict], k: int = 4, temperature: float = 0.6, max_new_tokens: int = 24,
                   seed: int = 0, batch: int = 16) -> list[str]:
    """``k`` replies to each row's ``prompt`` (the chat template; transformers' generate, seeded once), row-major."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    replies = []
    for i in range(0, len(rows), batch):
        texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                         add_generation_prompt=True) for r in rows[i:i + batch]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                 top_p=1.0, num_return_sequences=k, pad_token_id=tok.pad_token_id or tok.eos_token_id)
        replies += tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return replies


def evaluate(model_dir: str, heldout: str, k: int = 4, temperature: float = 0.6, max_new_tokens: int = 24,
             seed: int = 0, batch: int = 16) -> dict:
    import torch

    from rlhf.rewards.verifiers import math_reward

    rows = [json.loads(ln) for ln in open(heldout) if ln.strip()]
    replies = sample_replies(model_dir, rows, k, temperature, max_new_tokens, seed, batch)
    rewards = math_reward([""] * len(replies), replies, [r["answer"] for r in rows for _ in range(k)])
    r = torch.tensor(rewards).view(-1, k)
    return {"model": model_dir, "questions": len(rows), "k": k, "accuracy": r.mean().item(),
            f"pass@{k}": r.max(dim=1).values.mean().item()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--heldout", required=True)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max_new_tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    print(json.dumps(evaluate(args.model, args.heldout, args.k, args.temperature, args.max_new_tokens, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
