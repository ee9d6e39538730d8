"""The shared-memory gradient all-reduce of CPU jobs (rlhf.distributed.shm_allreduce), on 2 and 3 gloo ranks:
bit-identical to gloo's all-reduce and to megatron's scale-then-sum on 2 ranks, within the rounding of an fp64 sum
on 3, the same bits on every rank, across chunk boundaries, in fp32 and bf16; with little room in /dev/shm; its fallbacks. Its use by megatron's
DDP is checked by test_parallel_equivalence (gradients at DP2 and DP4 against a single-rank run)."""
import json

import pytest
from helpers import REPO, run_torchrun, tail


@pytest.mark.parametrize("nproc", [2, 3])
def test_shm_allreduce(tmp_path, nproc):
    out = tmp_path / "checks.json"
    proc = run_torchrun(f"{REPO}/tests/distributed/_shm_allreduce_worker.py", nproc, [str(out)], timeout=300)
    assert proc.returncode == 0, tail(proc)
    checks = json.loads(out.read_text())
    per_case = 4 if nproc == 2 else 2  # 2 ranks: against gloo and the hand sum too
    assert len(checks) == 11 + 2 * 6 * 3 * per_case, sorted(checks)  # dtypes x sizes x scales, + 11 named checks
    assert checks["took_shared_memory"]  # not gloo's fallback, which would pass every comparison too
    failed = [k for k, ok in checks.items() if not ok]
    assert not failed, failed
