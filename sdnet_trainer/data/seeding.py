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
from torch.utils.data import Dataset, Sampler, TensorDataset

from sdnet_trainer.runtime.rng import derive_seed


def draws_random(dataset: Dataset) -> bool:
    """Whether loading a sample may draw from the global random generators (a random crop), so
    it must be seeded per sample. A dataset says it does not with ``draws_random = False``
    (samples that are a pure function of the index); a ``TensorDataset`` never does. Unknown
    datasets are seeded: the seeding costs tens of microseconds a sample."""
    return bool(getattr(dataset, "draws_random", not isinstance(dataset, TensorDataset)))


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
        # Only the CPU generator: torch.manual_seed would also reseed (or queue the reseeding of)
        # every CUDA/XPU/MTIA generator, resetting the training process's dropout streams, and
        # formats a stack trace per call while CUDA is uninitialised (~1 ms per sample).
        generator = torch.default_generator
        torch_state, python_state = generator.get_state(), random.getstate()
        generator.manual_seed(sample_seed)
        random.seed(sample_seed)
        try:
            return self.dataset[index]
        finally:
            generator.set_state(torch_state)
            random.setstate(python_state)
