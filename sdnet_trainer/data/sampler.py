"""Samplers whose order is a function of the global sample position, not of per-rank state.

Training: :class:`GlobalBatchSampler` lays one epoch out as a single sequence of global batches
(``world_size * grad_accum_steps * micro_batch_size`` samples each) and gives every rank a fixed
slice of it. Because nothing depends on how far a rank's own iterator has run, W ranks with
micro-batch m consume exactly what one rank with micro-batch W*m consumes, in the same order, and
a run can resume at any step on any world size with the same global batch.

Evaluation: :class:`ShardedEvalSampler` splits the validation set across ranks with no padding and
no duplicates, so metrics summed over ranks count every sample exactly once.
:class:`EvalBatchSampler` batches a rank's share and pads it with whole batches, flagged as
padding, so every rank runs the same number of forwards (sharded models gather their weights in
each) while the metrics still count each sample exactly once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)


def _check_layout(*, world_size: int, rank: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


class GlobalBatchSampler(Sampler[list[int]]):
    """Batch sampler yielding this rank's micro-batches, ``grad_accum_steps`` per optimizer step.

    With G the global batch, W the world size and m the micro-batch, step ``s`` of an epoch covers
    positions ``[s*G, (s+1)*G)`` of the epoch order; its micro-step ``k`` covers
    ``[s*G + k*W*m, s*G + (k+1)*W*m)``, of which rank ``r`` takes the ``m`` positions starting at
    ``s*G + k*W*m + r*m``. The epoch order is ``randperm(dataset_size)`` seeded with
    ``seed + epoch`` (or ``arange`` without shuffling); with ``drop_last=False`` it wraps around to
    its start so the last step is a full global batch too.
    """

    def __init__(
        self,
        dataset_size: int,
        *,
        micro_batch_size: int,
        world_size: int,
        rank: int,
        grad_accum_steps: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if dataset_size < 0:
            raise ValueError(f"dataset_size must be >= 0, got {dataset_size}")
        _check_positive("micro_batch_size", micro_batch_size)
        _check_positive("grad_accum_steps", grad_accum_steps)
        _check_layout(world_size=world_size, rank=rank)
        self.dataset_size = dataset_size
        self.micro_batch_size = micro_batch_size
        self.world_size = world_size
        self.rank = rank
        self.grad_accum_steps = grad_accum_steps
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.global_batch_size = world_size * grad_accum_steps * micro_batch_size
        self._steps_per_epoch = self._count_steps()
        self.epoch = 0
        self.start_sample = 0

    def _count_steps(self) -> int:
        size, g = self.dataset_size, self.global_batch_size
        steps = size // g if self.drop_last else math.ceil(size / g)
        if steps < 1:
            # Raised here, at build time, so the user learns it before any model is built.
            raise ConfigError(
                f"loop.global_batch_size={g} (world_size {self.world_size} x grad_accum_steps "
                f"{self.grad_accum_steps} x micro-batch {self.micro_batch_size}) is larger than "
                f"the training set ({self.dataset_size} samples, see data.train_size / data.root); "
                f"an epoch would have no step"
            )
        return steps

    @property
    def steps_per_epoch(self) -> int:
        return self._steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next ``__iter__`` follows."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = epoch

    def set_start_step(self, step_in_epoch: int) -> None:
        """Begin the next ``__iter__`` at this optimizer step of the current epoch (for resuming).

        ``steps_per_epoch`` itself is allowed: that iteration is empty, which is what resuming from
        a checkpoint taken right at the end of an epoch needs.
        """
        if not 0 <= step_in_epoch <= self._steps_per_epoch:
            raise ValueError(
                f"step_in_epoch must be in [0, {self._steps_per_epoch}], got {step_in_epoch}"
            )
        self.set_start_sample(step_in_epoch * self.global_batch_size)

    def set_start_sample(self, position: int) -> None:
        """Begin the next ``__iter__`` at this position of the current epoch's order.

        Positions count samples, not steps, so a run resumed with another global batch (an elastic
        restart that keeps the per-rank batch) continues exactly where the epoch stood.
        """
        if not 0 <= position <= self._epoch_length():
            raise ValueError(f"position must be in [0, {self._epoch_length()}], got {position}")
        self.start_sample = position

    def remaining_steps(self) -> int:
        """Full global batches left in the current epoch from the start position."""
        return (self._epoch_length() - self.start_sample) // self.global_batch_size

    def _epoch_length(self) -> int:
        return self._steps_per_epoch * self.global_batch_size

    def epoch_order(self) -> list[int]:
        """All ``steps_per_epoch * global_batch_size`` dataset indices of the current epoch."""
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            perm = torch.randperm(self.dataset_size, generator=gen)
        else:
            perm = torch.arange(self.dataset_size)
        needed = self._steps_per_epoch * self.global_batch_size
        # Wrapping (not re-drawing) keeps drop_last=False deterministic and still a pure function
        # of (seed, epoch); it may wrap more than once when G exceeds the dataset size.
        positions = torch.arange(needed) % self.dataset_size
        return perm[positions].tolist()

    def __len__(self) -> int:
        return self.remaining_steps() * self.grad_accum_steps

    def __iter__(self) -> Iterator[list[int]]:
        order = self.epoch_order()
        g, m = self.global_batch_size, self.micro_batch_size
        span = self.world_size * m  # one micro-step over all ranks
        start = self.start_sample
        for step in range(self.remaining_steps()):
            for k in range(self.grad_accum_steps):
                begin = start + step * g + k * span + self.rank * m
                yield order[begin : begin + m]
        # A resume offset applies to the interrupted epoch only; the next one starts at 0.
        self.start_sample = 0


class ShardedEvalSampler(Sampler[int]):
    """Rank ``r`` of ``W`` gets ``range(r, dataset_size, W)``: no padding, no duplicates.

    Unlike ``DistributedSampler``, ranks may get different counts (by at most one); in exchange
    each sample is evaluated exactly once over all ranks.
    """

    def __init__(self, dataset_size: int, *, world_size: int, rank: int) -> None:
        if dataset_size < 0:
            raise ValueError(f"dataset_size must be >= 0, got {dataset_size}")
        _check_layout(world_size=world_size, rank=rank)
        self.dataset_size = dataset_size
        self.world_size = world_size
        self.rank = rank

    def _indices(self) -> range:
        return range(self.rank, self.dataset_size, self.world_size)

    def __len__(self) -> int:
        return len(self._indices())

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())


class EvalBatchSampler(Sampler[list[int]]):
    """This rank's :class:`ShardedEvalSampler` share in batches of ``batch_size``, then padding
    batches up to the same batch count on every rank.

    The shares differ by one sample, so their batch counts may differ by one. Under FSDP or
    tensor parallelism every forward is a collective (the weights are gathered in it): a rank
    with one batch more would run its extra forward alone and hang until the collective timeout.
    Each rank therefore runs ``len(self)`` batches, the same on every rank without any
    communication; the first ``counted_batches`` are its share, the rest are padding, which the
    evaluation runs but does not count (see ``training/evaluation.py``). A padding batch is a
    full batch (this rank's indices repeated), so it has the shape the compiled model has seen.
    """

    def __init__(self, dataset_size: int, *, batch_size: int, world_size: int, rank: int) -> None:
        _check_positive("batch_size", batch_size)
        self.shard = ShardedEvalSampler(dataset_size, world_size=world_size, rank=rank)
        self.batch_size = batch_size
        self.counted_batches = math.ceil(len(self.shard) / batch_size)
        # Rank 0's share is the largest: ceil(size / world_size) samples.
        largest = math.ceil(dataset_size / world_size)
        self.num_batches = math.ceil(largest / batch_size)

    def __len__(self) -> int:
        return self.num_batches

    def is_padding(self, batch_index: int) -> bool:
        """Whether the ``batch_index``-th batch of an iteration is padding (not to be counted)."""
        return batch_index >= self.counted_batches

    def __iter__(self) -> Iterator[list[int]]:
        indices = list(self.shard)
        b = self.batch_size
        for k in range(self.counted_batches):
            yield indices[k * b : (k + 1) * b]
        # A rank with no share (fewer samples than ranks) pads with the first sample; padding
        # exists only when the data set has samples.
        pool = indices or [0]
        for _ in range(self.counted_batches, self.num_batches):
            yield [pool[i % len(pool)] for i in range(b)]
