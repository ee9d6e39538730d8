"""Context parallelism against the unsharded model, run under torchrun by test_context_parallel.py.

    torchrun --nproc_per_node N tests/models/_cp_equivalence.py WORKDIR LAYOUT[,LAYOUT...]

A LAYOUT is tp.pp.cp[.ep] (DP is what is left of the world; with EP > 1 only the MoE model runs). For each model of MODELS, padded and packed (THD): the
logits of one forward against transformers, and the loss and every gradient of one training step (megatron DDP,
the engine's per-token loss contract, 4 micro-batches over the DP ranks) against the unsharded model run on the
whole batch in this process without any collective. Sequence lengths are not multiples of 2 x CP (the padding
path). Padded batches train through a loss that reads whole sequences (the all-gathered fallback), packed ones
through one that reads each rank's own tokens (``reads_local_tokens``). MoE's load-balancing loss: every gradient
of a mixtral step with it at each LAYOUT against CP1 (``aux_grads``). At TP 1 layouts: MoE routing replay
(``routing_check``) and full recompute (``recompute_checks``) against CP1. Rank 0 writes WORKDIR/cp_result_N.json.
"""
import functools
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
    if plan.spec.num_experts and tp > 1:  # MoE at TP > 1 runs sequence parallel, which CP does not combine with yet
        try:
            build_model(plan.spec, tp=tp, pp=pp, pp_rank=mesh.pp_rank, padded_vocab=plan.padded_vocab, ep=ep)
        except ValueError as e:
            results[f"refused/{tag}"] = str(e)
        else:
            results[f"refused/{tag}"] = None
        return
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


