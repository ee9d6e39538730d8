"""--packing_samples vs padded micro-batches: one SFT and one RM training step, run by test_packing_samples.py.

    torchrun --nproc_per_node 2 tests/train/_packing_equiv_worker.py MODEL SFT_JSONL RM_JSONL OUT_JSON [tp1,tp2,pp2]

For each layout and task, two engines load the same weights; one steps on padded micro-batches, the other on
the same samples packed, both built by ``rlhf.supervised.loop.make_microbatches`` and scored by the task's own loss
(as the trainer does). No gradient clipping, so the gradients are compared raw; a large Adam eps keeps the
step close to lr * gradient, so the weights after it compare tightly too. Rank 0 writes the worst
differences over ranks: the step's loss, every gradient (relative to its largest entry) and every weight
after the Adam step. tp1 with 2 ranks is DP2; pp2 fills the packed rows to one length (dummy sequences) and
pads the padded micro-batches to one width.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlhf.supervised import rm  # noqa: E402
from rlhf.supervised import sft
from rlhf.distributed import destroy_mesh, initialize_mesh  # noqa: E402
from rlhf.runtime.role import ModelRole, OptimConfig  # noqa: E402
from rlhf.supervised.loop import make_microbatches  # noqa: E402

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
SAMPLES_PER_RANK, PER_MICROBATCH = 6, 3


def load_samples(task_mod, model: str, data: str, tokenizer) -> list:
    p = argparse.ArgumentParser()
    task_mod.add_args(p)
    args = p.parse_args(["--pretrain", model, "--dataset", data, "--save_path", "unused", "--max_len", "64"])
    from rlhf.supervised.loop import build_job

    task = task_mod.TASK()
    train, _, _ = task.load_data(build_job(args, task), tokenizer)
    return train


def step(mesh, model: str, task, groups: list, tokenizer, packing: bool):
    """One optimizer step; returns (loss, {name: grad}, {name: weight after the step}, micro-batches)."""
    # adam_eps=1: Adam's first step is lr * g / (|g| + eps); with the usual tiny eps that is lr * sign(g), which
    # turns rounding noise in near-zero gradients into full-size weight differences. eps=1 keeps it ~ lr * g.
    optim = OptimConfig(lr=1e-2, warmup_ratio=0.0, scheduler="constant", clip_grad=0.0, adam_eps=1.0,
                        total_steps=1)
    engine = ModelRole(mesh, model, optim=optim, value_head=task.value_head, name=task.name)
    mbs = make_microbatches(task, groups, tokenizer, packing=packing, same_shape=mesh.pp > 1)
    m = engine.train_step(mbs, task.loss_fn(engine), task.metric_keys, output=task.output)
    grads = {n: p.main_grad.detach().clone() for n, p in engine.model.named_parameters()}
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    return m["loss"], grads, weights, mbs


def compare(mesh, model: str, task_mod, data: str, tokenizer) -> dict:
    task = task_mod.TASK()
    samples = load_samples(task_mod, model, data, tokenizer)
    mine = samples[mesh.dp_rank * SAMPLES_PER_RANK:(mesh.dp_rank + 1) * SAMPLES_PER_RANK]
    groups = [mine[i:i + PER_MICROBATCH] for i in range(0, len(mine), PER_MICROBATCH)]
    loss_ref, g_ref, w_ref, padded = step(mesh, model, task, groups, tokenizer, packing=False)
    loss, g, w, packed = step(mesh, model, task, groups, tokenizer, packing=True)
    assert all(mb["input_ids"].shape[0] == 1 and "attention_mask" not in mb for mb in packed)
    real = sum(int(mb["attention_mask"].sum()) for mb in padded)
    rel = {k: (g[k] - g_ref[k]).abs().max().item() / (g_ref[k].abs().max().item() + 1e-30) for k in g_ref}
    return {
        "loss": loss_ref,
        "loss_rel_diff": abs(loss - loss_ref) / abs(loss_ref),
        "grad_max_rel_diff": max(rel.values()),
        "grad_worst_param": max(rel, key=rel.get),
        "grad_min_ref_norm": min(t.norm().item() for t in g_ref.values()),  # every parameter got a gradient
        "weight_max_abs_diff": max((w[k] - w_ref[k]).abs().max().item() for k in w_ref),
        "padding_frac": 1 - real / sum(mb["input_ids"].numel() for mb in padded),
        "packed_tokens": sum(mb["input_ids"].shape[1] for mb in packed),
        "real_tokens": real,
    }


def main() -> None:
    model, sft_data, rm_data, out = sys.argv[1:5]
    layouts = sys.argv[5].split(",") if len(sys.argv) > 5 else list(LAYOUTS)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    results: dict = {}
    for layout in layouts:
        mesh = initialize_mesh(*LAYOUTS[layout])
        mine = {"sft": compare(mesh, model, sft, sft_data, tokenizer),
                "rm": compare(mesh, model, rm, rm_data, tokenizer)}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        for d in gathered:  # the worst over ranks (each rank compares its own shards / stage / data)
            for name, vals in d.items():
                r = results.setdefault(f"{layout}/{name}", {})
                for k, v in vals.items():
                    best = min if k.endswith("min_ref_norm") else max
                    r[k] = best(r[k], v) if k in r and not isinstance(v, str) else r.get(k, v)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
    dist.barrier()
    destroy_mesh()


if __name__ == "__main__":
    main()
