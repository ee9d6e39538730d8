"""Multi-rank checks of the newer families and of MoE at TP > 1, run by test_families_equivalence.py:

    torchrun --nproc_per_node 4 tests/models/_families_worker.py WORKDIR NAME [NAME ...]

For each tiny model WORKDIR/hf/NAME (transformers' own classes, rlhf.models.tiny.TINY_FAMILIES, and the tiny
mixtral): converts HF -> megatron in-process at TP2 x EP2 and at PP2 x EP2, then
* logits vs transformers (fp32, eager attention) at every layout of LOGIT_LAYOUTS, on 23-token rows (odd: the
  sequence-parallel padding at TP 2);
* one training step's loss and every gradient vs transformers' own backward at GRAD_LAYOUTS (TP 2: sequence
  parallelism; the megatron grads gathered over TP, PP and EP and mapped to HF names);
* controls at TP 1: the same logits with one term removed (CONTROLS), which must then differ from transformers.
NAME "mixtral-aux" compares loss and gradients with megatron's load-balancing loss on (coefficient 0.01) against
the single-rank run at TP 1 (transformers' own auxiliary loss is another formula). Rank 0 writes
WORKDIR/result-<first NAME>.json.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mp_equivalence import full_grads, layout_name, lm_loss, progress  # noqa: E402

from rlhf.distributed import initialize_mesh  # noqa: E402
from rlhf.models.checkpoint_io import load_model  # noqa: E402
from rlhf.models.convert import hf_to_megatron_rank, plan_hf_to_megatron  # noqa: E402
from rlhf.models.gpt import build_model  # noqa: E402
from rlhf.models.pipeline import gather_vocab_parallel, run_microbatches  # noqa: E402

# (tp, pp, ep) on 4 ranks; TP 2 turns sequence parallelism on for these MoE models
LOGIT_LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (2, 2, 1), (1, 2, 2)]
GRAD_LAYOUTS = [(1, 1, 1), (2, 1, 2), (2, 2, 1), (1, 2, 2)]
SEQ = 23


def fitting(layouts, spec):
    """Every layout (gpt_oss's biased experts at TP 2 run at expert-TP 1: rlhf.models.spec_families)."""
    return list(layouts)


def _zero(pattern):
    def apply(model):
        with torch.no_grad():
            for p in [p for n, p in [*model.named_parameters(), *model.named_buffers()] if pattern in n]:
                p.zero_()  # (none: the term is not in the model, and the control shows it by passing)
    return apply


def _ones(pattern):
    def apply(model):
        with torch.no_grad():
            for p in [p for n, p in model.named_parameters() if pattern in n]:
                p.fill_(1.0)
    return apply


CONTROLS = {  # name -> {control: edit of the loaded model}: each term the equivalence relies on, removed
    "deepseek_v3": {"expert_bias_zeroed": _zero("router.expert_bias"), "shared_experts_zeroed":
                    _zero("shared_experts.linear_fc2"), "kv_lora_norm_ones": _ones("kv_layernorm"),
                    "q_lora_norm_ones": _ones("q_layernorm")},
    "deepseek_v3-noqlora": {"shared_experts_zeroed": _zero("shared_experts.linear_fc2")},
    "glm4_moe": {"expert_bias_zeroed": _zero("router.expert_bias"), "qkv_bias_zeroed": _zero("linear_qkv.bias"),
                 "qk_norm_ones": _ones("k_layernorm")},
    "gpt_oss": {"sinks_zeroed": _zero("softmax_offset"), "router_bias_zeroed": _zero("router.bias"),
                "expert_bias_zeroed": _zero("linear_fc2.bias"), "o_bias_zeroed": _zero("linear_proj.bias")},
    "mixtral": {},
}


def convert(work, name, tp, pp, ep):
    hf_dir = os.path.join(work, "hf", name)
    ckpt = os.path.join(work, "mg", f"{name}-tp{tp}pp{pp}ep{ep}")
    plan = plan_hf_to_megatron(hf_dir, ckpt, tp, pp, overwrite=True, ep=ep)
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(ckpt, "model"), exist_ok=True)
    dist.barrier()
    hf_to_megatron_rank(plan, ckpt)
    if dist.get_rank() == 0:  # what convert_hf_to_megatron writes beside the shards (the round-trip test reads it)
        from rlhf.models.checkpoint_io import write_manifest
        from rlhf.models.hf_io import copy_tokenizer_files
        from rlhf.models.mtp import keep_mtp

        copy_tokenizer_files(hf_dir, ckpt)
        keep_mtp(hf_dir, ckpt, plan.spec)
        write_manifest(ckpt, spec=plan.spec, hf_config=plan.hf_config, padded_vocab=plan.padded_vocab,
                       source=hf_dir, tp=tp, pp=pp, dtype=plan.dtype, extra={"saved_at_ep": ep})
    dist.barrier()
    return plan, ckpt