def hf_routing(hf_dir, rows):
    """transformers' top-k experts of every token of each (1, L) row: (L, layers, K) ids + 1 each."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    k = m.config.num_experts_per_tok
    out = []
    with torch.no_grad():
        for r in rows:
            logits = m(input_ids=r, output_router_logits=True).router_logits  # per layer (L, E)
            out.append(torch.stack([lg.topk(k, dim=-1).indices for lg in logits], dim=1).short() + 1)
            top = torch.stack([lg.topk(k + 1, dim=-1).values for lg in logits])  # (layers, L, K + 1)
            hf_routing.min_gap = min(getattr(hf_routing, "min_gap", 1.0), (top[..., k - 1] - top[..., k]).min().item())
    return out


def routing_rows(vocab):
    """The routing check's inputs: a padded (2, SEQ) batch, and one packed stream of LENGTHS[0]'s sequences."""
    ids = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(4))
    return ids, [ids[j % 2, :n].unsqueeze(0) for j, n in enumerate(LENGTHS[0])]


def routing_batches(ids, seqs, routed=None, recorder=None):
    """The padded and the packed micro-batch, each with the routing to replay or the recorder."""
    from rlhf.models.routing_replay import pack_routing

    padded = {"input_ids": ids}
    packed = make_packed_batch([s[0] for s in seqs])
    if routed is not None:
        padded["routed_experts"] = routed[0]
        mask = torch.zeros(len(seqs), max(s.shape[1] for s in seqs), dtype=torch.long)
        for i, s in enumerate(seqs):
            mask[i, : s.shape[1]] = 1
        packed["routed_experts"] = pack_routing(routed[1], mask, packed["input_ids"].shape[1])
    if recorder is not None:
        padded["routing_recorder"] = packed["routing_recorder"] = recorder
    return padded, packed


def routing_check(work, layout, ref=None):
    """Megatron's RouterReplay under CP (rlhf.models.routing_replay): the routing recorded in an unreplayed forward,
    gathered over the CP ranks, equals transformers' top-k for every token, padded and packed; a replayed routing
    (every token sent to the next experts: not what the router would choose) changes the logits and equals CP1's
    replay of it (``ref``: this function's logits at CP1), padded and packed. Returns (figures, replayed logits)."""
    from rlhf.models.routing_replay import RoutingRecorder, merge_stages

    tp, pp, cp, ep = layout
    hf_dir = os.path.join(work, "hf", "mixtral")
    plan = plan_hf_to_megatron(hf_dir, os.path.join(work, "mg", "mixtral") + "-unused", 1, 1, overwrite=True)
    mesh = initialize_mesh(tp, pp, cp=cp, ep=ep)
    model = build_model(plan.spec, tp=tp, pp=pp, pp_rank=mesh.pp_rank, padded_vocab=plan.padded_vocab, ep=ep,
                        routing_replay=True)
    load_model(model, os.path.join(work, "mg", "mixtral", "model"))
    model.eval()
    ids, seqs = routing_rows(plan.spec.vocab_size)
    pad = functools.partial(torch.nn.utils.rnn.pad_sequence, batch_first=True)
    want = torch.stack(hf_routing(hf_dir, [ids[i:i + 1] for i in range(2)])), pad(hf_routing(hf_dir, seqs))
    rec = RoutingRecorder(plan.spec.num_layers, model=model)
    E = plan.spec.num_experts
    shifted = [w % E + 1 for w in want]  # expert e -> e + 1 mod E, for every token and layer
    def forward(mbs):  # one call per micro-batch: a pipeline's micro-batches of one call share a shape
        return [(run_microbatches(model, [mb], forward_only=True) or [None])[0] for mb in mbs]  # None: not last

    with torch.no_grad():
        forward(routing_batches(ids, seqs, recorder=rec))
        plain = forward(routing_batches(ids, seqs))
        replayed = forward(routing_batches(ids, seqs, routed=shifted))
    got = [merge_stages(p, mesh) for p in rec.parts]  # padded (2, SEQ, ...); packed, unpacked (3, longest, ...)
    wrong = sum(int((g.sort(-1).values != w.sort(-1).values).any(-1).any(-1).sum()) for g, w in zip(got, want))
    diff, logits = torch.zeros(2, dtype=torch.float64), None
    if mesh.is_last_stage:
        logits = [gather_vocab_parallel(o["output"])[..., : plan.spec.vocab_size].double() for o in replayed]
        unreplayed = [gather_vocab_parallel(o["output"])[..., : plan.spec.vocab_size].double() for o in plain]
        diff[0] = max((x - y).abs().max() for x, y in zip(logits, ref)) if ref is not None else 0.0
        diff[1] = min((x - y).abs().max() for x, y in zip(logits, unreplayed))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return {"tokens_routed_unlike_transformers": wrong, "tokens": int(sum(s.shape[1] for s in seqs)) + ids.numel(),
            "replayed_vs_cp1": diff[0].item(), "replayed_vs_unreplayed": diff[1].item(),
            "smallest_topk_gap": hf_routing.min_gap}, logits


def recompute_grads(work, name, layout, recompute, backward_replay=True, context=True):
    """Every gradient of one DDP step (4 micro-batches of one padded row: several in flight at PP 2) of ``name``
    with full recompute (--gradient_checkpointing) or without. mixtral's routing is replayed: each token's
    transformers top-k moved to the next expert ids, which its recompute must route as its forward did;
    ``backward_replay=False`` withholds the replayed indices from the recompute, ``context=False`` runs megatron's
    checkpoint without the forward's context (``recompute_in_forward_context``): the negative controls."""
    from megatron.core import tensor_parallel

    from rlhf.models.ddp import wrap_ddp
    from rlhf.models.routing_replay import replay_routers

    tp, pp, cp, ep = layout
    hf_dir = os.path.join(work, "hf", name)
    plan = plan_hf_to_megatron(hf_dir, os.path.join(work, "mg", name) + "-unused", 1, 1, overwrite=True)
    moe = bool(plan.spec.num_experts)
    mesh = initialize_mesh(tp, pp, cp=cp, ep=ep)
    model = build_model(plan.spec, tp=tp, pp=pp, pp_rank=mesh.pp_rank, padded_vocab=plan.padded_vocab, ep=ep,
                        routing_replay=moe, recompute=recompute)
    load_model(model, os.path.join(work, "mg", name, "model"))
    model.config.calculate_per_token_loss = True
    ddp = wrap_ddp(model)
    replay_routers(ddp)
    ddp._rlhf_replay_recompute &= backward_replay
    rows = torch.randint(0, plan.spec.vocab_size, (4, 1, SEQ + 1), generator=torch.Generator().manual_seed(5))
    micro = [{"input_ids": r[:, :-1], "labels": r[:, 1:], "loss_mask": torch.ones_like(r[:, 1:])} for r in rows]
    if moe:
        for mb, w in zip(micro, hf_routing(hf_dir, [r[:, :-1] for r in rows])):
            mb["routed_experts"] = (w % plan.spec.num_experts + 1).unsqueeze(0)
    patched = tensor_parallel.checkpoint
    if not context:
        tensor_parallel.checkpoint = patched.rlhf_original
    try:
        run_microbatches(ddp, micro, loss_fn=token_loss)
    finally:
        tensor_parallel.checkpoint = patched
    grads = full_grads(ddp, mesh, plan.spec)
    del ddp, model
    return grads


RECOMPUTE_MODELS = ["llama-llama3", "mixtral"]


def recompute_checks(work, layout, refs):
    """CP (and PP) with --gradient_checkpointing against CP 1 without: every gradient, and the two controls."""
    names = RECOMPUTE_MODELS if layout[3] == 1 else ["mixtral"]  # expert parallelism: MoE only
    out = {name: rel_diff(recompute_grads(work, name, layout, True), refs[name]) for name in names}
    out["control_recompute_without_forward_context"] = rel_diff(
        recompute_grads(work, names[0], layout, True, context=False), refs[names[0]])
    if layout[1] > 1:  # micro-batches in flight: the recompute routes by itself
        out["control_recompute_without_replay"] = rel_diff(
            recompute_grads(work, "mixtral", layout, True, backward_replay=False), refs["mixtral"])
    return out


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
    results["routing/cp1"], routing_ref = routing_check(work, (1, 1, 1, 1))
    recompute_refs = {name: recompute_grads(work, name, (1, 1, 1, 1), False) for name in RECOMPUTE_MODELS}
    for layout in layouts:
        for name in MODELS:
            check(work, name, layout, results, refs)
        if layout[0] > 1:
            continue  # MoE trains at TP 1 (as in check)
        tag = f"routing/tp{layout[0]}pp{layout[1]}cp{layout[2]}" + (f"ep{layout[3]}" if layout[3] > 1 else "")
        results[tag] = routing_check(work, layout, routing_ref)[0]
        results[tag.replace("routing/", "recompute/")] = recompute_checks(work, layout, recompute_refs)
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
