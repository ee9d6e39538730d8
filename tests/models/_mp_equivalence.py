"""Multi-rank checks run under ``torchrun --nproc_per_node 4`` by test_parallel_equivalence.py.

    torchrun --nproc_per_node 4 tests/models/_mp_equivalence.py WORKDIR

For each tiny model (llama, qwen2, mistral x CausalLM / SequenceClassification, and the scaled-RoPE, qwen3 and
one-KV-head models of conftest.EXTRA_MODELS) it converts HF -> Megatron
in-process at TP2xPP2, then loads the checkpoint at TP1 (DP4), TP2 (DP2xTP2), PP2 (DP2xPP2) and TP2xPP2 and
compares the forward with transformers. Then, for GRAD_MODELS, it compares loss and every
gradient of one training step at each layout with the single-rank run. Rank 0 writes WORKDIR/result.json.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlhf.models.convert import hf_to_megatron_rank, plan_hf_to_megatron  # noqa: E402
from rlhf.distributed import initialize_mesh  # noqa: E402
from rlhf.models.checkpoint_io import load_model  # noqa: E402
from rlhf.models.gpt import build_model  # noqa: E402
from rlhf.models.hf_llama import full_from_tp_shards, hf_from_megatron, tp_partition_dim  # noqa: E402
from rlhf.models.pipeline import gather_vocab_parallel, run_microbatches  # noqa: E402

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp) on 4 ranks: DP4, DP2xTP2, DP2xPP2, TP2xPP2
# MoE (tp, pp, ep): converted at TP2xEP2, loaded at DP4, EP2, EP4, TP2xEP2, PP2xEP2; trained at TP 2 x EP 2 too
# (sequence parallelism: rlhf.models.sequence_parallel).
MOE_LAYOUTS = [(1, 1, 1), (1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2)]
MOE_GRAD_LAYOUTS = [(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 2, 2), (2, 1, 2)]
MODELS = ["llama", "llama-cls", "qwen2", "qwen2-cls", "mistral", "mistral-cls",
          # conftest.EXTRA_MODELS: scaled RoPE, qwen3, one KV head (replicated over TP)
          "llama-llama3", "llama-linear", "qwen2-yarn", "qwen3", "qwen3-cls", "llama-kv1", "mixtral", "qwen3_moe"]
GRAD_MODELS = ["llama", "mistral", "qwen3", "llama-kv1", "mixtral", "qwen3_moe"]


def progress(msg):
    if os.environ.get("RLHF_TEST_VERBOSE"):
        print(f"[rank{dist.get_rank()}] {msg}", file=sys.stderr, flush=True)


def hf_reference(hf_dir, is_seq_cls, ids):
    import transformers

    if is_seq_cls:
        m = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            return m.score(m.model(input_ids=ids).last_hidden_state).squeeze(-1)
    m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(input_ids=ids).logits


def layouts(spec, grads=False):
    if spec.num_experts:
        return MOE_GRAD_LAYOUTS if grads else MOE_LAYOUTS
    return [(tp, pp, 1) for tp, pp in LAYOUTS]


def logits_check(work, name, results):
    hf_dir = os.path.join(work, "hf", name)
    ckpt = os.path.join(work, "mg", name)
    plan = plan_hf_to_megatron(hf_dir, ckpt, 2, 2, overwrite=True)
    if plan.spec.num_experts:  # experts spread over 2 ranks in the checkpoint
        plan = plan_hf_to_megatron(hf_dir, ckpt, 2, 1, overwrite=True, ep=2)
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(ckpt, "model"), exist_ok=True)
    dist.barrier()
    progress(f"convert {name}")
    hf_to_megatron_rank(plan, ckpt)
    ids = torch.randint(0, plan.spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = hf_reference(hf_dir, plan.spec.is_seq_cls, ids)
    for tp, pp, ep in layouts(plan.spec):
        progress(f"logits {name} tp{tp} pp{pp} ep{ep}")
        mesh = initialize_mesh(tp, pp, ep=ep)
        model = build_model(plan.spec, tp=tp, pp=pp, pp_rank=mesh.pp_rank, padded_vocab=plan.padded_vocab, ep=ep)
        load_model(model, os.path.join(ckpt, "model"))
        model.eval()
        with torch.no_grad():
            out = run_microbatches(model, [{"input_ids": ids}], forward_only=True)
        diff = torch.zeros(1, dtype=torch.float64)
        if mesh.is_last_stage:
            ours = out[0]["output"]
            if not plan.spec.is_seq_cls:
                ours = gather_vocab_parallel(ours)[..., : plan.spec.vocab_size]
            diff[0] = (ours.double() - ref.double()).abs().max()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        results[f"logits/{name}/{layout_name(tp, pp, ep)}"] = diff.item()


def layout_name(tp, pp, ep):
    return f"tp{tp}pp{pp}" + (f"ep{ep}" if ep > 1 else "")


def lm_loss(batch, logits):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    labels = batch["labels"]  # (B, S)
    loss = vocab_parallel_cross_entropy(logits.float().transpose(0, 1).contiguous(), labels.transpose(0, 1).contiguous())
    return loss.mean(), {}


def full_grads(model, mesh, spec):
    """{hf_name: grad} of the whole model, gathered over TP (experts: over the expert-TP group, which is TP's but
    for biased experts, held whole), PP and EP, on every rank."""
    from megatron.core import parallel_state as ps

    from rlhf.models.hf_llama import is_expert_param

    local = {}
    layer_offset = mesh.pp_rank * (spec.num_layers // mesh.pp)
    expert_offset = mesh.ep_rank * (spec.num_experts // mesh.ep) if spec.num_experts else 0
    etp_group, etp = ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size()
    # DP replicas hold equal (all-reduced) grads: the dense ones from DP rank 0, the experts from each EP rank's
    # first expert-DP replica (with EP carved out of DP, DP ranks 0 .. ep-1)
    send_dense = mesh.tp_rank == 0 and mesh.dp_rank == 0
    send_experts = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    for name, p in model.module.named_parameters():
        expert = is_expert_param(name)
        g = p.main_grad.detach().clone()
        group, size = (etp_group, etp) if expert else (mesh.tp_group, mesh.tp)
        shards = [torch.empty_like(g) for _ in range(size)]
        dist.all_gather(shards, g.contiguous(), group=group)
        full = full_from_tp_shards(name, shards, tp_partition_dim(p), spec)
        if name == "output_layer.weight" and spec.tie_word_embeddings:
            continue  # the last stage's copy of a tied embedding: its grad is summed into the embedding's
        if not (send_experts if expert else send_dense):
            continue
        for hf_name, t in hf_from_megatron(name, full, spec, layer_offset=layer_offset, expert_offset=expert_offset):
            local[hf_name] = t.clone()
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    merged = {}
    for d in everything:
        merged.update(d)
    return merged


def grad_check(work, name, results):
    from rlhf.models.ddp import wrap_ddp

    ckpt = os.path.join(work, "mg", name)
    plan = plan_hf_to_megatron(os.path.join(work, "hf", name), ckpt + "-unused", 1, 1, overwrite=True)
    g = torch.Generator().manual_seed(2)
    n_micro_global, mbs, seq = 4, 2, 16
    data = torch.randint(0, plan.spec.vocab_size, (n_micro_global, mbs, seq + 1), generator=g)
    ref_loss, ref_grads = None, None
    for tp, pp, ep in layouts(plan.spec, grads=True):
        progress(f"grads {name} tp{tp} pp{pp} ep{ep}")
        mesh = initialize_mesh(tp, pp, ep=ep)
        model = build_model(plan.spec, tp=tp, pp=pp, pp_rank=mesh.pp_rank, padded_vocab=plan.padded_vocab, ep=ep)
        load_model(model, os.path.join(ckpt, "model"))
        ddp = wrap_ddp(model)
        ddp.zero_grad_buffer()
        per_dp = n_micro_global // mesh.dp
        mine = data[mesh.dp_rank * per_dp:(mesh.dp_rank + 1) * per_dp]
        micro = [{"input_ids": x[:, :-1], "labels": x[:, 1:]} for x in mine]
        run_microbatches(ddp, micro, loss_fn=lm_loss)
        # The schedule does not hand back the loss value: recompute it forward-only on the trained weights'
        # pre-step state (no optimizer step was taken, so the weights are unchanged).
        with torch.no_grad():
            fo = run_microbatches(ddp, micro, forward_only=True)
        loss = torch.zeros(1, dtype=torch.float64)
        if mesh.is_last_stage:  # every TP rank joins the vocab-parallel loss; one of them reports it
            vals = [lm_loss(m, o["output"])[0].item() for m, o in zip(micro, fo)]
            loss[0] = sum(vals) / len(vals) / mesh.dp if mesh.tp_rank == 0 else 0.0
        dist.all_reduce(loss)
        loss = loss.item()
        grads = full_grads(ddp, mesh, plan.spec)
        if ref_grads is None:
            assert (tp, pp, ep) == (1, 1, 1)
            # single-rank reference: every rank's DP4 model equals the unsharded model; recompute locally on
            # the whole global batch without any collective, to be independent of DDP.
            ref_loss, ref_grads = single_rank_reference(plan, ckpt, data)
        gdiff = max((grads[k] - ref_grads[k]).abs().max().item() / (ref_grads[k].abs().max().item() + 1e-12)
                    for k in ref_grads)
        missing = sorted(set(ref_grads) ^ set(grads))
        results[f"grads/{name}/{layout_name(tp, pp, ep)}"] = {"loss": loss, "ref_loss": ref_loss, "max_rel_grad_diff": gdiff,
                                                 "mismatched_names": missing, "dp": mesh.dp,
                                                 # bucket groups whose all-reduce went through shared memory
                                                 "shm_bucket_groups": sum(hasattr(bg, "_shm_reducer")
                                                                          for bg in ddp.bucket_groups)}
        del ddp, model


def single_rank_reference(plan, ckpt, data):
    """Loss and grads of the whole global batch on an unsharded model (TP1 PP1), no DDP, no collectives."""
    from megatron.core import parallel_state as ps

    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_pipeline_model_parallel_world_size() == 1
    model = build_model(plan.spec, tp=1, pp=1, pp_rank=0, padded_vocab=plan.padded_vocab)
    load_model(model, os.path.join(ckpt, "model"))
    losses = []
    for x in data:
        logits = model(x[:, :-1])
        loss, _ = lm_loss({"labels": x[:, 1:]}, logits)
        (loss / len(data)).backward()
        losses.append(loss.item())
    grads = {}
    for name, p in model.named_parameters():
        for hf_name, t in hf_from_megatron(name, p.grad.detach(), plan.spec):
            grads[hf_name] = t.clone()
    return sum(losses) / len(losses), grads


def main():
    work = sys.argv[1]
    torch.set_num_threads(1)
    initialize_mesh(1, 1)
    results = {}
    for name in MODELS:
        logits_check(work, name, results)
    for name in GRAD_MODELS:  # untied, tied (mistral is generated tied), q/k norms, a replicated KV head
        grad_check(work, name, results)
    if dist.get_rank() == 0:
        with open(os.path.join(work, "result.json"), "w") as f:
            json.dump(results, f, indent=2)
    dist.barrier()
    from rlhf.distributed.mesh import destroy_mesh

    destroy_mesh()


if __name__ == "__main__":
    main()
