"""Multi-rank checks of the Gated DeltaNet hybrids (qwen3_next), run by test_hybrid_equivalence.py:

    torchrun --nproc_per_node 2 tests/models/_hybrid_worker.py WORKDIR NAME [NAME ...]

For each tiny model WORKDIR/hf/NAME (transformers' own classes, rlhf.models.tiny.TINY_HYBRIDS): converts HF ->
megatron in-process at TP 2 and at PP 2, then (``layouts``)
* logits vs transformers (fp32, eager attention) at TP 1, TP 2 (MoE: sequence parallelism), PP 2 (each stage its
  slice of the layer pattern) and EP 2 (MoE) on 2 rows
  of SEQ tokens (two of the delta rule's 64-token chunks);
* one training step's loss and every gradient vs transformers' own backward at the same layouts (TP 1 and EP 2: DP 2;
  PP 2: two micro-batches through the pipeline schedule);
* packed micro-batches at the same layouts against the same sequences padded, with the controls: the delta rule's
  state, or the convolution's window, carried across the packed boundaries;
* controls at TP 1: the same logits with one term removed (CONTROLS), which must then differ from transformers;
* bf16 at TP 1: the distance of our logits, and of transformers' own bf16 forward, to the fp32 reference.
Rank 0 writes WORKDIR/result-<first NAME>.json. The families worker's helpers (tests/models/_families_worker.py) are
reused.
"""
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _families_worker import build, compare, convert, hf_model, hf_step, logits_of, max_over_ranks, our_step  # noqa
from _mp_equivalence import layout_name, progress  # noqa: E402

from rlhf.distributed import initialize_mesh  # noqa: E402
from rlhf.models.pipeline import gather_vocab_parallel, run_microbatches  # noqa: E402

SEQ = 80


def layouts(spec):
    """TP 1, TP 2 (sequence parallelism for MoE) and PP 2; EP 2 for MoE."""
    return [(1, 1, 1), (2, 1, 1), (1, 2, 1)] + ([(1, 1, 2)] if spec.num_experts else [])


def _zero(pattern):
    def apply(model):
        with torch.no_grad():
            hit = [p for n, p in model.named_parameters() if pattern in n]
            assert hit, pattern
            for p in hit:
                p.zero_()
    return apply


def _attention_gate_zeroed(model):
    """sigmoid(0) = 1/2 for every head: the gate rows of each KV group's ``[q | gate | k | v]`` set to zero."""
    spec = model.spec
    d, groups = spec.head_dim, spec.num_kv_heads
    per = spec.num_attention_heads // groups
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("linear_qkv.weight"):
                p.view(groups, (2 * per + 2) * d, -1)[:, per * d:2 * per * d].zero_()


