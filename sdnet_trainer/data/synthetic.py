"""Deterministic class-conditional images: a dataset that needs no download and can be learned.

Each class owns a fixed *prototype*: a small random grid per channel, upsampled bilinearly to the
image size, so the class shows as a smooth low-frequency pattern that a small CNN picks up within a
few dozen SGD steps. Sample ``i`` is ``signal * prototype[label] + noise * N(0, 1)``, where both the
label and the noise are pure functions of ``(seed, split, i)``. Nothing is precomputed per sample:
an item costs one small ``randn`` call, and ``ds[i]`` is identical every time and in every
DataLoader worker process.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

# Side length of the random grid each prototype is upsampled from: small enough that the pattern is
# smooth (learnable by convolutions and pooling), large enough that classes look different.
_PROTOTYPE_GRID = 4

_SPLITS = {"train": 0, "val": 1}

# Separate random streams, so e.g. changing the label shuffle never changes the prototypes.
_STREAM_PROTOTYPES = 1
_STREAM_LABELS = 2
_STREAM_NOISE = 3

_MASK64 = (1 << 64) - 1

# Classes generated when data.num_classes is null (as configs/data/synthetic.yaml sets): the data
# set is defined by its class count, so it cannot take one from elsewhere.
DEFAULT_NUM_CLASSES = 10


def _mix_seed(*parts: int) -> int:
    """Hash integers into one generator seed (splitmix64 finalizer, chained over the parts).

    Plain arithmetic such as ``seed * 1000 + i`` makes neighbouring seeds share noise streams;
    a real mix keeps every (seed, split, index) stream independent.
    """
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (part & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & _MASK64
        state ^= state >> 31
    # torch.Generator.manual_seed accepts up to 2**64 - 1, but keep it in int64 range to be safe.
    return state & ((1 << 63) - 1)


def check_index(index: int, size: int, name: str) -> int:
    """``index`` as a non-negative int below ``size`` (negative indices count from the end)."""
    index = int(index)
    if index < 0:
        index += size
    if not 0 <= index < size:
        raise IndexError(f"{name} index {index} out of range for size {size}")
    return index


def _generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(_mix_seed(*parts))


def _make_prototypes(
    seed: int, *, num_classes: int, channels: int, image_size: int
) -> torch.Tensor:
    """One smooth pattern per class, shape [K, C, H, W], each standardized to mean 0, std 1.

    Standardizing makes ``signal`` and ``noise`` comparable per pixel, whatever the image size.
    """
    gen = _generator(seed, _STREAM_PROTOTYPES)
    grid = torch.randn(num_classes, channels, _PROTOTYPE_GRID, _PROTOTYPE_GRID, generator=gen)
    protos = F.interpolate(
        grid, size=(image_size, image_size), mode="bilinear", align_corners=False
    )
    flat = protos.flatten(1)
    flat = (flat - flat.mean(dim=1, keepdim=True)) / flat.std(dim=1, keepdim=True).clamp_min(1e-6)
    return flat.view_as(protos).contiguous()


def _make_labels(size: int, *, seed: int, split_id: int, num_classes: int) -> torch.Tensor:
    """Exactly balanced labels (counts differ by at most one) in a seeded, shuffled order.

    ``i % num_classes`` alone would be balanced too, but then an unshuffled loader sees every class
    in lock-step; the shuffle breaks that link between index and label.
    """
    order = torch.randperm(size, generator=_generator(seed, split_id, _STREAM_LABELS))
    return order % num_classes


def _require_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"SyntheticImages: {name} must be >= 1, got {value}")


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """``size`` images of shape [channels, image_size, image_size] with labels in [0, num_classes).

    ``split`` selects the per-sample noise and label streams ("train" or "val"); the class
    prototypes depend on ``seed`` only, so a model trained on "train" is scored fairly on "val".
    """

    draws_random = False  # each sample is a pure function of its index (no per-sample seeding)

    def __init__(
        self,
        size: int,
        *,
        image_size: int,
        channels: int,
        num_classes: int,
        seed: int,
        signal: float = 1.0,
        noise: float = 1.0,
        split: str = "train",
    ) -> None:
        if size < 0:
            raise ValueError(f"SyntheticImages: size must be >= 0, got {size}")
        _require_positive("image_size", image_size)
        _require_positive("channels", channels)
        _require_positive("num_classes", num_classes)
        if split not in _SPLITS:
            raise ValueError(
                f"SyntheticImages: split must be one of {sorted(_SPLITS)}, got {split!r}"
            )
        self.size = size
        self.image_size = image_size
        self.channels = channels
        self.num_classes = num_classes
        self.seed = seed
        self.signal = float(signal)
        self.noise = float(noise)
        self.split = split
        self._split_id = _SPLITS[split]
        self.prototypes = _make_prototypes(
            seed, num_classes=num_classes, channels=channels, image_size=image_size
        )
        # O(size) integers, not images: cheap even for millions of samples.
        self.labels = _make_labels(
            size, seed=seed, split_id=self._split_id, num_classes=num_classes
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = check_index(index, self.size, type(self).__name__)
        label = int(self.labels[index])
        gen = _generator(self.seed, self._split_id, _STREAM_NOISE, index)
        noise = torch.randn(self.channels, self.image_size, self.image_size, generator=gen)
        image = self.signal * self.prototypes[label] + self.noise * noise
        return image, label

    def __repr__(self) -> str:
        return (
            f"SyntheticImages(size={self.size}, image_size={self.image_size}, "
            f"channels={self.channels}, num_classes={self.num_classes}, seed={self.seed}, "
            f"signal={self.signal}, noise={self.noise}, split={self.split!r})"
        )


def build_synthetic(cfg: DataConfig) -> tuple[SyntheticImages, SyntheticImages]:
    """The (train, val) pair described by ``cfg``: same prototypes, different noise and labels."""
    _validate(cfg)
    make = functools.partial(
        SyntheticImages,
        image_size=cfg.image_size,
        channels=cfg.channels,
        num_classes=DEFAULT_NUM_CLASSES if cfg.num_classes is None else cfg.num_classes,
        seed=cfg.synthetic_seed,
        signal=cfg.signal,
        noise=cfg.noise,
    )
    train = make(cfg.train_size, split="train")
    val = make(cfg.val_size, split="val")
    logger.info("synthetic data: %d train / %d val samples", len(train), len(val))
    return train, val


def _validate(cfg: DataConfig) -> None:
    # Checked here rather than left to SyntheticImages so the user sees the config key, not a
    # constructor argument name.
    for key in ("train_size", "val_size", "image_size", "channels", "num_classes"):
        value = getattr(cfg, key)
        if value is not None and value < 1:  # num_classes null: DEFAULT_NUM_CLASSES
            raise ConfigError(f"data.{key}={value} must be >= 1 for data.name='synthetic'")
