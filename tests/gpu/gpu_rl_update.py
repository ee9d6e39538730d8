"""The RL update side by side (issue 60 item 3): one actor update of GRPO's clipped policy loss on rows of 2048
tokens (a 16-token prompt, a 2032-token response, every token trained), through

* ``ours``: megatron's actor (``rlhf.runtime.role.ModelRole``, bf16, packed micro-batches as ``--packing_samples`` packs
  them) with PPO's actor loss (``rlhf.algo.ppo_losses.make_actor_loss``, default clip 0.2, token mean) over the
  response log-probs of the fused vocab-parallel kernel (``rlhf.models.outputs.response_logprobs``), fused layer
  kernels on (``--use_liger_kernel``) or off;
* ``hf+liger``: transformers' Llama (fp32 master weights, bf16 autocast, sdpa, fused AdamW) after
  ``apply_liger_kernel_to_llama()``, the loss by Liger's ``LigerFusedLinearGRPOLoss``
  (``liger_kernel/chunked_loss/grpo_loss.py``: the LM head fused with the GRPO loss, ``beta=0``, ``loss_type="grpo"``,
  clip 0.2), as TRL's GRPOTrainer calls it with ``use_liger_loss``;
* ``hf``: the same model without Liger, log-probs from the full logits (log_softmax, gather) and the same loss.

The old log-probs are the model's own at the start (ratio 1 at step 1), the advantages +-1 per row (seeded). Per
configuration: the median tokens/s of steps 3..N and the peak device memory. One configuration per process:

    torchrun --nproc_per_node 1 tests/gpu/gpu_rl_update.py --impl ours --model DIR --json OUT [--fused 0|1]
    python tests/gpu/gpu_rl_update.py --impl hf --model DIR --json OUT [--liger 0|1]

Not yet run on a GPU (no device time was left in the session that wrote it); rehearsed on the CPU at a tiny shape
(``--device cpu``; Liger needs CUDA).
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
PROMPT = 16
CLIP = 0.2


def rows_and_advantages(vocab: int, n: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, length), generator=g)
    adv = (torch.randint(0, 2, (n, 1), generator=g).float() * 2 - 1).expand(n, length - PROMPT).contiguous()
    return ids, adv


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _peak(device) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def run_ours(a) -> dict:
    from rlhf.algo.ppo_losses import ACTOR_METRICS, ActorLossConfig, make_actor_loss
    from rlhf.distributed import DistEnv, initialize_mesh
    from rlhf.runtime.role import ModelRole, OptimConfig
    from rlhf.models import fused
    from rlhf.models.outputs import response_logprobs
    from rlhf.ppo.experience import forward_role, pack_microbatch

    fused.request(bool(a.fused))
    mesh = initialize_mesh(1, 1, DistEnv.from_environ(), seed=1)
    actor = ModelRole(mesh, a.model, optim=OptimConfig(lr=1e-6, warmup_ratio=0.0, scheduler="constant",
                                                         total_steps=a.steps), name="actor", bf16=True)
    ids, adv = rows_and_advantages(actor.spec.vocab_size, a.batch_rows, a.seq_len)
    t = a.seq_len - PROMPT
    mbs = []
    for i in range(0, a.batch_rows, a.micro_rows):
        x = ids[i:i + a.micro_rows]
        mb = {"input_ids": x, "attention_mask": torch.ones_like(x), "response_ids": x[:, PROMPT:],
              "resp_pos": torch.arange(PROMPT - 1, a.seq_len - 1).expand(len(x), t).contiguous(),
              "action_mask": torch.ones(len(x), t, dtype=torch.long), "advantages": adv[i:i + a.micro_rows]}
        mbs.append(pack_microbatch(mb, pad_id=0))
    old = forward_role(actor, "actor", mbs, 1.0)  # (B, T): the model's own log-probs, ratio 1 at the first step
    for k, mb in enumerate(mbs):
        mb["old_logprobs"] = old[k * a.micro_rows:(k + 1) * a.micro_rows]
    loss = make_actor_loss(lambda b, h: response_logprobs(actor, b, h, 1.0, entropy=True), ActorLossConfig())
    times, losses = [], []
    for _ in range(a.steps):
        if mesh.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _sync(mesh.device)
        t0 = time.perf_counter()
        m = actor.train_step(mbs, loss, ACTOR_METRICS, output="hidden")
        _sync(mesh.device)
        times.append(time.perf_counter() - t0)
        losses.append(m["policy_loss"])
    return _result(a, times, losses, _peak(mesh.device), impl="ours", fused=bool(actor.fused))


def run_hf(a) -> dict:
    import transformers

    if a.liger:
        if a.device == "cpu":
            raise ValueError("--liger 1 needs --device cuda (liger-kernel's Triton kernels need a GPU)")
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
        grpo = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo", epsilon_low=CLIP,
                                        epsilon_high=CLIP)
    cfg = transformers.AutoConfig.from_pretrained(a.model)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, config=cfg, dtype=torch.float32).to(a.device)
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=a.device != "cpu")
    ids, adv = rows_and_advantages(cfg.vocab_size, a.batch_rows, a.seq_len)
    ids, adv = ids.to(a.device), adv.to(a.device)
    mask = torch.ones_like(adv)
    autocast = torch.autocast(torch.device(a.device).type, dtype=torch.bfloat16)

    def logprobs(x):  # the full logits' log-probs of the response tokens, (m, T) fp32
        logits = model(input_ids=x).logits[:, PROMPT - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(-1, x[:, PROMPT:, None])[..., 0]

    with torch.no_grad(), autocast:
        old = torch.cat([logprobs(ids[i:i + a.micro_rows]) for i in range(0, a.batch_rows, a.micro_rows)])
    n_micro = a.batch_rows // a.micro_rows
    times, losses = [], []
    for _ in range(a.steps):
        if a.device != "cpu":
            torch.cuda.reset_peak_memory_stats()
        _sync(a.device)
        t0 = time.perf_counter()
        total = 0.0
        for i in range(0, a.batch_rows, a.micro_rows):
            x, s = ids[i:i + a.micro_rows], slice(i, i + a.micro_rows)
            with autocast:
                if a.liger:
                    hidden = model.model(input_ids=x).last_hidden_state[:, PROMPT - 1:-1]
                    loss = grpo(hidden, model.lm_head.weight, x[:, PROMPT:], mask[s], adv[s],
                                old_per_token_logps=old[s])[0]
                else:
                    ratio = torch.exp(logprobs(x) - old[s])
                    pg = torch.maximum(-adv[s] * ratio, -adv[s] * ratio.clamp(1 - CLIP, 1 + CLIP))
                    loss = (pg * mask[s]).sum() / mask[s].sum()
            (loss / n_micro).backward()
            total += float(loss.detach()) / n_micro
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(a.device)
        times.append(time.perf_counter() - t0)
        losses.append(total)
    return _result(a, times, losses, _peak(a.device), impl="hf", liger=bool(a.liger))


def _result(a, times, losses, peak, **what) -> dict:
    tps = [a.batch_rows * a.seq_len / s for s in times]
    timed = tps[2:] if len(tps) > 3 else tps
    return dict(what, tokens_per_s=tps, median_tokens_per_s=statistics.median(timed), peak_gib=peak, losses=losses,
                seq_len=a.seq_len, micro_rows=a.micro_rows, batch_rows=a.batch_rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=["ours", "hf"], required=True)
    p.add_argument("--model", required=True, help="an HF folder (tests/gpu/gpu_speed.py makes them at the two shapes)")
    p.add_argument("--json", required=True)
    p.add_argument("--fused", type=int, default=1, help="ours: --use_liger_kernel (1) or not (0)")
    p.add_argument("--liger", type=int, default=0, help="hf: apply_liger_kernel_to_llama and Liger's GRPO loss")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--micro_rows", type=int, default=8)
    p.add_argument("--batch_rows", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    if a.batch_rows % a.micro_rows or a.seq_len <= PROMPT:
        p.error(f"--batch_rows {a.batch_rows} must be a multiple of --micro_rows {a.micro_rows} and --seq_len "
                f"{a.seq_len} longer than the {PROMPT}-token prompt")
    r = run_ours(a) if a.impl == "ours" else run_hf(a)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
        print(f"{a.impl} {'fused=' + str(a.fused) if a.impl == 'ours' else 'liger=' + str(a.liger)}: "
              f"{r['median_tokens_per_s']:.0f} tokens/s, peak "
              f"{r['peak_gib']:.2f} GiB, losses {[round(x, 4) for x in r['losses']]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
