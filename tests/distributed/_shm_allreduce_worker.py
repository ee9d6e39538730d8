"""Run under torchrun (2 or 3 ranks, gloo) by test_shm_allreduce.py: the shared-memory all-reduce against gloo's and
a hand sum, across chunk boundaries and dtypes; its fallbacks. Rank 0 writes a JSON of named checks to argv[1]."""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlhf.distributed import shm_allreduce as S  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    checks: dict[str, bool] = {}
    checks["disabled_by_env"] = _env_reason() == f"{S.ENV}=0"
    solo = dist.new_group([0])  # every rank takes part in new_group
    checks["one_rank_kept"] = r != 0 or S.why_not(solo) == "one rank"
    red = S.for_group(dist.group.WORLD)
    checks["made"] = red is not None and S.for_group(dist.group.WORLD) is red
    S.CHUNK_BYTES = 4096  # 1000 fp32 per slot: the sizes below cross chunk boundaries, with ragged tails
    for dt in (torch.float32, torch.bfloat16):
        for n in (0, 1, 5, 1024, 3001, 20000):
            for scale in (1.0, 0.5, 1 / 3):
                xs = [torch.randn(n, generator=torch.Generator().manual_seed(100 * q + n)).to(dt) for q in range(w)]
                x = xs[r].clone()
                red.all_reduce(x, scale)
                tag = f"{str(dt)[6:]}/{n}/{scale:.3f}"
                every = [torch.empty_like(x) for _ in range(w)]
                dist.all_gather(every, x)
                checks[f"same_on_every_rank/{tag}"] = all(torch.equal(every[0], t) for t in every)
                ref = sum(t.double() * scale for t in xs)  # fp64: rounding of w terms, each scaled then rounded
                tol = (w + 1) * (2.0 ** -8 if dt == torch.bfloat16 else 2.0 ** -23) * (
                    sum(t.double().abs() * scale for t in xs) + 1e-30)
                checks[f"fp64_sum/{tag}"] = bool(((x.double() - ref).abs() <= tol).all())
                if w == 2:  # two terms: exactly megatron's scale-then-sum, and gloo's all-reduce bit for bit
                    checks[f"hand_sum/{tag}"] = torch.equal(x, xs[0] * scale + xs[1] * scale)
                    y = xs[r].clone().mul_(scale)
                    dist.all_reduce(y)
                    checks[f"gloo/{tag}"] = torch.equal(x, y)
    try:
        red.all_reduce(torch.zeros(4, 4).t())
        checks["non_contiguous_refused"] = False
    except ValueError as e:
        checks["non_contiguous_refused"] = "contiguous" in str(e)
    dist.barrier()
    checks["nothing_left_in_dev_shm"] = not [f for f in os.listdir(S.SHM_DIR) if f.startswith("rlhf-allreduce-")]
    if r == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(checks, f)
    dist.destroy_process_group()


def _env_reason():
    os.environ[S.ENV] = "0"
    try:
        return S.why_not(dist.group.WORLD)
    finally:
        del os.environ[S.ENV]


if __name__ == "__main__":
    main()