def hf_model(hf_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                             attn_implementation="eager")


def build(plan, ckpt, tp, pp, ep, **kw):
    from rlhf.models.spec_families import expert_tensor_parallel

    mesh = initialize_mesh(tp, pp, ep=ep, etp=expert_tensor_parallel([plan.spec], tp))
    model = build_model(plan.spec, tp=tp, pp=pp, pp_rank=mesh.pp_rank, padded_vocab=plan.padded_vocab, ep=ep, **kw)
    load_model(model, os.path.join(ckpt, "model"))
    return mesh, model


def logits_of(model, mesh, plan, ids):
    model.eval()
    with torch.no_grad():
        out = run_microbatches(model, [{"input_ids": ids}], forward_only=True)
    if not mesh.is_last_stage:
        return None
    return gather_vocab_parallel(out[0]["output"])[..., : plan.spec.vocab_size].double()


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def logits_check(work, name, plan, ckpt, results):
    ids = torch.randint(0, plan.spec.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(os.path.join(work, "hf", name))(input_ids=ids).logits.double()
    results[f"ref_scale/{name}"] = ref.abs().max().item()
    for tp, pp, ep in fitting(LOGIT_LAYOUTS, plan.spec):
        progress(f"logits {name} tp{tp} pp{pp} ep{ep}")
        mesh, model = build(plan, ckpt, tp, pp, ep)
        ours = logits_of(model, mesh, plan, ids)
        results[f"logits/{name}/{layout_name(tp, pp, ep)}"] = max_over_ranks(
            0.0 if ours is None else (ours - ref).abs().max().item())
    if not plan.spec.linear_bias:  # packed at TP 2: the sequence-parallel padding adds a dummy sequence (gpt_oss's
        # packed micro-batches are refused)
        results[f"packed/{name}/tp2pp1"] = packed_check(plan, ckpt)
    for control, edit in CONTROLS.get(name, {}).items():
        mesh, model = build(plan, ckpt, 1, 1, 1)
        edit(model)
        ours = logits_of(model, mesh, plan, ids)
        results[f"control/{name}/{control}"] = max_over_ranks((ours - ref).abs().max().item())


def packed_check(plan, ckpt, lengths=(7, 19, 1, 12)):
    """max |packed - padded| logits at TP 2 over sequences of ``lengths`` (39 tokens: padded to 40 for SP)."""
    from rlhf.models.packing import make_packed_batch, split_packed

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, plan.spec.vocab_size, (len(lengths), max(lengths)), generator=g)
    mask = torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)
    ids = ids.masked_fill(~mask, 0)
    mesh, model = build(plan, ckpt, 2, 1, 1)
    padded = logits_of(model, mesh, plan, ids)
    mb = make_packed_batch(ids, mask)
    model.eval()
    with torch.no_grad():
        out = run_microbatches(model, [mb], forward_only=True)
    packed = gather_vocab_parallel(out[0]["output"])[..., : plan.spec.vocab_size].double()
    parts = split_packed(mb, packed)
    return max_over_ranks(max((padded[i, :n] - p).abs().max().item() for i, (n, p) in enumerate(zip(lengths, parts))
                              if n))


