"""DistributedBatchSampler: geometry checks, DP partition, epoch reshuffle, and exact resume."""
import itertools

import pytest

from rlhf.data import BatchConfig, DistributedBatchSampler


@pytest.mark.parametrize("tbs, mbs, dp", [(10, 4, 1), (8, 2, 3), (12, 8, 1)])
def test_divisibility_error_names_both_flags(tbs, mbs, dp):
    with pytest.raises(ValueError, match=rf"--train_batch_size {tbs} must be divisible by "
                                         rf"--micro_train_batch_size {mbs} x data-parallel size {dp}"):
        BatchConfig(tbs, mbs, dp_size=dp)


def test_other_geometry_errors():
    with pytest.raises(ValueError, match="--micro_train_batch_size must be >= 1, got 0"):
        BatchConfig(8, 0)
    with pytest.raises(ValueError, match="dp_rank=2, dp_size=2"):
        BatchConfig(8, 2, dp_size=2, dp_rank=2)
    with pytest.raises(ValueError, match=r"--train_batch_size 16 is larger than the dataset \(10 samples\)"):
        DistributedBatchSampler(10, BatchConfig(16, 2))


def test_ranks_partition_each_global_batch():
    n, dp = 50, 2
    samplers = [DistributedBatchSampler(n, BatchConfig(8, 2, dp_size=dp, dp_rank=r), seed=5) for r in range(dp)]
    assert len(samplers[0]) == 6  # 50 // 8; the last partial batch is dropped
    seen, iters = [], [iter(s) for s in samplers]
    for steps in zip(*iters):
        assert all(len(mbs) == 2 and all(len(mb) == 2 for mb in mbs) for mbs in steps)
        flat = [i for mbs in steps for mb in mbs for i in mb]
        assert len(set(flat)) == 8
        seen += flat
    assert len(set(seen)) == 48
    assert all(next(it, None) is None for it in iters) and all(s.state_dict()["epoch"] == 1 for s in samplers)


def test_deterministic_and_reshuffled_per_epoch():
    def epochs(seed, k=2):
        s = DistributedBatchSampler(20, BatchConfig(4, 2), seed=seed)
        return [list(s) for _ in range(k)]

    a = epochs(1)
    assert a == epochs(1) and a != epochs(2)
    assert a[0] != a[1]  # (seed, epoch) gives every epoch its own order
    unshuffled = DistributedBatchSampler(8, BatchConfig(4, 2), shuffle=False)
    assert list(unshuffled) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


@pytest.mark.parametrize("k", [0, 1, 3, 5, 7])  # 5 steps per epoch: mid-epoch, at the boundary, in epoch 2
def test_resume_continues_exactly(k):
    def make():
        return DistributedBatchSampler(23, BatchConfig(4, 1, dp_size=2, dp_rank=1), seed=11)

    def run(sampler, epochs=3):
        out = []
        for _ in range(sampler.epoch, epochs):
            out += list(sampler)
        return out

    full = run(make())
    first = make()
    head = []
    it = itertools.chain.from_iterable(iter(first) for _ in range(3))
    for _ in range(k):
        head.append(next(it))
    state = first.state_dict()
    resumed = DistributedBatchSampler(23, BatchConfig(4, 1, dp_size=2, dp_rank=1), seed=999)  # saved seed wins
    resumed.load_state_dict(state)
    assert head + run(resumed) == full
    assert resumed.consumed_samples == 3 * 5 * 4


def test_resume_rejects_a_changed_global_batch_or_dataset():
    state = DistributedBatchSampler(20, BatchConfig(4, 2)).state_dict()
    with pytest.raises(ValueError, match="saved with --train_batch_size 4, this run has 8"):
        DistributedBatchSampler(20, BatchConfig(8, 2)).load_state_dict(state)
    with pytest.raises(ValueError, match="saved with dataset size 20, this run has 21"):
        DistributedBatchSampler(21, BatchConfig(4, 2)).load_state_dict(state)
    DistributedBatchSampler(20, BatchConfig(4, 2, dp_size=2)).load_state_dict(state)  # DP size may change


def test_next_step_rolls_over_epochs_and_resumes_like_iteration():
    def make():
        return DistributedBatchSampler(10, BatchConfig(4, 2), seed=3)  # 2 steps per epoch

    ref = make()
    expected = [mb for _ in range(3) for mb in ref]
    s = make()
    got = [s.next_step() for _ in range(3)]
    assert s.epoch_float == 1.5
    resumed = make()
    resumed.load_state_dict(s.state_dict())
    assert got + [resumed.next_step() for _ in range(3)] == expected
