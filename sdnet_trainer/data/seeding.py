"""Random augmentations as a pure function of (seed, epoch, sample).

Loader worker processes draw from generators seeded per worker and per iterator, so the random
crop a sample gets would depend on which worker loaded it and on where the iterator started:
a run resumed mid-epoch would see different augmentations than the uninterrupted run. Seeding
torch's and Python's generators from (seed, epoch, sample index) right before each sample is
loaded removes that dependence, with or without worker processes.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from sdnet_trainer.rng import derive_seed


class EpochTaggedBatches(Sampler[list[tuple[int, int]]]):
    """Wraps a batch sampler: every index becomes ``(epoch, index)`` for :class:`SampleSeeded`."""

    def __init__(self, batch_sampler) -> None:
        self.batch_sampler = batch_sampler

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.batch_sampler.epoch
        for batch in self.batch_sampler:
            yield [(epoch, index) for index in batch]


class SampleSeeded(Dataset):
    """Loads ``dataset[index]`` with torch's CPU and Python's generators seeded from
    (seed, epoch, index); the caller's generator states are restored afterwards, so in the main
    process the training stream (dropout) is unaffected."""

    def __init__(self, dataset: Dataset, *, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # map-style datasets have a length

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        sample_seed = derive_seed(self.seed + epoch, rank=0, step=index)
        python_state = random.getstate()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed)
            random.seed(sample_seed)
            try:
                return self.dataset[index]
            finally:
                random.setstate(python_state)
