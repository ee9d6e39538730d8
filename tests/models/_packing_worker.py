"""Packed (THD, padding-free) vs padded forward/backward of the megatron model, run by test_packing.py.

    torchrun --nproc_per_node 2 tests/models/_packing_worker.py WORKDIR [tp1,tp2,pp2]
    torchrun --nproc_per_node 1 tests/models/_packing_worker.py WORKDIR tp1

WORKDIR holds the tiny HF models of tests/models/conftest.py (hf/llama, hf/llama-cls, hf/mistral). For each
layout the same model instance runs a padded batch (right padding, causal mask) and the same sequences
packed, through ``run_microbatches``; rank 0 writes WORKDIR/packing_<layouts>.json with the largest
differences of per-token log-probs (or values), losses and every parameter gradient. At tp1 with 2 ranks
(DP2) the checks are split between the ranks; nothing in them communicates.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import rlhf.kernels as kernels  # noqa: E402
from rlhf.models.convert import fill_from_hf  # noqa: E402
from rlhf.distributed import destroy_mesh, initialize_mesh  # noqa: E402
from rlhf.models import gpt  # noqa: E402
from rlhf.models.packing import make_packed_batch, split_packed  # noqa: E402
from rlhf.models.pipeline import run_microbatches  # noqa: E402
from rlhf.models.spec import load_hf_config, padded_vocab_size, spec_from_hf_config  # noqa: E402

LENGTHS = [7, 19, 1, 26, 0, 12, 3]  # one empty row: packs to an empty sequence
LENGTHS_PP = [[9, 21, 4, 0], [30, 2, 11, 6]]  # different token counts; same [B, L] when padded (PP)


def load(work, name, mesh, value_head=False):
    hf_dir = os.path.join(work, "hf", name)
    spec = spec_from_hf_config(load_hf_config(hf_dir))
    pv = padded_vocab_size(spec.vocab_size)
    model = gpt.build_model(spec, tp=mesh.tp, pp=mesh.pp, pp_rank=mesh.pp_rank, padded_vocab=pv,
                            value_head=value_head)
    fill_from_hf(model, hf_dir, spec, pv, tp=mesh.tp, pp=mesh.pp, tp_rank=mesh.tp_rank, pp_rank=mesh.pp_rank)
    return spec, model


def padded_batch(lengths, vocab, seed, width=None):
    """Right-padded ids (B, L), mask (B, L) bool, per-token loss weights (B, L)."""
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=g)
    mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)
    ids = ids.masked_fill(~mask, 0)  # pad id 0; the causal mask keeps padding out of real tokens
    weights = torch.rand(len(lengths), width, generator=g) + 0.5
    return ids, mask, weights


def padded_mb(ids, mask, weights):
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    valid = torch.zeros_like(mask)
    valid[:, :-1] = mask[:, 1:]  # right padding: token t has a next token iff t + 1 is real
    return {"input_ids": ids, "targets": targets, "valid": valid, "weights": weights, "real": mask}


def packed_mb(ids, mask, weights, pad_to=None):
    mb = make_packed_batch(ids, mask, pad_to=pad_to, per_token={"weights": weights})
    targets, valid = kernels.packed_next_tokens(mb["input_ids"][0], mb["packed_seq_params"].cu_seqlens_q)
    real = torch.arange(targets.shape[0]) < mb["num_tokens"]  # dummy padding (pad_to) carries no loss
    mb.update(targets=targets.unsqueeze(0), valid=(valid & real).unsqueeze(0), real=real.unsqueeze(0))
    return mb


def make_loss(mesh, spec, value_head):
    tp_group = mesh.tp_group if mesh.tp > 1 else None

    def loss_fn(batch, out):
        if value_head:  # out (B, S) values
            per_token = out.float() * batch["real"]
            return (per_token * batch["weights"]).sum(), {"out": per_token.detach()}
        lp = kernels.token_logprobs(out.float(), batch["targets"], tp_group=tp_group, vocab_size=spec.vocab_size)
        lp = lp * batch["valid"]  # (B, S): sum of next-token log-probs, weighted
        return (lp * batch["weights"]).sum(), {"out": lp.detach()}

    return loss_fn


def grads_and_zero(model):
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.grad.detach().clone()
        p.grad = None
    return out


def compare(model, loss_fn, padded, packed):
    """Max diffs between the padded and packed runs: per-token outputs, loss, every gradient (relative)."""
    res = {}
    ref = run_microbatches(model, padded, loss_fn=loss_fn)
    g_ref = grads_and_zero(model)
    got = run_microbatches(model, packed, loss_fn=loss_fn)
    g_got = grads_and_zero(model)
    out_diff = loss_diff = 0.0
    for r, o, pb, mb in zip(ref, got, padded, packed):  # empty lists off the last stage
        seqs = split_packed(mb, o["out"])
        for i, s in enumerate(seqs):
            row = r["out"][i, : s.shape[0]]
            assert bool(pb["real"][i, : s.shape[0]].all()) and not bool(pb["real"][i, s.shape[0]:].any())
            out_diff = max(out_diff, (row - s).abs().max().item() if s.numel() else 0.0)
        loss_diff = max(loss_diff, abs(r["out"].double().sum().item() - o["out"].double().sum().item()))
    res["out_max_abs_diff"] = out_diff
    res["loss_abs_diff"] = loss_diff
    res["grad_max_rel_diff"] = max((g_got[k] - g_ref[k]).abs().max().item() / (g_ref[k].abs().max().item() + 1e-30)
                                   for k in g_ref)
    res["grad_min_ref_norm"] = min(g.norm().item() for g in g_ref.values())  # all gradients are non-trivial
    res["num_params"] = len(g_ref)
    return res


def check_model(work, mesh, name, value_head, pad_to=None, lengths=LENGTHS):
    spec, model = load(work, name, mesh, value_head=value_head)
    loss_fn = make_loss(mesh, spec, value_head)
    mbs = lengths if isinstance(lengths[0], list) else [lengths]
    width = max(max(ls) for ls in mbs)
    data = [padded_batch(ls, spec.vocab_size, seed=10 + i, width=width) for i, ls in enumerate(mbs)]
    return compare(model, loss_fn, [padded_mb(*d) for d in data], [packed_mb(*d, pad_to=pad_to) for d in data])


def check_list_input_and_errors(work, mesh):
    """Sequences given as a list; the unpacked path unchanged bit for bit; the ValueErrors of packed mode."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    res = {}
    spec, model = load(work, "llama", mesh)
    ids, mask, _ = padded_batch(LENGTHS, spec.vocab_size, seed=3)
    model.eval()
    with torch.no_grad():
        ref = model(ids)  # (B, L, V)
        mb = make_packed_batch([row[m] for row, m in zip(ids, mask)])
        out = model(mb["input_ids"], mb["position_ids"], packed_seq_params=mb["packed_seq_params"])
        res["list_input_max_abs_diff"] = max(
            (ref[i, : s.shape[0]] - s).abs().max().item() for i, s in enumerate(split_packed(mb, out)) if s.numel())
        # The same weights under megatron's plain local spec: the unpacked path must not change at all.
        orig = gpt.layer_spec
        gpt.layer_spec = lambda config, spec, use_te=None: get_gpt_layer_local_spec(
            normalization="RMSNorm", qk_layernorm=spec.qk_norm)
        try:
            _, plain = load(work, "llama", mesh)
        finally:
            gpt.layer_spec = orig
        plain.eval()
        res["unpacked_bit_identical"] = bool(torch.equal(plain(ids), ref))
        # An over-estimated max_seqlen equal to T would make megatron's THD RoPE use absolute positions.
        bad = make_packed_batch([row[m] for row, m in zip(ids, mask)])
        t = bad["input_ids"].shape[1]
        bad["packed_seq_params"].max_seqlen_q = bad["packed_seq_params"].max_seqlen_kv = t
        res["max_seqlen_eq_T_error"] = _error(lambda: model(bad["input_ids"], bad["position_ids"],
                                                            packed_seq_params=bad["packed_seq_params"]))
        # mistral (window 8): packed sequences longer than the window are refused, shorter ones are exact.
        mspec, mistral = load(work, "mistral", mesh)
        mistral.eval()
        ids, mask, _ = padded_batch(LENGTHS, mspec.vocab_size, seed=4)
        mb = make_packed_batch(ids, mask)
        res["sliding_window_error"] = _error(lambda: mistral(mb["input_ids"], mb["position_ids"],
                                                             packed_seq_params=mb["packed_seq_params"]))
        short = [min(n, 8) for n in LENGTHS]
        ids, mask, _ = padded_batch(short, mspec.vocab_size, seed=5)
        ref = mistral(ids)
        mb = make_packed_batch(ids, mask)
        out = mistral(mb["input_ids"], mb["position_ids"], packed_seq_params=mb["packed_seq_params"])
        res["short_window_max_abs_diff"] = max(
            (ref[i, : s.shape[0]] - s).abs().max().item() for i, s in enumerate(split_packed(mb, out)) if s.numel())
    return res


