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
    checks["one_rank_kept"] = _one_rank_reason() == "one rank"
    red = S.for_group(dist.group.WORLD)
    checks["made"] = red is not None and S.for_group(dist.group.WORLD) is red
    S.CHUNK_BYTES = 4096  # 1000 fp32 per slot: the sizes below cross chunk boundaries, with ragged tails
    chunks, calls, real_chunk = [0], [0], red._chunk

    def counted(*a):  # the shared-memory path itself, not gloo's fallback (which would pass every check below)
        chunks[0] += 1
        return real_chunk(*a)

    red._chunk = counted
    for dt in (torch.float32, torch.bfloat16):
        for n in (0, 1, 5, 1024, 3001, 20000):
            for scale in (1.0, 0.5, 1 / 3):
                xs = [torch.randn(n, generator=torch.Generator().manual_seed(100 * q + n)).to(dt) for q in range(w)]
                x = xs[r].clone()
                red.all_reduce(x, scale)
                calls[0] += n > 0
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
    # every non-empty call went through shared memory (sizes past a slot take several chunks), none through gloo
    checks["took_shared_memory"] = not red.disabled and red.scratch is not None and chunks[0] > calls[0] > 0
    red._chunk = real_chunk
    _small_dev_shm(checks, r, w)
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
    dist.barrier()
    # Skip the interpreter's teardown: on this torch (2.13) gloo's threads abort a rank at exit now and then
    # ("terminate called without an active exception"), even in a worker that only all-reduces and exits.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _small_dev_shm(checks: dict, r: int, w: int) -> None:
    """A /dev/shm with little room (as a container's): slots shrink to fit, a full one keeps the mapping it has, and
    with no room and no mapping the group falls back to gloo's all-reduce. Results stay right throughout."""
    S.CHUNK_BYTES, S.MIN_SLOT_BYTES = 1 << 16, 1024
    x0 = torch.randn(20000, generator=torch.Generator().manual_seed(7 + r))

    def reduced(red):
        x, y = x0.clone(), x0.clone().mul_(0.5)
        red.all_reduce(x, 0.5)
        dist.all_reduce(y)
        return torch.equal(x, y) if w == 2 else torch.allclose(x, y, rtol=1e-6, atol=1e-6)

    S._shm_free_bytes = lambda: 2 * w * 8192  # room for slots of 8 KiB, not the 64 KiB asked for
    red = S.ShmAllReduce(dist.group.WORLD)
    checks["small_shm/right"] = reduced(red)
    checks["small_shm/slots_shrunk"] = red.slot_bytes == 8192 and not red.disabled
    mapped, maps, real_map = red.scratch.data_ptr(), [], red._map
    red._map = lambda slot: (maps.append(slot), real_map(slot))
    checks["small_shm/not_remapped_per_call"] = reduced(red) and not maps
    S._shm_free_bytes = lambda: 0
    S.CHUNK_BYTES = 1 << 17  # now 80 KB slots are wanted: a re-map is tried, finds no room, keeps the one it has
    checks["full_shm/keeps_mapping"] = (reduced(red) and maps == [80000] and red.scratch.data_ptr() == mapped
                                        and red.slot_bytes == 8192 and not red.disabled)
    red = S.ShmAllReduce(dist.group.WORLD)
    checks["full_shm/gloo_fallback"] = reduced(red) and "MiB free" in red.disabled and red.scratch is None


def _one_rank_reason():
    """``why_not`` of a one-rank group (faked: a gloo sub-group made here made teardown abort now and then)."""
    real = S.dist.get_world_size
    S.dist.get_world_size = lambda group=None: 1
    try:
        return S.why_not(dist.group.WORLD)
    finally:
        S.dist.get_world_size = real


def _env_reason():
    os.environ[S.ENV] = "0"
    try:
        return S.why_not(dist.group.WORLD)
    finally:
        del os.environ[S.ENV]


if __name__ == "__main__":
    main()
