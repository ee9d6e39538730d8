"""Context parallelism against the unsharded model, run under torchrun by test_context_parallel.py.

    torchrun --nproc_per_node N tests/models/_cp_equivalence.py WORKDIR LAYOUT[,LAYOUT...]

A LAYOUT is tp.pp.cp[.ep] (DP is what is left of the world; with EP > 1 only the MoE model runs). For each model of MODELS, padded and packed (THD): the
logits of one forward against transformers, and the loss and every gradient of one training step (megatron DDP,
the engine's per-token loss contract, 4 micro-batches over the DP ranks) against the unsharded model run on the
whole batch in this process without any collective. Sequence lengths are not multiples of 2 x CP (the padding
path). Padded batches train through a loss that reads whole sequences (the all-gathered fallback), packed ones
through one that reads each rank's own tokens (``reads_local_tokens``). MoE's load-balancing loss: every gradient
of a mixtral step with it at each LAYOUT against CP1 (``aux_grads``). Rank 0 writes WORKDIR/cp_result_N.json.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _mp_equivalence import full_grads, hf_reference  # noqa: E402

from rlhf.distributed import initialize_mesh  # noqa: E402
from rlhf.models.context_parallel import current_layout, gather_tokens, reads_local_tokens, split_input  # noqa: E402
from rlhf.models.checkpoint_io import load_model  # noqa: E402
from rlhf.models.convert import hf_to_megatron_rank, plan_hf_to_megatron  # noqa: E402
from rlhf.models.gpt import build_model  # noqa: E402
from rlhf.models.hf_llama import hf_from_megatron  # noqa: E402
from rlhf.models.packing import make_packed_batch  # noqa: E402
from rlhf.models.pipeline import gather_vocab_parallel, run_microbatches  # noqa: E402

# Llama-3 RoPE scaling; q/k norms; a sliding window (8) + tied head; MoE (4 experts, top 2)
MODELS = ["llama-llama3", "qwen3", "mistral", "mixtral"]
AUX = 0.05  # the MoE load-balancing loss coefficient of the aux check (--aux_loss_coef)
AUX_SEQ = 16  # a multiple of 2 x CP: no CP padding tokens, which the router would count
SEQ = 19  # not a multiple of 2 x CP: the split pads
LENGTHS = [[7, 19, 1], [12, 3, 9], [5, 16], [2, 11, 4]]  # packed micro-batches


def token_loss(batch, logits):
    """The engine's per-token contract: (sum of token NLLs, tokens, metrics). Not marked reads_local_tokens: under
    CP it gets whole sequences (rlhf.models.context_parallel.whole_sequences)."""
    return _token_loss(batch, logits, batch["labels"], None)


@reads_local_tokens
def local_token_loss(batch, logits):
    """``token_loss`` on a CP rank's own tokens: the labels split as the input is, the NLLs gathered back."""
    cp = current_layout()
    return _token_loss(batch, logits, batch["labels"] if cp is None else split_input(batch["labels"], cp, dim=1), cp)


def _token_loss(batch, logits, labels, cp):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    nll = vocab_parallel_cross_entropy(logits.float().transpose(0, 1).contiguous(),
                                       labels.transpose(0, 1).contiguous()).transpose(0, 1)
    if cp is not None:
        nll = gather_tokens(nll, cp)
    mask = batch["loss_mask"].float()
    n = mask.sum()
    return (nll * mask).sum(), n.to(torch.int), {"loss": [(nll * mask).sum().detach(), n]}


def micro_batches(data, packed):
    """Padded: (B, SEQ) inputs with next-token labels. Packed: one stream per micro-batch of LENGTHS."""
    out = []
    for i, x in enumerate(data):
        if not packed:
            out.append({"input_ids": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones_like(x[:, 1:])})
            continue
        seqs = [x[j % x.shape[0], :n + 1] for j, n in enumerate(LENGTHS[i])]
        b = make_packed_batch([s[:-1] for s in seqs], per_token={"labels": [s[1:] for s in seqs],
                                                                 "loss_mask": [torch.ones(len(s) - 1, dtype=torch.long)
                                                                               for s in seqs]})
        out.append(b)
    return out


