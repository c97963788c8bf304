"""The one place that turns ``data.*`` loader settings into a ``torch.utils.data.DataLoader``.

Training passes a batch sampler (see :class:`~sdnet_trainer.data.sampler.GlobalBatchSampler`);
evaluation passes a per-sample sampler plus a batch size. Options torch would reject or warn about
in a given setting (pinning without CUDA, worker options without workers) are dropped here, so
one config works on a laptop and on a GPU node alike.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from sdnet_trainer.config.checks import check_positive
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.sampler import GlobalBatchSampler, ShardedEvalSampler
from sdnet_trainer.data.seeding import EpochTaggedBatches, SampleSeeded, draws_random
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)


def check_loader_options(cfg: DataConfig) -> None:
    """``data.num_workers`` and ``data.prefetch_factor``: part of preflight's data checks, and
    checked again by :func:`build_loader`, which also serves callers that build a DataConfig
    themselves."""
    check_positive("data.num_workers", cfg.num_workers, allow_zero=True)
    if cfg.num_workers > 0 and cfg.prefetch_factor < 1:
        raise ConfigError(f"data.prefetch_factor={cfg.prefetch_factor} must be >= 1")


def _batching_kwargs(
    *, batch_sampler: Sampler | None, sampler: Sampler | None, batch_size: int | None
) -> dict[str, Any]:
    """Exactly one way of batching: a batch sampler, or a sampler plus a batch size."""
    if batch_sampler is not None:
        if sampler is not None or batch_size is not None:
            raise ValueError("pass either batch_sampler, or sampler and batch_size, not both")
        return {"batch_sampler": batch_sampler}
    if sampler is None or batch_size is None:
        raise ValueError("pass either batch_sampler, or both sampler and batch_size")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    # The per-sample path serves evaluation, where every sample must count: keep the short tail.
    return {"sampler": sampler, "batch_size": batch_size, "drop_last": False}


def _worker_kwargs(cfg: DataConfig, *, device_type: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "num_workers": cfg.num_workers,
        # Pinned host memory only speeds up host-to-CUDA copies; elsewhere torch warns and it
        # just costs page-locked RAM.
        "pin_memory": bool(cfg.pin_memory) and device_type == "cuda",
    }
    # torch raises ValueError for these two when num_workers == 0.
    if cfg.num_workers > 0:
        kwargs["persistent_workers"] = bool(cfg.persistent_workers)
        kwargs["prefetch_factor"] = cfg.prefetch_factor
    return kwargs


def build_loader(
    dataset: Dataset,
    *,
    cfg: DataConfig,
    device_type: str,
    batch_sampler: Sampler | None = None,
    sampler: Sampler | None = None,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
) -> DataLoader:
    """A DataLoader over ``dataset`` following the ``data.*`` loader policy.

    ``device_type`` is the training device's type ("cuda", "cpu", ...); ``generator`` seeds the
    workers' base seed (and so random augmentations) reproducibly.
    """
    check_loader_options(cfg)
    kwargs = _batching_kwargs(batch_sampler=batch_sampler, sampler=sampler, batch_size=batch_size)
    kwargs.update(_worker_kwargs(cfg, device_type=device_type))
    logger.debug("DataLoader settings: %s", {k: v for k, v in kwargs.items() if "sampler" not in k})
    return DataLoader(dataset, generator=generator, **kwargs)


def train_loader(
    dataset: Dataset,
    *,
    cfg: DataConfig,
    device_type: str,
    micro_batch_size: int,
    grad_accum_steps: int,
    dp_size: int,
    dp_rank: int,
    seed: int,
) -> tuple[DataLoader, GlobalBatchSampler]:
    """The training loader and its sampler: this data-parallel rank's micro-batches of the global
    batch order (see GlobalBatchSampler), each sample seeded by (seed, epoch, index)."""
    sampler = GlobalBatchSampler(
        len(dataset),  # type: ignore[arg-type]  # map-style datasets have a length
        micro_batch_size=micro_batch_size,
        world_size=dp_size,
        rank=dp_rank,
        grad_accum_steps=grad_accum_steps,
        shuffle=cfg.shuffle,
        seed=seed,
        drop_last=cfg.drop_last,
    )
    # The loader gets its own generator: creating an iterator must not draw from the global
    # stream, or a resumed run (which creates one mid-epoch) would diverge from an uninterrupted
    # one. Augmentations are seeded per sample (SampleSeeded), so which worker loads a sample
    # does not matter either; samples that draw nothing random skip that work.
    seeded = draws_random(dataset)
    loader = build_loader(
        SampleSeeded(dataset, seed=seed) if seeded else dataset,
        cfg=cfg,
        device_type=device_type,
        batch_sampler=EpochTaggedBatches(sampler) if seeded else sampler,
        generator=torch.Generator(),
    )
    return loader, sampler


def eval_loader(
    dataset: Dataset,
    *,
    cfg: DataConfig,
    device_type: str,
    batch_size: int,
    dp_size: int,
    dp_rank: int,
) -> DataLoader:
    """This data-parallel rank's share of the validation set, every sample exactly once."""
    size = len(dataset)  # type: ignore[arg-type]  # map-style datasets have a length
    if size < dp_size:
        raise ConfigError(
            f"the validation set has {size} samples, fewer than the {dp_size} data-parallel ranks "
            f"(data.val_size)"
        )
    sampler = ShardedEvalSampler(size, world_size=dp_size, rank=dp_rank)
    return build_loader(
        dataset, cfg=cfg, device_type=device_type, sampler=sampler, batch_size=batch_size
    )


