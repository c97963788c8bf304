"""``data.augment.*``, ``data.mixup_alpha`` and ``data.cutmix_alpha`` as config: their checks,
the presets and the sizes they give, and the training batch mixer (:class:`BatchMixer`). The
transforms themselves are built in :mod:`~sdnet_trainer.data.transforms`.

The presets (``data.augment.preset``; auto picks cifar for train crops of at most 64 px, imagenet
above):

- ``imagenet``: RandomResizedCrop (scale 0.08-1) + flip; val resizes the short side to
  crop / 0.875 (or ``val_resize_size``) and takes the center crop;
- ``cifar``: the image at the crop size (resized only where it differs), padded by an eighth of
  the crop (4 px at 32) and randomly cropped back + flip; val takes the image at the crop size;
- ``none``: every image resized to the crop size, nothing random but what the other keys add.

This module imports no torchvision (see :mod:`~sdnet_trainer.lazy`): every run checks its config
here, and only runs of image files build transforms. The mixer imports torchvision's v2 when one is
built.

MixUp / CutMix (:class:`BatchMixer`) run on each training micro-batch once it is on the device:
after the device normalization of the uint8 path (mixing uint8 pixels would round), on the GPU
where mixing costs next to nothing, and in the training process, where the batch's place in the
epoch is known to seed its draws; a collate function runs in loader workers that know neither.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.config.schema import AugmentConfig, DataConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.runtime.rng import derive_seed

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Per-pixel statistics of the CIFAR-10 training set.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

# data.augment.preset, data.augment.auto_augment (or null), data.augment.interpolation
PRESETS = ("auto", "imagenet", "cifar", "none")
AUTO_AUGMENTS = ("ta_wide", "ra", "augmix", "imagenet")
# The names of torchvision's InterpolationMode values (data/transforms.py maps them).
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
# auto: train crops up to this size take the cifar preset. Small images carry their content at
# the full frame: cropping 8% of a 32 px digit leaves nothing of it.
AUTO_CIFAR_MAX_CROP = 64
# The usual evaluation resizes the short side to crop / 0.875 (256 for 224), then center-crops.
EVAL_CROP_RATIO = 0.875
# AugMix works on tensors, which torchvision's affine warps support in these modes only (the
# other policies warp PIL images, which take bicubic too).
_TENSOR_INTERPOLATIONS = ("bilinear", "nearest")
# RandAugment's magnitude bins (torchvision's default) and AugMix's severity range.
_RA_BINS = 31
_AUGMIX_SEVERITY = (1, 10)


class CropSizes(NamedTuple):
    """The pixel sizes the transforms produce: ``data.augment.*_size`` or ``data.image_size``."""

    train_crop: int
    val_resize: int  # the short side (imagenet, cifar presets) before the center crop
    val_crop: int


def resolve_preset(cfg: DataConfig) -> str:
    """``data.augment.preset`` with auto decided: cifar for train crops of at most 64 px, else
    imagenet. ``data.decode=cuda`` decodes and crops on the device with the imagenet recipe only,
    so auto is imagenet there."""
    preset = cfg.augment.preset
    if preset != "auto":
        return preset
    if cfg.decode == "cuda":
        return "imagenet"
    small = (cfg.augment.train_crop_size or cfg.image_size) <= AUTO_CIFAR_MAX_CROP
    return "cifar" if small else "imagenet"


def crop_sizes(cfg: DataConfig) -> CropSizes:
    aug = cfg.augment
    val_crop = aug.val_crop_size or cfg.image_size
    val_resize = aug.val_resize_size
    if val_resize is None:  # imagenet: the crop is the middle 87.5%; cifar: the whole image
        imagenet = resolve_preset(cfg) == "imagenet"
        val_resize = round(val_crop / EVAL_CROP_RATIO) if imagenet else val_crop
    return CropSizes(aug.train_crop_size or cfg.image_size, val_resize, val_crop)


def changed_augment_keys(aug: AugmentConfig) -> list[str]:
    """The ``data.augment.*`` keys set to something other than their default."""
    default = AugmentConfig()
    return [
        f"data.augment.{f.name}"
        for f in dataclasses.fields(AugmentConfig)
        if getattr(aug, f.name) != getattr(default, f.name)
    ]


def validate_augment(cfg: DataConfig) -> None:
    """``data.augment.*``, ``data.mixup_alpha`` and ``data.cutmix_alpha`` on their own and
    against ``data.decode``; part of :func:`~sdnet_trainer.data.validate_data`."""
    aug = cfg.augment
    check_choice("data.augment.preset", aug.preset, PRESETS)
    if aug.auto_augment is not None:
        check_choice("data.augment.auto_augment", aug.auto_augment, AUTO_AUGMENTS)
    check_choice("data.augment.interpolation", aug.interpolation, INTERPOLATIONS)
    if not 0 <= aug.ra_magnitude < _RA_BINS:
        raise ConfigError(
            f"data.augment.ra_magnitude={aug.ra_magnitude} must be in [0, {_RA_BINS - 1}]"
        )
    low, high = _AUGMIX_SEVERITY
    if not low <= aug.augmix_severity <= high:
        raise ConfigError(
            f"data.augment.augmix_severity={aug.augmix_severity} must be in [{low}, {high}]"
        )
    for key, probability in (("random_erase", aug.random_erase), ("hflip", aug.hflip)):
        if not 0.0 <= probability <= 1.0:
            raise ConfigError(f"data.augment.{key}={probability} must be in [0, 1]")
    for key in ("train_crop_size", "val_resize_size", "val_crop_size"):
        check_positive(f"data.augment.{key}", getattr(aug, key), allow_none=True)
    check_positive("data.mixup_alpha", cfg.mixup_alpha, allow_zero=True)
    check_positive("data.cutmix_alpha", cfg.cutmix_alpha, allow_zero=True)
    if aug.auto_augment == "augmix" and aug.interpolation not in _TENSOR_INTERPOLATIONS:
        raise ConfigError(
            f"data.augment.auto_augment=augmix transforms tensors, which torchvision warps with "
            f"{' or '.join(_TENSOR_INTERPOLATIONS)} only, not data.augment.interpolation="
            f"{aug.interpolation}"
        )
    preset = resolve_preset(cfg)
    if preset == "none" and aug.val_resize_size is not None:
        raise ConfigError(
            f"data.augment.val_resize_size={aug.val_resize_size} applies to the imagenet and "
            f"cifar presets; data.augment.preset=none resizes straight to the crop size"
        )
    if cfg.decode == "cuda":
        _check_device_decoding(cfg, preset)


def _check_device_decoding(cfg: DataConfig, preset: str) -> None:
    """``data.decode=cuda`` crops on the host and decodes, resizes and flips on the device: the
    imagenet preset at one crop size, bilinear, without auto-augment or erasing."""
    aug, sizes = cfg.augment, crop_sizes(cfg)
    unsupported = []
    if preset != "imagenet":
        unsupported.append(f"data.augment.preset={aug.preset}")
    if aug.auto_augment is not None:
        unsupported.append(f"data.augment.auto_augment={aug.auto_augment}")
    if aug.random_erase > 0:
        unsupported.append(f"data.augment.random_erase={aug.random_erase}")
    if aug.interpolation != "bilinear":
        unsupported.append(f"data.augment.interpolation={aug.interpolation}")
    if sizes.train_crop != sizes.val_crop:
        unsupported.append(
            f"a train crop of {sizes.train_crop} and a val crop of {sizes.val_crop} "
            f"(data.augment.train_crop_size, val_crop_size)"
        )
    if unsupported:
        raise ConfigError(
            f"data.decode=cuda decodes and crops with the imagenet preset at one crop size "
            f"(bilinear, no auto-augment or erasing); not with {', '.join(unsupported)}: set "
            f"data.decode=cpu or drop those keys"
        )


# --------------------------------------------------------------------------------------------
# MixUp / CutMix
# --------------------------------------------------------------------------------------------

# Keeps the mixer's seeds apart from the per-sample seeds of data/seeding.py.
_MIX_STREAM = 0x6D6978


class BatchMixer:
    """torchvision's v2 MixUp or CutMix (one of them, drawn per batch, when both alphas are > 0)
    over a training micro-batch ``(images [B, C, H, W] float, labels [B] int, *rest)``: images
    mixed with the batch rolled by one, labels turned into the matching probabilities
    [B, num_classes] for the cross-entropy loss (which takes probability targets; label
    smoothing applies to them too). Items after the labels pass through.

    torchvision draws the mixing weight, the box and the choice from torch's CPU generator; here
    that generator is seeded from (seed, epoch, the step's place in the epoch's sample order, the
    micro-step, the data-parallel rank) for each batch and restored afterwards, so a batch mixes
    the same way whenever it is drawn (a resumed run mixes as the uninterrupted one did; tensor
    and pipeline peers, which share a data-parallel rank, mix alike) and no other code's draws
    move it. The mixing itself runs where the batch is, without a host synchronisation.
    """

    def __init__(
        self, *, mixup_alpha: float, cutmix_alpha: float, num_classes: int, seed: int
    ) -> None:
        # Imported here, not at the top: a run without mixing needs no torchvision.
        from torchvision.transforms import v2

        mixers: list[v2.Transform] = []
        if mixup_alpha > 0:
            mixers.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
        if cutmix_alpha > 0:
            mixers.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
        if not mixers:
            raise ValueError("BatchMixer needs mixup_alpha > 0 or cutmix_alpha > 0")
        self.transform = mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)
        self.num_classes, self.seed = num_classes, seed

    @classmethod
    def from_config(cls, cfg: DataConfig, *, seed: int) -> BatchMixer | None:
        """The mixer ``data.mixup_alpha`` / ``data.cutmix_alpha`` ask for; None when both are 0.
        ``data.num_classes`` must be resolved (the Trainer takes it from the data first)."""
        if cfg.mixup_alpha <= 0 and cfg.cutmix_alpha <= 0:
            return None
        if cfg.num_classes is None:
            raise ConfigError(
                f"data.mixup_alpha={cfg.mixup_alpha} / data.cutmix_alpha={cfg.cutmix_alpha} need "
                f"the class count, but data.num_classes is null; set it"
            )
        return cls(
            mixup_alpha=cfg.mixup_alpha,
            cutmix_alpha=cfg.cutmix_alpha,
            num_classes=cfg.num_classes,
            seed=seed,
        )

    def batch_seed(self, *, epoch: int, step_sample: int, micro_step: int, dp_rank: int) -> int:
        seed = derive_seed(self.seed + epoch, rank=dp_rank, step=step_sample)
        return derive_seed(seed, rank=micro_step, step=_MIX_STREAM)

    def __call__(
        self, batch: Any, *, epoch: int, step_sample: int, micro_step: int, dp_rank: int
    ) -> Any:
        images, labels, rest = self._split(batch)
        seed = self.batch_seed(
            epoch=epoch, step_sample=step_sample, micro_step=micro_step, dp_rank=dp_rank
        )
        # Only the CPU generator, which torchvision draws from: torch.manual_seed would reseed
        # the CUDA generators (dropout) as well.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            images, targets = self.transform(images, labels)
        return type(batch)((images, targets, *rest))

    @staticmethod
    def _split(batch: Any) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
        """(images, labels, the rest) of an image classifier's batch; anything else is a config
        error naming the keys."""
        if isinstance(batch, (list, tuple)) and len(batch) >= 2:
            images, labels, *rest = batch
            if (
                isinstance(images, torch.Tensor)
                and isinstance(labels, torch.Tensor)
                and images.dim() == 4
                and images.is_floating_point()
                and labels.dim() == 1
                and not labels.is_floating_point()
                and len(images) == len(labels)
            ):
                return images, labels.long(), rest  # one_hot takes int64 only
        raise ConfigError(
            f"data.mixup_alpha / data.cutmix_alpha mix image classification batches (images "
            f"[B, C, H, W] float, labels [B] int, ...), but this training batch is "
            f"{_describe(batch)}; set both to 0 for this data"
        )


def _describe(batch: Any) -> str:
    if isinstance(batch, torch.Tensor):
        return f"a {tuple(batch.shape)} {str(batch.dtype).removeprefix('torch.')} tensor"
    if isinstance(batch, (list, tuple)):
        return f"({', '.join(_describe(item) for item in batch)})"
    return type(batch).__name__
