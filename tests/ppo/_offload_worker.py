"""Offload/onload of real megatron engines at TP2, run by test_offload.py under

    torchrun --nproc_per_node 2 tests/ppo/_offload_worker.py HF_DIR OUT.json

For a trainable engine (fp32 + plain Adam, and bf16 + distributed optimizer, whose params are views into DDP's
param_data and whose fp32 main params are separate) and a frozen one: after a train step, snapshot every param,
grad and optimizer-state tensor; offload; check every storage is freed; onload; check bit-identity; then take a
second step and compare with a twin engine that never offloaded. Rank 0 writes {check: failure or ""} to OUT.json.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlhf.algo.losses import sft_loss  # noqa: E402
from rlhf.distributed import initialize_mesh  # noqa: E402
from rlhf.distributed.mesh import destroy_mesh  # noqa: E402
from rlhf.runtime.role import ModelRole, OptimConfig  # noqa: E402
from rlhf.runtime.offload import OffloadManager, torch_optimizers  # noqa: E402

RESULTS: dict[str, str] = {}


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS[name] = "" if ok else (detail or "failed")


def batches(vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 2, 16), generator=g)
    return [{"input_ids": x, "loss_mask": torch.ones_like(x), "attention_mask": torch.ones_like(x)} for x in ids]


def loss_fn(engine):
    def fn(batch, logits):
        return sft_loss(logits, batch["input_ids"], batch["loss_mask"], tp_group=engine.mesh.tp_group,
                        vocab_size=engine.spec.vocab_size)
    return fn


def tensors(engine) -> dict[str, torch.Tensor]:
    """Everything an offload must free, found independently of rlhf.runtime.offload: params, main_grads, DDP buffers,
    and each inner optimizer's param groups and state."""
    out = {}
    for n, p in engine.model.named_parameters():
        out[f"param/{n}"] = p
        if getattr(p, "main_grad", None) is not None:
            out[f"main_grad/{n}"] = p.main_grad
    if engine.ddp is not None:
        for i, buf in enumerate(engine.ddp.buffers):
            out[f"grad_data/{i}"] = buf.grad_data
            if buf.param_data is not None:
                out[f"param_data/{i}"] = buf.param_data
    if engine.optimizer is not None:
        for j, opt in enumerate(getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])):
            for g, group in enumerate(opt.optimizer.param_groups):
                for k, p in enumerate(group["params"]):
                    out[f"opt{j}/main{g}.{k}"] = p
                    for key, v in opt.optimizer.state.get(p, {}).items():
                        if isinstance(v, torch.Tensor):
                            out[f"opt{j}/state{g}.{k}/{key}"] = v
    return out


def is_grad(key: str) -> bool:
    return key.startswith(("main_grad/", "grad_data/"))


def cycle_checks(tag: str, engine, man: OffloadManager) -> None:
    """Params and optimizer states come back bit for bit; grads (dropped, not copied) come back as zeros."""
    live = tensors(engine)
    snap = {k: t.detach().clone() for k, t in live.items()}
    check(f"{tag}/grads_nonzero_before", engine.optimizer is None or any(
        t.abs().sum() > 0 for k, t in live.items() if is_grad(k)))
    n_state = sum("/state" in k for k in live)
    check(f"{tag}/found_optimizer_state", engine.optimizer is None or n_state > 0, f"{n_state} state tensors")
    before = man.bytes_on_device()
    check(f"{tag}/bytes_on_device_positive", before > 0, str(before))

    moved = man.offload()
    check(f"{tag}/offload_moves_all", moved == before, f"moved {moved} of {before}")
    kept = [k for k, t in live.items() if t.untyped_storage().nbytes() != 0]
    check(f"{tag}/storages_released", not kept, f"still allocated: {kept[:5]}")
    check(f"{tag}/bytes_on_device_zero", man.bytes_on_device() == 0, str(man.bytes_on_device()))
    check(f"{tag}/state_off", man.state == {"params": False, "grads": False, "optimizer": False}, str(man.state))
    check(f"{tag}/offload_idempotent", man.offload() == 0)
    host_ptrs = {k: v.data_ptr() for k, v in man._host.items()}

    man.onload()
    check(f"{tag}/onload_idempotent", man.onload() == 0)
    diff = [k for k, t in live.items() if not is_grad(k) and not torch.equal(t, snap[k])]
    check(f"{tag}/bit_identical", not diff, f"differ: {diff[:5]}")
    nonzero = [k for k, t in live.items() if is_grad(k) and t.abs().sum() != 0]
    check(f"{tag}/grads_zero_after", not nonzero, f"non-zero: {nonzero[:5]}")
    check(f"{tag}/no_host_copy_of_grads", len(man._host) == len(man.storages()["params"]) + len(
        man.storages()["optimizer"]), f"{len(man._host)} host buffers")
    check(f"{tag}/bytes_restored", man.bytes_on_device() == before, f"{man.bytes_on_device()} vs {before}")

    # Partial: keep params, move grads + optimizer (adam_offload during experience making).
    man.offload(params=False)
    params_bytes = sum(s.nbytes() for s in man.storages()["params"])
    check(f"{tag}/partial_state", man.state == {"params": True, "grads": False, "optimizer": False}, str(man.state))
    check(f"{tag}/partial_bytes", man.bytes_on_device() == params_bytes and params_bytes > 0,
          f"{man.bytes_on_device()} vs params {params_bytes}")
    man.offload()
    man.onload()
    check(f"{tag}/host_buffers_reused", {k: v.data_ptr() for k, v in man._host.items()} == host_ptrs)
    diff = [k for k, t in live.items() if not is_grad(k) and not torch.equal(t, snap[k])]
    check(f"{tag}/bit_identical_after_partial", not diff, f"differ: {diff[:5]}")