class DataPosition(Protocol):
    """Where the run stands in its data (``RunState`` provides it)."""

    epoch: int
    epoch_sample: int


class RunData:
    """A run's loaders: this data-parallel rank's training micro-batches, drawn from the position
    the run state gives, and its share of the validation set; batches arrive on ``device``."""

    def __init__(
        self,
        train_set: Dataset,
        val_set: Dataset | None,
        *,
        cfg: DataConfig,
        device: torch.device,
        micro_batch_size: int,
        grad_accum_steps: int,
        eval_batch_size: int,
        dp_size: int,
        dp_rank: int,
        seed: int,
        channels_last: bool = False,
    ) -> None:
        self.device, self.channels_last = device, channels_last
        dp = {"dp_size": dp_size, "dp_rank": dp_rank}
        self.train_loader, self.train_sampler = train_loader(
            train_set,
            cfg=cfg,
            device_type=device.type,
            micro_batch_size=micro_batch_size,
            grad_accum_steps=grad_accum_steps,
            seed=seed,
            **dp,
        )
        self.val_loader = None
        if val_set is not None:
            self.val_loader = eval_loader(
                val_set, cfg=cfg, device_type=device.type, batch_size=eval_batch_size, **dp
            )
        self.steps_per_epoch = self.train_sampler.steps_per_epoch
        self._batches: Generator[Any, None, None] | None = None

    def start(self, position: DataPosition) -> None:
        """Begin (or restart) the training iteration at ``position``."""
        self._batches = self._positioned(position)

    def _positioned(self, position: DataPosition) -> Generator[Any, None, None]:
        """Micro-batches forever, epoch after epoch; the sampler is positioned from the epoch and
        the sample position, so the order depends only on the seed, the epoch and the global
        sample index (not on the world size or on where a previous run stopped)."""
        while True:
            self.train_sampler.set_epoch(position.epoch)
            self.train_sampler.set_start_sample(position.epoch_sample)
            yield from self.train_loader

    def next_batch(self) -> Any:
        """The next training micro-batch, on the device."""
        assert self._batches is not None, "start() positions the iteration first"
        return self.to_device(next(self._batches))

    def to_device(self, batch: Any) -> Any:
        return to_device(batch, self.device, channels_last=self.channels_last)

    def close(self) -> None:
        """End the iteration in flight and stop every worker process now."""
        if self._batches is not None:
            self._batches.close()
        shutdown_loader(self.train_loader)
        shutdown_loader(self.val_loader)


def shutdown_loader(loader: DataLoader | None) -> None:
    """Stop ``loader``'s worker processes now.

    Persistent workers otherwise live until the garbage collector finalises the loader's iterator,
    at an arbitrary later point (even inside unrelated code), where joining them can block.
    """
    if loader is None:
        return
    iterator = getattr(loader, "_iterator", None)
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    loader._iterator = None


def to_device(batch: Any, device: torch.device, *, channels_last: bool = False) -> Any:
    """Every tensor of a (nested) batch on ``device``; 4-D float inputs in channels_last layout
    when asked (model.channels_last)."""
    if isinstance(batch, torch.Tensor):
        if channels_last and batch.dim() == 4 and batch.is_floating_point():
            return batch.to(device, memory_format=torch.channels_last, non_blocking=True)
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, channels_last=channels_last) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, channels_last=channels_last) for k, v in batch.items()}
    return batch