def _conv_one_tap(model):
    """The convolution reduced to its current-token tap: what the short convolution adds is gone."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("conv1d.weight"):
                p[..., :-1].zero_()


CONTROLS = {"qwen3_next": {"attention_gate_zeroed": _attention_gate_zeroed, "dt_bias_zeroed": _zero("dt_bias"),
                           "deltanet_norm_zeroed": _zero("out_norm"), "conv_one_tap": _conv_one_tap,
                           "qk_norm_zeroed": _zero("k_layernorm")},
            "qwen3_5_text": {"attention_gate_zeroed": _attention_gate_zeroed, "dt_bias_zeroed": _zero("dt_bias")},
            "qwen3_next-moe": {"shared_expert_zeroed": _zero("shared_experts.linear_fc2"),
                               "shared_expert_gate_zeroed": _zero("shared_experts.gate_weight")},
            "qwen3_5_moe_text": {"shared_expert_gate_zeroed": _zero("shared_experts.gate_weight")}}


@contextlib.contextmanager
def no_reset(what):
    """The control of the packed check: the DeltaNet kernels called without the sequence boundaries."""
    from rlhf.kernels import gated_delta as gd

    name = {"state": "chunk_gated_delta_rule", "conv": "causal_conv1d"}[what]
    orig = getattr(gd, name)
    setattr(gd, name, lambda *a, cu_seqlens=None, **kw: orig(*a, **kw))
    try:
        yield
    finally:
        setattr(gd, name, orig)


def packed_check(plan, ckpt, tp, pp=1, ep=1, lengths=(7, 70, 1, 12)):
    """max |packed - padded| logits over sequences of ``lengths`` (packed: 90 tokens, two chunks; at PP 2 on the
    last stage); and the same with the state, and the convolution, not reset at the boundaries."""
    from rlhf.models.packing import make_packed_batch, split_packed

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, plan.spec.vocab_size, (len(lengths), max(lengths)), generator=g)
    mask = torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)
    ids = ids.masked_fill(~mask, 0)
    mesh, model = build(plan, ckpt, tp, pp, ep)
    padded = logits_of(model, mesh, plan, ids)
    mb = make_packed_batch(ids, mask)

    def packed_diff():
        with torch.no_grad():
            out = run_microbatches(model, [mb], forward_only=True)
        if not mesh.is_last_stage:
            return max_over_ranks(0.0)
        packed = gather_vocab_parallel(out[0]["output"])[..., : plan.spec.vocab_size].double()
        parts = split_packed(mb, packed)
        return max_over_ranks(max((padded[i, :n] - p).abs().max().item()
                                  for i, (n, p) in enumerate(zip(lengths, parts)) if n))

    out = {"packed": packed_diff()}
    for what in ("state", "conv"):
        with no_reset(what):
            out[f"{what}_not_reset"] = packed_diff()
    return out


def logits_check(work, name, plan, ckpt, results):
    ids = torch.randint(0, plan.spec.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(os.path.join(work, "hf", name))(input_ids=ids).logits.double()
    results[f"ref_scale/{name}"] = ref.abs().max().item()
    for tp, pp, ep in layouts(plan.spec):
        progress(f"logits {name} tp{tp} pp{pp} ep{ep}")
        mesh, model = build(plan, ckpt, tp, pp, ep)
        ours = logits_of(model, mesh, plan, ids)
        results[f"logits/{name}/{layout_name(tp, pp, ep)}"] = max_over_ranks(
            0.0 if ours is None else (ours - ref).abs().max().item())
        for key, v in packed_check(plan, ckpt, tp, pp, ep).items():
            results[f"{key}/{name}/{layout_name(tp, pp, ep)}"] = v
    # bf16 (TP 1): ours as close to the fp32 reference as transformers' own bf16 forward
    mesh, model = build(plan, ckpt, 1, 1, 1, params_dtype=torch.bfloat16, bf16=True)
    ours = logits_of(model, mesh, plan, ids)
    with torch.no_grad():
        hf16 = hf_model(os.path.join(work, "hf", name)).to(torch.bfloat16)(input_ids=ids).logits.double()
    results[f"bf16/{name}"] = {"ours": max_over_ranks((ours - ref).abs().max().item()),
                               "transformers": (hf16 - ref).abs().max().item()}
    for control, edit in CONTROLS.get(name, {}).items():
        mesh, model = build(plan, ckpt, 1, 1, 1)
        edit(model)
        ours = logits_of(model, mesh, plan, ids)
        results[f"control/{name}/{control}"] = max_over_ranks((ours - ref).abs().max().item())


def grad_check(work, name, plan, ckpt, results):
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, plan.spec.vocab_size, (2, 2, SEQ + 1), generator=g)
    box = [hf_step(work, name, data, plan.spec) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ref_loss, ref = box[0]
    for tp, pp, ep in layouts(plan.spec):
        progress(f"grads {name} tp{tp} pp{pp} ep{ep}")
        loss, grads = our_step(plan, ckpt, tp, pp, ep, data)
        results[f"grads/{name}/{layout_name(tp, pp, ep)}"] = {"loss": loss, "ref_loss": ref_loss,
                                                              **compare(grads, ref)}


def main():
    work, names = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    initialize_mesh(1, 1)
    results = {}
    for name in names:
        plan, ckpt = convert(work, name, 2, 1, 1)
        convert(work, name, 1, 2, 1)  # a second layout for the round trip
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