def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def run_layout(work, layout, results):
    tp, pp = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}[layout]
    mesh = initialize_mesh(tp, pp)
    world = dist.get_world_size()
    if layout == "tp1":  # DP = world: spread the independent checks over the ranks
        checks = [("lm", lambda: check_model(work, mesh, "llama", False)),
                  ("value", lambda: check_model(work, mesh, "llama-cls", True)),
                  ("misc", lambda: check_list_input_and_errors(work, mesh))]
        mine = {k: fn() for i, (k, fn) in enumerate(checks) if i % world == dist.get_rank()}
    elif layout == "tp2":
        mine = {"lm": check_model(work, mesh, "llama", False), "value": check_model(work, mesh, "llama-cls", True)}
    else:  # PP2: every micro-batch padded to one fixed T, with dummy trailing sequences
        pad_to = max(sum(ls) for ls in LENGTHS_PP) + 37
        mine = {"lm": check_model(work, mesh, "llama", False, pad_to=pad_to, lengths=LENGTHS_PP),
                "value": check_model(work, mesh, "llama-cls", True, pad_to=pad_to, lengths=LENGTHS_PP)}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    for rank, d in enumerate(gathered):
        for check, vals in d.items():
            for k, v in vals.items():
                key = f"{layout}/{check}/{k}"
                if isinstance(v, float):  # the worst over ranks (each rank compares its own shards/stage)
                    results[key] = max(results.get(key, 0.0), v) if "min_ref" not in k else min(
                        results.get(key, float("inf")), v)
                else:
                    results.setdefault(key, v)


def main():
    work = sys.argv[1]
    layouts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["tp1", "tp2", "pp2"]
    torch.set_num_threads(1)
    results = {}
    for layout in layouts:
        run_layout(work, layout, results)
    if dist.get_rank() == 0:
        with open(os.path.join(work, f"packing_{'_'.join(layouts)}.json"), "w") as f:
            json.dump(results, f, indent=2)
    dist.barrier()
    destroy_mesh()


if __name__ == "__main__":
    main()
