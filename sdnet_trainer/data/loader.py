"""The one place that turns ``data.*`` loader settings into a ``torch.utils.data.DataLoader``.

Training and evaluation pass batch samplers (``GlobalBatchSampler``, ``EvalBatchSampler``; see
``data/sampler.py``); other callers may pass a per-sample sampler plus a batch size. Options torch
would reject or warn about in a given setting (pinning without CUDA, worker options without
workers) are dropped here, so one config works on a laptop and on a GPU node alike.

:class:`RunData` brings batches to the device. On CUDA the image data sets built here deliver
uint8 pixels that are normalized on the device (see ``data/normalize.py``), and every batch is
copied on a side stream from pinned memory, so the copy overlaps the GPU work still queued from
the previous step instead of waiting behind it. Training batches are then mixed there
(``data.mixup_alpha``, ``data.cutmix_alpha``; see ``data/augment.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.augment import BatchMixer
from sdnet_trainer.data.normalize import DeviceNormalize, defer_normalization
from sdnet_trainer.data.sampler import EvalBatchSampler, GlobalBatchSampler
from sdnet_trainer.data.seeding import EpochTaggedBatches, SampleSeeded, draws_random
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.lazy import loaded_types

if TYPE_CHECKING:
    from sdnet_trainer.data.jpeg import DeviceDecoder

logger = logging.getLogger(__name__)

# data.decode
DECODE = ("cpu", "cuda")


def check_loader_options(cfg: DataConfig) -> None:
    """``data.num_workers``, ``data.prefetch_factor`` and ``data.decode``: part of preflight's
    data checks, and checked again by :func:`build_loader`, which also serves callers that build
    a DataConfig themselves. That ``data.decode=cuda`` needs a CUDA device is checked where the
    device is known (:class:`RunData`)."""
    check_positive("data.num_workers", cfg.num_workers, allow_zero=True, allow_none=True)
    if (cfg.num_workers or 0) > 0 and cfg.prefetch_factor < 1:
        raise ConfigError(f"data.prefetch_factor={cfg.prefetch_factor} must be >= 1")
    check_choice("data.decode", cfg.decode, DECODE)
    if cfg.decode == "cuda" and cfg.name != "imagefolder":
        raise ConfigError(
            f"data.decode=cuda decodes JPEG image files, so it applies to data.name=imagefolder "
            f"only, not data.name={cfg.name!r}; set data.decode=cpu"
        )


def resolve_num_workers(num_workers: int | None, *, device_type: str) -> int:
    """``data.num_workers``; null: this node's cores shared among its local ranks on CUDA, 0 on
    the CPU, where workers would take cores from the training threads."""
    if num_workers is not None:
        return num_workers
    if device_type != "cuda":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # torchrun sets LOCAL_WORLD_SIZE; launched otherwise, each rank assumes it has the node.
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (cores or 1) // max(1, local_ranks) - 1)  # one core left for the rank itself


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
    # Every sample of a per-sample sampler counts (evaluation-style): keep the short tail.
    return {"sampler": sampler, "batch_size": batch_size, "drop_last": False}


def _worker_kwargs(
    cfg: DataConfig, *, device_type: str, persistent: bool | None = None
) -> dict[str, Any]:
    workers = resolve_num_workers(cfg.num_workers, device_type=device_type)
    persistent = cfg.persistent_workers if persistent is None else persistent
    kwargs: dict[str, Any] = {
        "num_workers": workers,
        # Pinned host memory only speeds up host-to-CUDA copies; elsewhere torch warns and it
        # just costs page-locked RAM.
        "pin_memory": bool(cfg.pin_memory) and device_type == "cuda",
    }
    # torch raises ValueError for these two when num_workers == 0.
    if workers > 0:
        kwargs["persistent_workers"] = bool(persistent)
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
    persistent_workers: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    """A DataLoader over ``dataset`` following the ``data.*`` loader policy.

    ``device_type`` is the training device's type ("cuda", "cpu", ...); ``generator`` seeds the
    workers' base seed (and so random augmentations) reproducibly; ``persistent_workers``
    overrides ``data.persistent_workers`` (None: keep it).
    """
    check_loader_options(cfg)
    kwargs = _batching_kwargs(batch_sampler=batch_sampler, sampler=sampler, batch_size=batch_size)
    kwargs.update(_worker_kwargs(cfg, device_type=device_type, persistent=persistent_workers))
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
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
    collate_fn: Callable[[list[Any]], Any] | None = None,
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
        collate_fn=collate_fn,
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
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    """This data-parallel rank's share of the validation set, every sample exactly once, padded
    with whole batches to the same batch count on every rank (see :class:`EvalBatchSampler`; its
    ``counted_batches`` first batches are the share, the rest are to run but not be counted).

    Its workers never persist: evaluation runs now and then, and persistent workers would hold
    their processes and prefetched batches through all the training in between (next to the
    training loader's, with as many workers as cores)."""
    size = len(dataset)  # type: ignore[arg-type]  # map-style datasets have a length
    if size < dp_size:
        raise ConfigError(
            f"the validation set has {size} samples, fewer than the {dp_size} data-parallel ranks "
            f"(data.val_size)"
        )
    sampler = EvalBatchSampler(size, batch_size=batch_size, world_size=dp_size, rank=dp_rank)
    return build_loader(
        dataset,
        cfg=cfg,
        device_type=device_type,
        batch_sampler=sampler,
        persistent_workers=False,
        collate_fn=collate_fn,
    )


def counted_eval_batches(loader: DataLoader) -> int:
    """How many of ``loader``'s batches count (an :func:`eval_loader`; the rest are padding)."""
    sampler = loader.batch_sampler
    assert isinstance(sampler, EvalBatchSampler), "an eval_loader pads with an EvalBatchSampler"
    return sampler.counted_batches


class _BatchPlace(NamedTuple):
    """Where a training micro-batch sits: its epoch, the position in the epoch's sample order of
    the step it belongs to, and its micro-step within that step."""

    epoch: int
    step_sample: int
    micro_step: int


class DataPosition(Protocol):
    """Where the run stands in its data (``RunState`` provides it)."""

    epoch: int
    epoch_sample: int


class RunData:
    """A run's loaders: this data-parallel rank's training micro-batches, drawn from the position
    the run state gives, and its share of the validation set; batches arrive on ``device``.

    ``shard`` (context parallel) cuts every batch on the device to this rank's share of its
    sequences.

    ``uint8_inputs`` (default: on CUDA) has the image data sets built here (imagefolder, CIFAR-10)
    deliver uint8 pixels, normalized on the device into the same float tensors the float path
    gives. Data sets built for ``data.decode=cuda`` (a ``device_decoder`` attribute) deliver
    encoded JPEG files, decoded on the device.

    With ``data.mixup_alpha`` or ``data.cutmix_alpha`` set, every training micro-batch is mixed
    on the device (:class:`~sdnet_trainer.data.augment.BatchMixer`), its draws seeded by its place
    in the epoch; ``cfg.num_classes`` must be resolved by then.
    """

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
        uint8_inputs: bool | None = None,
        shard: Callable[[Any], Any] | None = None,
    ) -> None:
        self.device, self.channels_last = device, channels_last
        self.shard = shard
        self.dp_rank, self.grad_accum_steps = dp_rank, grad_accum_steps
        self.mixer = BatchMixer.from_config(cfg, seed=seed)
        on_cuda = device.type == "cuda"
        self.decoder: DeviceDecoder | None = getattr(train_set, "device_decoder", None)
        self.normalize: DeviceNormalize | None = None
        collate = None
        if self.decoder is not None:
            if not on_cuda:
                raise ConfigError(
                    f"data.decode=cuda decodes on the GPU, but this rank trains on {device}; "
                    f"set data.decode=cpu"
                )
            # The data set's decoder comes from data/jpeg.py (torchvision), imported already;
            # other runs never import it.
            from sdnet_trainer.data.jpeg import collate_encoded

            collate = collate_encoded
        elif on_cuda if uint8_inputs is None else uint8_inputs:  # default: on CUDA
            train_set, val_set = self._defer_normalization(train_set, val_set)
            if self.normalize is None and cfg.augment.random_erase > 0:
                logger.info(
                    "data.augment.random_erase=%s erases the normalized image: images are "
                    "normalized in the loader and copied to the device as float32",
                    cfg.augment.random_erase,
                )
        # The host-to-device copy's own stream (see _copy).
        self._copy_stream = torch.cuda.Stream(device) if on_cuda else None
        dp = {"dp_size": dp_size, "dp_rank": dp_rank}
        self.train_loader, self.train_sampler = train_loader(
            train_set,
            cfg=cfg,
            device_type=device.type,
            micro_batch_size=micro_batch_size,
            grad_accum_steps=grad_accum_steps,
            seed=seed,
            collate_fn=collate,
            **dp,
        )
        self.val_loader = None
        # The validation batches that count; the val loader's later batches are padding, run
        # so that every rank runs as many forwards as the others (see EvalBatchSampler).
        self.val_counted_batches = 0
        if val_set is not None:
            self.val_loader = eval_loader(
                val_set,
                cfg=cfg,
                device_type=device.type,
                batch_size=eval_batch_size,
                collate_fn=collate,
                **dp,
            )
            self.val_counted_batches = counted_eval_batches(self.val_loader)
        self.steps_per_epoch = self.train_sampler.steps_per_epoch
        self._batches: Generator[tuple[_BatchPlace, Any], None, None] | None = None

    def _defer_normalization(
        self, train_set: Dataset, val_set: Dataset | None
    ) -> tuple[Dataset, Dataset | None]:
        """uint8 copies of the data sets that support it; the validation set only when it
        normalizes as the training set does, as one normalization serves both."""
        deferred = defer_normalization(train_set)
        if deferred is None:
            return train_set, val_set
        train_set, self.normalize = deferred
        if val_set is not None:
            val_deferred = defer_normalization(val_set)
            if val_deferred is not None and val_deferred[1] == self.normalize:
                val_set = val_deferred[0]
        return train_set, val_set

    def start(self, position: DataPosition) -> None:
        """Begin (or restart) the training iteration at ``position``."""
        self._batches = self._positioned(position)

    def _positioned(self, position: DataPosition) -> Generator[tuple[_BatchPlace, Any], None, None]:
        """Micro-batches forever, epoch after epoch, each with its place; the sampler is
        positioned from the epoch and the sample position, so the order depends only on the
        seed, the epoch and the global sample index (not on the world size or on where a
        previous run stopped)."""
        sampler, accum = self.train_sampler, self.grad_accum_steps
        while True:
            epoch, start = position.epoch, position.epoch_sample
            sampler.set_epoch(epoch)
            sampler.set_start_sample(start)
            for i, batch in enumerate(self.train_loader):
                step, micro_step = divmod(i, accum)
                step_sample = start + step * sampler.global_batch_size
                yield _BatchPlace(epoch, step_sample, micro_step), batch

    def next_batch(self) -> Any:
        """The next training micro-batch, on the device (mixed, with ``data.mixup_alpha`` /
        ``data.cutmix_alpha``)."""
        assert self._batches is not None, "start() positions the iteration first"
        place, batch = next(self._batches)
        batch = self.to_device(batch)
        if self.mixer is None:
            return batch
        return self.mixer(
            batch,
            epoch=place.epoch,
            step_sample=place.step_sample,
            micro_step=place.micro_step,
            dp_rank=self.dp_rank,
        )

    def to_device(self, batch: Any) -> Any:
        """A loader batch (training or validation) on the device, ready for the model: copied,
        then normalized or decoded there where the data set left that to the device."""
        batch = self._copy(batch)
        if self.normalize is not None or self.decoder is not None:
            batch = _map_batch(batch, self._finish)
        return batch if self.shard is None else self.shard(batch)

    def _copy(self, batch: Any) -> Any:
        """Every tensor of ``batch`` on the device. On CUDA the copy is queued on a side stream:
        the compute stream may still be busy with the previous step, and a copy queued there
        would wait for it. The compute stream then waits for the copy (before any kernel reads
        the batch), and each copied tensor is marked as used there, so the caching allocator
        does not hand its memory back to the side stream while the step still reads it. The
        host returns at once: the loader's batches are in pinned memory (``data.pin_memory``),
        which the copy reads asynchronously."""
        # to_device lays out float images only; uint8 ones take the layout when normalized.
        layout = self.channels_last
        stream = self._copy_stream
        if stream is None:
            return to_device(batch, self.device, channels_last=layout)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            moved = to_device(batch, self.device, channels_last=layout)
        compute.wait_stream(stream)
        for tensor in _tensors(moved):
            if tensor.device.type == "cuda":
                tensor.record_stream(compute)
        return moved

    def _finish(self, item: Any) -> Any:
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        # A batch of encoded files exists only where data/jpeg.py is imported (data.decode=cuda).
        encoded = loaded_types("sdnet_trainer.data.jpeg", "EncodedImages")
        if isinstance(item, encoded) and self.decoder is not None:
            return self.decoder(item, self.device, memory_format=memory_format)
        if (
            self.normalize is not None
            and isinstance(item, torch.Tensor)
            and item.dtype == torch.uint8
            and item.dim() == 4
        ):
            return self.normalize(item, memory_format=memory_format)
        return item

    def close(self) -> None:
        """End the iteration in flight and stop every worker process now."""
        if self._batches is not None:
            self._batches.close()
        shutdown_loader(self.train_loader)
        shutdown_loader(self.val_loader)


def _map_batch(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to every leaf of a (nested) list, tuple or dict batch."""
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_batch(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: _map_batch(v, fn) for k, v in batch.items()}
    return fn(batch)


def _tensors(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_batch(batch, lambda x: found.append(x) if isinstance(x, torch.Tensor) else None)
    return found


def shutdown_loader(loader: DataLoader | None) -> None:
    """Stop ``loader``'s worker processes now.

    Persistent workers otherwise live until the garbage collector finalises the loader's iterator,
    at an arbitrary later point (even inside unrelated code), where joining them can block.
    """
    if loader is None:
        return
    stop_workers(getattr(loader, "_iterator", None))
    loader._iterator = None


def stop_workers(iterator: Any) -> None:
    """Stop the worker processes of one iteration over a DataLoader (``iter(loader)``) now; an
    iterator without workers, or None, is left as it is.

    An iteration that raised (a bad sample) is kept alive by the exception's traceback, a
    reference cycle: the garbage collector finalises it later, after the weak-reference
    callbacks that close its queues, so its workers never receive the stop and it waits out
    torch's join timeout, 5 s per worker, wherever the collection happens to run.
    """
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


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