def hf_step(work, name, data, spec):
    """transformers' own loss and gradients over the global batch (the mean of the micro-batches' token means)."""
    model = hf_model(os.path.join(work, "hf", name)).train()
    losses = []
    for x in data:
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        (loss / len(data)).backward()
        losses.append(loss.item())
    # The checkpoint's names, by transformers' own mapping: save the gradients as if they were the weights (its
    # modules fuse the experts that its checkpoints keep per expert, and name mixtral's MoE differently)
    import tempfile

    from safetensors.torch import load_file

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        grads = {k: v for f in sorted(os.listdir(tmp)) if f.endswith(".safetensors")
                 for k, v in load_file(os.path.join(tmp, f)).items() if not k.endswith("e_score_correction_bias")}
    return sum(losses) / len(losses), grads


def our_step(plan, ckpt, tp, pp, ep, data, aux=0.0):
    from rlhf.models.ddp import wrap_ddp
    from rlhf.models.hf_families import fuse_experts

    mesh, model = build(plan, ckpt, tp, pp, ep, aux_loss_coef=aux)
    ddp = wrap_ddp(model)
    ddp.zero_grad_buffer()
    per_dp = len(data) // mesh.dp
    mine = data[mesh.dp_rank * per_dp:(mesh.dp_rank + 1) * per_dp]
    micro = [{"input_ids": x[:, :-1], "labels": x[:, 1:]} for x in mine]
    run_microbatches(ddp, micro, loss_fn=lm_loss)
    with torch.no_grad():
        fo = run_microbatches(ddp, micro, forward_only=True)
    loss = torch.zeros(1, dtype=torch.float64)
    if mesh.is_last_stage:  # every TP rank joins the vocab-parallel loss; one of them reports it
        vals = [lm_loss(m, o["output"])[0].item() for m, o in zip(micro, fo)]
        loss[0] = sum(vals) / len(vals) / mesh.dp if mesh.tp_rank == 0 else 0.0
    dist.all_reduce(loss)
    grads = dict(fuse_experts(full_grads(ddp, mesh, plan.spec).items(), plan.spec))
    return loss.item(), grads


def compare(grads, ref):
    rel = {k: (grads[k] - ref[k]).abs().max().item() / (ref[k].abs().max().item() + 1e-12) for k in ref if k in grads}
    return {"max_rel_grad_diff": max(rel.values()), "worst": max(rel, key=rel.get),
            "over_1e-5": sorted(k for k, v in rel.items() if v > 1e-5)[:8],
            "mismatched_names": sorted(set(ref) ^ set(grads)), "zero_ref_grads": sorted(k for k in ref
                                                                                      if not ref[k].abs().max())}


def grad_check(work, name, plan, ckpt, results, aux=0.0, label=None):
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, plan.spec.vocab_size, (4, 2, SEQ + 1 if not aux else 17), generator=g)
    if aux:  # our own TP 1 run is the reference (megatron's load-balancing loss)
        ref_loss, ref = our_step(plan, ckpt, 1, 1, 1, data, aux)
    else:  # rank 0's (transformers saves on rank 0 only), for every rank
        box = [hf_step(work, name, data, plan.spec) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        ref_loss, ref = box[0]
    for tp, pp, ep in fitting(GRAD_LAYOUTS[1 if aux else 0:], plan.spec):
        progress(f"grads {name} tp{tp} pp{pp} ep{ep}")
        loss, grads = our_step(plan, ckpt, tp, pp, ep, data, aux)
        results[f"grads/{label or name}/{layout_name(tp, pp, ep)}"] = {"loss": loss, "ref_loss": ref_loss,
                                                              **compare(grads, ref)}


def main():
    work, names = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    initialize_mesh(1, 1)
    results = {}
    for name in names:
        hf_name = "mixtral" if name == "mixtral-aux" else name
        plan, ckpt = convert(work, hf_name, 2, 1, 2)
        if name == "mixtral-aux":
            grad_check(work, hf_name, plan, ckpt, results, aux=0.01, label=name)
            continue
        convert(work, hf_name, 1, 2, 2)  # a second layout for the round trip
        logits_check(work, name, plan, ckpt, results)
        grad_check(work, name, plan, ckpt, results)
    if dist.get_rank() == 0:
        with open(os.path.join(work, f"result-{names[0]}.json"), "w") as f:
            json.dump(results, f, indent=2)
    dist.barrier()
    from rlhf.distributed.mesh import destroy_mesh

    destroy_mesh()


if __name__ == "__main__":
    main()
