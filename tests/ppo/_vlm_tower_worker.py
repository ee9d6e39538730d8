"""launch/ppo.py with a test hook (tests/ppo/test_vlm_dp.py): after each optimizer step of a vision-language actor,
this rank's vision tower as the step left it, to ``$RLHF_TEST_VLM_TOWER_DIR/step<N>_rank<R>.pt``.

    RLHF_TEST_VLM_TOWER_DIR=out/tower torchrun --nproc_per_node 2 tests/ppo/_vlm_tower_worker.py <ppo.py flags>

A record (``torch.load``): ``weights`` and ``grads`` (``visual.*`` by name: the parameters after the update and the
gradient the optimizer stepped with, after clipping: the DDP buffer's ``main_grad``, else ``.grad``), ``pixels`` (a
fingerprint of each image row the step's micro-batches carried: the sum of its patches' values and of their
squares), ``metrics`` (train_step's return), ``dp_rank``, ``step``. A megatron checkpoint holds one replica of a replicated tensor, so
it cannot show that the ranks' towers agree; this hook reads each rank's own."""
from __future__ import annotations

import os
import runpy
import sys

import torch

# this script runs launch/ppo.py and its vllm engines: forkrun's default_preload reads that line and preloads them
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from rlhf.runtime import role as engine  # noqa: E402

_train_step = engine.ModelRole.train_step


def _fingerprints(microbatches) -> list[tuple[float, float]]:
    out = []
    for mb in microbatches:
        if "pixel_values" not in mb:
            continue
        grids = mb["image_grid_thw"]
        for b in range(grids.shape[0]):
            n = int(grids[b].prod(-1).sum())
            if n:
                px = mb["pixel_values"][b, :n].double()
                out.append((round(px.sum().item(), 6), round((px * px).sum().item(), 6)))
    return out


def train_step(self, microbatches, loss_fn, metric_keys, output="head"):
    metrics = _train_step(self, microbatches, loss_fn, metric_keys, output)
    if self.spec.vision is not None:
        import torch.distributed as dist

        tower = [(n, p) for n, p in self.model.named_parameters() if n.startswith("visual.")]
        grad = {n: getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
                for n, p in tower}
        self._tower_steps = getattr(self, "_tower_steps", 0) + 1
        rec = {"weights": {n: p.detach().cpu().clone() for n, p in tower},
               "grads": {n: g.detach().cpu().clone() for n, g in grad.items() if g is not None},
               "pixels": _fingerprints(microbatches), "metrics": dict(metrics), "dp_rank": self.mesh.dp_rank,
               "step": self._tower_steps}
        folder = os.environ["RLHF_TEST_VLM_TOWER_DIR"]
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"step{self._tower_steps}_rank{dist.get_rank()}.pt")
        torch.save(rec, path + ".tmp")
        os.replace(path + ".tmp", path)
    return metrics


engine.ModelRole.train_step = train_step

if __name__ == "__main__":
    script = os.path.join(REPO, "launch", "ppo.py")
    sys.argv = [script, *sys.argv[1:]]
    runpy.run_path(script, run_name="__main__")