def trainable(mesh, hf_dir: str, tag: str, bf16: bool, dist_opt: bool) -> None:
    optim = OptimConfig(lr=1e-3, warmup_ratio=0.0, use_distributed_optimizer=dist_opt, total_steps=4)
    cycled = ModelRole(mesh, hf_dir, optim=optim, bf16=bf16, name=f"actor-{tag}")
    twin = ModelRole(mesh, hf_dir, optim=optim, bf16=bf16, name=f"twin-{tag}")
    b1, b2 = batches(cycled.spec.vocab_size, 1), batches(cycled.spec.vocab_size, 2)
    m1 = cycled.train_step(b1, loss_fn(cycled), ["loss"])
    t1 = twin.train_step(b1, loss_fn(twin), ["loss"])
    check(f"{tag}/twins_agree_before", m1 == t1, f"{m1} vs {t1}")
    check(f"{tag}/views_into_param_data", not dist_opt or all(
        p.untyped_storage()._cdata == cycled.ddp.buffers[0].param_data.untyped_storage()._cdata
        for p in cycled.ddp.buffers[0].params))
    man = OffloadManager(cycled)
    if bf16:  # mixed precision: the optimizer's fp32 main params are storages of their own, moved with it
        mains = [p for opt in torch_optimizers(cycled.optimizer) for g in opt.param_groups for p in g["params"]]
        owned = {s._cdata for s in man.storages()["optimizer"]}
        check(f"{tag}/fp32_main_params_moved_with_optimizer", bool(mains) and all(
            p.dtype == torch.float32 and p.untyped_storage()._cdata in owned for p in mains))
    cycle_checks(tag, cycled, man)
    m2 = cycled.train_step(b2, loss_fn(cycled), ["loss"])
    t2 = twin.train_step(b2, loss_fn(twin), ["loss"])
    check(f"{tag}/second_step_metrics_equal", m2 == t2, f"{m2} vs {t2}")
    a, b = tensors(cycled), tensors(twin)
    diff = [k for k in a if k.startswith(("param/", "opt")) and not torch.equal(a[k], b[k])]
    check(f"{tag}/second_step_weights_equal", not diff and len(a) == len(b), f"differ: {diff[:5]}")


def frozen(mesh, hf_dir: str) -> None:
    ref = ModelRole(mesh, hf_dir, name="ref")
    mb = batches(ref.spec.vocab_size, 3)
    out0 = ref.forward(mb)[0]["output"].clone()
    man = OffloadManager(ref)
    cycle_checks("frozen", ref, man)
    check("frozen/forward_equal", torch.equal(ref.forward(mb)[0]["output"], out0))


def main() -> None:
    hf_dir, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    mesh = initialize_mesh(2, 1)
    trainable(mesh, hf_dir, "fp32", bf16=False, dist_opt=False)
    trainable(mesh, hf_dir, "bf16_distopt", bf16=True, dist_opt=True)
    frozen(mesh, hf_dir)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, RESULTS)
    if dist.get_rank() == 0:
        merged = {k: "; ".join(f"rank{r}: {g[k]}" for r, g in enumerate(gathered) if g.get(k)) for k in RESULTS}
        with open(out, "w") as f:
            json.dump(merged, f, indent=1)
    destroy_mesh()


if __name__ == "__main__":
    main()