def reference(plan, ckpt, data, packed):
    """Loss and grads of the whole batch on the unsharded model, each sequence on its own when packed."""
    model = build_model(plan.spec, tp=1, pp=1, pp_rank=0, padded_vocab=plan.padded_vocab)
    load_model(model, os.path.join(ckpt, "model"))
    total, n = 0.0, 0
    for i, x in enumerate(data):
        rows = [x] if not packed else [x[j % x.shape[0], :m + 1].unsqueeze(0) for j, m in enumerate(LENGTHS[i])]
        for r in rows:
            logits = model(r[:, :-1])
            s, k, _ = token_loss({"labels": r[:, 1:], "loss_mask": torch.ones_like(r[:, 1:])}, logits)
            s.backward()
            total, n = total + s.item(), n + int(k)
    grads = {}
    for name, p in model.named_parameters():
        for hf_name, t in hf_from_megatron(name, p.grad.detach() / n, plan.spec):
            grads[hf_name] = t.clone()
    return total / n, grads


def check(work, name, layout, results, refs):
    from megatron.core import parallel_state as ps

    from rlhf.models.ddp import wrap_ddp

    tp, pp, cp, ep = layout
    ckpt = os.path.join(work, "mg", name)
    plan = plan_hf_to_megatron(os.path.join(work, "hf", name), ckpt + "-unused", 1, 1, overwrite=True)
    if ep > 1 and not plan.spec.num_experts:
        return  # expert parallelism: MoE models only
    mesh = initialize_mesh(tp, pp, cp=cp, ep=ep)
    tag = f"{name}/tp{tp}pp{pp}cp{cp}dp{mesh.dp}" + (f"ep{ep}" if ep > 1 else "")
    model = build_model(plan.spec, tp=tp, pp=pp, pp_rank=mesh.pp_rank, padded_vocab=plan.padded_vocab, ep=ep)
    load_model(model, os.path.join(ckpt, "model"))
    ids = torch.randint(0, plan.spec.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        out = run_microbatches(model, [{"input_ids": ids}], forward_only=True)
    diff = torch.zeros(1, dtype=torch.float64)
    if mesh.is_last_stage:
        ours = gather_vocab_parallel(out[0]["output"])[..., : plan.spec.vocab_size]
        diff[0] = (ours.double() - hf_reference(os.path.join(work, "hf", name), False, ids).double()).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    results[f"logits/{tag}"] = diff.item()
    if plan.spec.num_experts and tp > 1:
        return  # megatron trains MoE with TP only under sequence parallelism, which this project does not run
    model.train()
    model.config.calculate_per_token_loss = True
    ddp = wrap_ddp(model)
    data = torch.randint(0, 1 << 30, (4, 2, SEQ + 1), generator=torch.Generator().manual_seed(2)) % plan.spec.vocab_size
    for packed in (False, True):  # packed with PP: the streams' CP splits padded to one length (stream_length)
        ddp.zero_grad_buffer()
        per_dp = len(data) // mesh.dp
        micro = micro_batches(data, packed)[mesh.dp_rank * per_dp:(mesh.dp_rank + 1) * per_dp]
        # padded: the whole-sequence fallback; packed: the loss on the local tokens
        outs = run_microbatches(ddp, micro, loss_fn=local_token_loss if packed else token_loss)
        vec = torch.zeros(2, dtype=torch.float64)
        if mesh.is_last_stage and mesh.tp_rank == 0 and mesh.cp_rank == 0:
            vec[0] = sum(float(o["loss"][0]) for o in outs)
            vec[1] = sum(float(o["loss"][1]) for o in outs)
        dist.all_reduce(vec)
        grads = full_grads(ddp, mesh, plan.spec)
        ref_loss, ref_grads = refs[name, packed]
        gdiff = max((grads[k] - ref_grads[k]).abs().max().item() / (ref_grads[k].abs().max().item() + 1e-12)
                    for k in ref_grads)
        results[f"grads/{tag}/{'packed' if packed else 'padded'}"] = {
            "loss": (vec[0] / vec[1]).item(), "ref_loss": ref_loss, "max_rel_grad_diff": gdiff,
            "mismatched_names": sorted(set(ref_grads) ^ set(grads)), "cp_size": ps.get_context_parallel_world_size()}
    del ddp, model


def aux_grads(work, layout, aux):
    """Every gradient of one DDP step of mixtral with the load-balancing loss at ``aux`` (padded AUX_SEQ-token
    batches, 4 micro-batches over the DP ranks). Its reference is CP1 through the same schedule: the unsharded
    model run by hand has no megatron schedule to set the loss's scale."""
    from rlhf.models.ddp import wrap_ddp

    tp, pp, cp, ep = layout
    ckpt = os.path.join(work, "mg", "mixtral")
    plan = plan_hf_to_megatron(os.path.join(work, "hf", "mixtral"), ckpt + "-unused", 1, 1, overwrite=True)
    mesh = initialize_mesh(tp, pp, cp=cp, ep=ep)
    model = build_model(plan.spec, tp=tp, pp=pp, pp_rank=mesh.pp_rank, padded_vocab=plan.padded_vocab,
                        aux_loss_coef=aux, ep=ep)
    load_model(model, os.path.join(ckpt, "model"))
    model.config.calculate_per_token_loss = True
    ddp = wrap_ddp(model)
    data = torch.randint(0, plan.spec.vocab_size, (4, 2, AUX_SEQ + 1), generator=torch.Generator().manual_seed(3))
    per_dp = len(data) // mesh.dp
    micro = micro_batches(data, False)[mesh.dp_rank * per_dp:(mesh.dp_rank + 1) * per_dp]
    run_microbatches(ddp, micro, loss_fn=token_loss)
    return full_grads(ddp, mesh, plan.spec)


def rel_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() / (b[k].abs().max().item() + 1e-12) for k in b)


