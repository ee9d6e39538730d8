"""Deterministic, resumable batches for data-parallel training.

    sampler = DistributedBatchSampler(len(samples), BatchConfig(128, 4, dp_size=mesh.dp_size, dp_rank=mesh.dp_rank),
                                      seed=args.seed)
    sampler.load_state_dict(ckpt["sampler"])            # on resume
    for epoch in range(sampler.epoch, args.max_epochs):
        for micro_batches in sampler:                   # one optimizer step; list of index lists for this rank
            loss = sum(step(collate_sft([samples[i] for i in mb], pad_id)) for mb in micro_batches)
            ckpt["sampler"] = sampler.state_dict()      # already points at the next step
    # or, in a loop that counts steps: micro_batches = sampler.next_step()  (rolls over epochs by itself)

Each epoch is a permutation seeded by ``(seed, epoch)``. Step ``s`` takes the global batch
``perm[s*G:(s+1)*G]`` (``G = train_batch_size``); DP rank ``r`` gets its contiguous ``G/dp`` slice, cut into
micro-batches of ``micro_train_batch_size``. The last partial global batch of an epoch is dropped, so every rank
runs the same number of steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

_EPOCH_STREAM = 2  # distinct from the mixing streams in rlhf.data.mixing


@dataclass
class BatchConfig:
    """The batch geometry: global batch, micro batch and this rank's place in data parallelism."""

    train_batch_size: int
    """--train_batch_size: samples per optimizer step, over all DP ranks."""
    micro_train_batch_size: int
    """--micro_train_batch_size: samples per forward/backward on one rank."""
    dp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "micro_train_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.dp_size < 1 or not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={self.dp_rank}, dp_size={self.dp_size}")
        if self.train_batch_size % (self.micro_train_batch_size * self.dp_size):
            raise ValueError(f"--train_batch_size {self.train_batch_size} must be divisible by "
                             f"--micro_train_batch_size {self.micro_train_batch_size} x data-parallel size "
                             f"{self.dp_size} = {self.micro_train_batch_size * self.dp_size}")

    @property
    def rank_batch_size(self) -> int:
        return self.train_batch_size // self.dp_size

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on each rank (gradient-accumulation steps)."""
        return self.rank_batch_size // self.micro_train_batch_size


class DistributedBatchSampler:
    """Yields, per optimizer step, this rank's micro-batches as lists of sample indices (see module docstring)."""

    def __init__(self, num_samples: int, batch: BatchConfig, seed: int = 42, shuffle: bool = True):
        if num_samples < batch.train_batch_size:
            raise ValueError(f"--train_batch_size {batch.train_batch_size} is larger than the dataset "
                             f"({num_samples} samples): not even one step per epoch")
        if seed < 0:
            raise ValueError(f"--seed must be >= 0, got {seed}")
        self.num_samples, self.batch, self.seed, self.shuffle = num_samples, batch, seed, shuffle
        self.steps_per_epoch = num_samples // batch.train_batch_size
        self.epoch = 0
        self.step = 0  # steps of ``epoch`` already handed out
        self._perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def consumed_samples(self) -> int:
        """Samples handed out over all ranks since epoch 0 step 0."""
        return (self.epoch * self.steps_per_epoch + self.step) * self.batch.train_batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            perm = (np.random.default_rng([self.seed, _EPOCH_STREAM, epoch]).permutation(self.num_samples)
                    if self.shuffle else np.arange(self.num_samples))
            self._perm = (epoch, perm)
        return self._perm[1]

    def batch_at(self, epoch: int, step: int) -> list[list[int]]:
        """This rank's micro-batches of step ``step`` of ``epoch``: ``num_micro_batches`` lists of indices."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} out of range [0, {self.steps_per_epoch})")
        b = self.batch
        start = step * b.train_batch_size + b.dp_rank * b.rank_batch_size
        mine = self._permutation(epoch)[start: start + b.rank_batch_size].tolist()
        m = b.micro_train_batch_size
        return [mine[i: i + m] for i in range(0, len(mine), m)]

    def __iter__(self) -> Iterator[list[list[int]]]:
        """The remaining steps of the current epoch; the state advances before each yield, and to the next epoch
        once the epoch is exhausted."""
        while self.step < self.steps_per_epoch:
            micro_batches = self.batch_at(self.epoch, self.step)
            self.step += 1
            yield micro_batches
        self.epoch, self.step = self.epoch + 1, 0

    def next_step(self) -> list[list[int]]:
        """The next step's micro-batches for step-counted loops; rolls into the next epoch when one ends."""
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        micro_batches = self.batch_at(self.epoch, self.step)
        self.step += 1
        return micro_batches

    @property
    def epoch_float(self) -> float:
        """Progress in epochs, for logging (2.5 = half-way through the third epoch)."""
        return self.epoch + self.step / self.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first step."""
        self.epoch, self.step = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "num_samples": self.num_samples,
                "train_batch_size": self.batch.train_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the last handed-out step. The saved seed wins over the constructor's, so the
        permutation stays the same; the dataset size and global batch must match (DP size may change)."""
        now = {"dataset size": ("num_samples", self.num_samples),
               "--train_batch_size": ("train_batch_size", self.batch.train_batch_size)}
        for name, (key, value) in now.items():
            if key in state and state[key] != value:
                raise ValueError(f"cannot resume the data order: the checkpoint was saved with {name} "
                                 f"{state[key]}, this run has {value}")
        self.seed, self.epoch, self.step = int(state["seed"]), int(state["epoch"]), int(state["step"])
        self._perm = None
