"""Worker for test_lora.py (2 ranks): LoRA at TP2 equals LoRA unsharded; B = 0 is the base; training touches only
the adapters; merged weights give the unmerged logits.

    torchrun --nproc_per_node 2 tests/models/_lora_worker.py HF_DIR OUT_JSON

1. For TP1 (each rank the whole model), TP2 and TP2 with activation recompute: the tiny model with adapters on
   every linear and a seeded non-zero B; loss and the TP-gathered gradients of every A and B of one backward.
2. TP2 ModelRole with LoRA: logits with B = 0 vs the base engine; 3 optimizer steps; which parameters moved;
   logits of the merged weights in a plain model vs the adapted model; the same 3 steps at PP2.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlhf.models.convert import fill_from_hf  # noqa: E402
from rlhf.distributed import initialize_mesh  # noqa: E402
from rlhf.runtime.role import ModelRole, OptimConfig  # noqa: E402
from rlhf.models.source import describe_source  # noqa: E402
from rlhf.models.gpt import build_model  # noqa: E402
from rlhf.models.hf_llama import full_from_tp_shards  # noqa: E402
from rlhf.models.lora import LoraConfig, apply_lora, lora_modules, merged_named_tensors  # noqa: E402
from rlhf.models.pipeline import gather_vocab_parallel, run_microbatches  # noqa: E402


def shard_of(base_name, full, tp, rank, dim):
    """Inverse of full_from_tp_shards: this rank's shard of a full tensor (fc1 shards are [gate_r; up_r])."""
    if tp == 1:
        return full
    if base_name.endswith("mlp.linear_fc1.weight") and dim == 0:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp)[rank], torch.chunk(up, tp)[rank]])
    return torch.chunk(full, tp, dim=dim)[rank].contiguous()


def lm_loss(logits, labels):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits.float().transpose(0, 1).contiguous(),
                                        labels.transpose(0, 1).contiguous()).mean()


def equivalence(hf, src, cfg, tp, recompute):
    mesh = initialize_mesh(tp, 1)
    spec, pv = src["spec"], src["padded_vocab"]
    model = build_model(spec, tp=tp, pp=1, pp_rank=0, padded_vocab=pv, recompute=recompute)
    fill_from_hf(model, hf, spec, pv, tp=tp, pp=1, tp_rank=mesh.tp_rank, pp_rank=0)
    apply_lora(model, cfg, tp=tp, tp_rank=mesh.tp_rank)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, m in sorted(lora_modules(model).items()):
            column = name.endswith(("linear_qkv", "linear_fc1"))
            out_full = m.weight.shape[0] * (tp if column else 1)
            b_full = torch.randn(out_full, cfg.rank, generator=g) * 0.05
            m.lora_B.copy_(shard_of(name + ".weight", b_full, tp, mesh.tp_rank, 0) if column else b_full)
    model.train()
    x = torch.randint(0, spec.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    loss = lm_loss(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    grads = {}
    for name, m in sorted(lora_modules(model).items()):
        column = name.endswith(("linear_qkv", "linear_fc1"))
        for which, p in (("lora_A", m.lora_A), ("lora_B", m.lora_B)):
            assert p.grad is not None, (name, which)
            gr = p.grad.detach()
            sharded = (which == "lora_B") == column
            if sharded and tp > 1:
                shards = [torch.empty_like(gr) for _ in range(tp)]
                dist.all_gather(shards, gr.contiguous(), group=mesh.tp_group)
                gr = full_from_tp_shards(name + ".weight", shards, 0 if column else 1)
            grads[f"{name}.{which}"] = gr.clone()
        assert all(not p.requires_grad for n, p in m.named_parameters() if not n.startswith("lora_"))
    return loss.item(), grads


def sft_step_loss(engine):
    from rlhf.algo.losses import sft_loss

    tp_group = engine.mesh.tp_group if engine.mesh.tp > 1 else None
    return lambda b, logits: sft_loss(logits, b["input_ids"], b["loss_mask"], tp_group=tp_group,
                                      vocab_size=engine.spec.vocab_size)


def logits_of(module, ids):
    module.eval()
    with torch.no_grad():
        out = run_microbatches(module, [{"input_ids": ids}], forward_only=True)
    return gather_vocab_parallel(out[0]["output"])


def engine_checks(hf, src, cfg, res):
    mesh = initialize_mesh(2, 1)
    ids = torch.randint(0, src["spec"].vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    base = ModelRole(mesh, hf, name="base")
    base_logits = logits_of(base.module, ids)
    eng = ModelRole(mesh, hf, optim=OptimConfig(lr=2e-2, warmup_ratio=0.0, scheduler="constant"), lora=cfg,
                      name="actor")
    res["counts"] = eng.lora_counts
    res["b0_vs_base"] = (logits_of(eng.module, ids) - base_logits).abs().max().item()
    before = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    losses = []
    for _ in range(3):
        losses.append(eng.train_step([mb], sft_step_loss(eng), ("loss",))["loss"])
    res["losses"] = losses
    res["changed"] = sorted(n for n, p in eng.model.named_parameters() if not torch.equal(p, before[n]))
    res["n_params"] = len(before)
    unmerged = logits_of(eng.module, ids)
    res["trained_vs_base"] = (unmerged - base_logits).abs().max().item()
    plain = dict(base.model.named_parameters())
    with torch.no_grad():
        for name, t in merged_named_tensors(eng.model):
            plain[name].copy_(t)
    res["merged_vs_unmerged"] = (logits_of(base.module, ids) - unmerged).abs().max().item()
    # The same three steps at PP2 (adapters on both stages, the pipeline schedule): the same losses.
    mesh = initialize_mesh(1, 2)
    eng = ModelRole(mesh, hf, optim=OptimConfig(lr=2e-2, warmup_ratio=0.0, scheduler="constant"), lora=cfg,
                      name="actor")
    res["pp2_losses"] = [eng.train_step([mb], sft_step_loss(eng), ("loss",))["loss"] for _ in range(3)]


def main():
    hf, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    initialize_mesh(1, 1)
    src = describe_source(hf)
    cfg = LoraConfig(rank=4, alpha=8.0, target_modules=("all-linear",))
    res = {}
    t0 = time.time()
    ref_loss, ref = equivalence(hf, src, cfg, 1, False)
    for tp, recompute in ((2, False), (2, True)):
        loss, grads = equivalence(hf, src, cfg, tp, recompute)
        key = f"tp{tp}" + ("_recompute" if recompute else "")
        res[key] = {"loss_diff": abs(loss - ref_loss), "names_match": sorted(grads) == sorted(ref),
                    "n_grads": len(grads), "max_grad_diff": max((grads[k] - ref[k]).abs().max().item() for k in ref),
                    "min_grad_norm": min(ref[k].norm().item() for k in ref)}
    res["equivalence_s"] = time.time() - t0
    engine_checks(hf, src, cfg, res)
    res["total_s"] = time.time() - t0
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
    from rlhf.distributed.mesh import destroy_mesh

    destroy_mesh()


if __name__ == "__main__":
    main()