def main():
    # tp.pp.cp[.ep]
    work, layouts = sys.argv[1], [(tuple(int(v) for v in s.split(".")) + (1,))[:4] for s in sys.argv[2].split(",")]
    torch.set_num_threads(1)
    initialize_mesh(1, 1)
    for name in MODELS:  # the checkpoints, converted once at TP1 PP1
        hf_dir, ckpt = os.path.join(work, "hf", name), os.path.join(work, "mg", name)
        plan = plan_hf_to_megatron(hf_dir, ckpt, 1, 1, overwrite=True)
        if dist.get_rank() == 0:
            os.makedirs(os.path.join(ckpt, "model"), exist_ok=True)
        dist.barrier()
        hf_to_megatron_rank(plan, ckpt)
        dist.barrier()
    # the references, while no CP group exists (a model built under one would split its input)
    data = torch.randint(0, 1 << 30, (4, 2, SEQ + 1), generator=torch.Generator().manual_seed(2))
    refs = {}
    for name in MODELS:
        plan = plan_hf_to_megatron(os.path.join(work, "hf", name), os.path.join(work, "mg", name) + "-unused", 1, 1, overwrite=True)
        for packed in (False, True):
            refs[name, packed] = reference(plan, os.path.join(work, "mg", name), data % plan.spec.vocab_size, packed)
    results = {}
    aux_ref = aux_grads(work, (1, 1, 1, 1), AUX)  # CP1: 4 DP ranks
    # how much the load-balancing loss moves the gradients (the check below must see far less than this)
    results["aux/effect"] = rel_diff(aux_grads(work, (1, 1, 1, 1), 0.0), aux_ref)
    for layout in layouts:
        for name in MODELS:
            check(work, name, layout, results, refs)
        if layout[0] > 1:
            continue  # MoE trains at TP 1 (as in check)
        g = aux_grads(work, layout, AUX)
        results[f"aux/tp{layout[0]}pp{layout[1]}cp{layout[2]}" + (f"ep{layout[3]}" if layout[3] > 1 else "")] = {"max_rel_grad_diff": rel_diff(g, aux_ref),
                                                                   "mismatched_names": sorted(set(g) ^ set(aux_ref))}
    from rlhf.models import context_parallel as cpm

    results["whole_sequence_readers_logged"] = sorted(cpm._FALLBACK_LOGGED)  # the fallback's one line per loss
    if dist.get_rank() == 0:
        with open(os.path.join(work, f"cp_result_{dist.get_world_size()}.json"), "w") as f:
            json.dump(results, f, indent=2)
    dist.barrier()
    from rlhf.distributed.mesh import destroy_mesh

    destroy_mesh()


if __name__ == "__main__":
    main()
