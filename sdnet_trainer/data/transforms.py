"""The (train, val) image transforms ``data.augment`` describes (see
:mod:`~sdnet_trainer.data.augment` for the keys and presets), built with torchvision's v2
transforms the way its classification reference builds them
(``references/classification/presets.py``).

Every data set of image files (imagefolder, cifar10, shards, hf images) takes its (train, val)
transforms from :func:`build_transforms`::

    train: geometry of the preset -> auto-augment policy -> PILToTensor -> ToDtype(float32,
           scale=True) -> Normalize -> RandomErasing
    val:   Resize -> CenterCrop (preset none: resize only) -> PILToTensor -> ToDtype -> Normalize

The tail ``PILToTensor -> ToDtype -> Normalize`` is what ``defer_normalization``
(data/normalize.py) moves to the device on CUDA. Random erasing works on the normalized image (its
fill, 0, is the mean colour), so it follows Normalize and a pipeline with it stays on the float
path.

This module imports torchvision; only the image data sets and the image server import it (see
:mod:`~sdnet_trainer.lazy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import InterpolationMode

from sdnet_trainer.config.schema import AugmentConfig, DataConfig
from sdnet_trainer.data.augment import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CropSizes,
    crop_sizes,
    resolve_preset,
    validate_augment,
)


def build_transforms(
    cfg: DataConfig,
    *,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> tuple[v2.Compose, v2.Compose]:
    """(train, val) transforms of PIL images to normalized float32 [C, H, W] tensors, as
    ``data.augment`` describes them; ``mean`` / ``std`` are the data's statistics. The keys are
    checked first (also for callers that build a DataConfig themselves)."""
    validate_augment(cfg)
    aug, preset, sizes = cfg.augment, resolve_preset(cfg), crop_sizes(cfg)
    interpolation = InterpolationMode(aug.interpolation)  # its values are the config's names
    train: list[Any] = _train_geometry(preset, sizes.train_crop, aug.hflip, interpolation)
    policy = _auto_augment(aug, interpolation)
    if policy is not None:
        train.append(policy)
    train += _normalized(mean, std)
    if aug.random_erase > 0:
        train.append(v2.RandomErasing(p=aug.random_erase))
    val = _val_geometry(preset, sizes, interpolation) + _normalized(mean, std)
    return v2.Compose(train), v2.Compose(val)


def _train_geometry(
    preset: str, crop: int, hflip: float, interpolation: InterpolationMode
) -> list[Any]:
    if preset == "none":
        return [v2.Resize((crop, crop), interpolation=interpolation)]
    if preset == "imagenet":
        steps: list[Any] = [v2.RandomResizedCrop(crop, interpolation=interpolation)]
    else:  # cifar: the image at the crop size (resizing is a no-op where it already is)
        steps = [
            v2.Resize(crop, interpolation=interpolation),
            v2.CenterCrop(crop),
            v2.RandomCrop(crop, padding=crop // 8),
        ]
    if hflip > 0:  # p=0 would still draw a number per image
        steps.append(v2.RandomHorizontalFlip(hflip))
    return steps


def _val_geometry(preset: str, sizes: CropSizes, interpolation: InterpolationMode) -> list[Any]:
    if preset == "none":
        return [v2.Resize((sizes.val_crop, sizes.val_crop), interpolation=interpolation)]
    return [
        v2.Resize(sizes.val_resize, interpolation=interpolation),
        v2.CenterCrop(sizes.val_crop),
    ]


def _auto_augment(aug: AugmentConfig, interpolation: InterpolationMode) -> v2.Transform | None:
    if aug.auto_augment is None:
        return None
    if aug.auto_augment == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=interpolation)
    if aug.auto_augment == "ra":
        return v2.RandAugment(magnitude=aug.ra_magnitude, interpolation=interpolation)
    if aug.auto_augment == "augmix":
        return v2.AugMix(severity=aug.augmix_severity, interpolation=interpolation)
    return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=interpolation)


def _normalized(mean: Sequence[float], std: Sequence[float]) -> list[Any]:
    """PIL image -> uint8 tensor -> float32 in [0, 1] -> normalized: the tail that
    ``defer_normalization`` recognises and moves to the device."""
    return [
        v2.PILToTensor(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(list(mean), list(std)),
    ]
