"""ImageNet-style class folder trees (``data.name=imagefolder``): ``root/{train,val}/<class>/*``.

Every way the tree can be missing or malformed becomes a :class:`ConfigError` naming
``data.root`` and the path, raised before any training process spends time building a model.

An image file that is there but cannot be decoded only shows when it is loaded;
:class:`CheckedImageFolder` follows ``data.on_bad_sample`` for it (see
:mod:`~sdnet_trainer.data.bad_samples`). Transforms come from ``data.augment``
(:func:`~sdnet_trainer.data.augment.build_transforms`).

On CUDA the loader can hand images to the device as uint8
(:func:`~sdnet_trainer.data.normalize.defer_normalization`, with
:class:`~sdnet_trainer.data.normalize.DeviceNormalize` on the device). ``data.decode=cuda`` goes
further: the loader only reads the JPEG files and draws each one's crop, and the device decodes
them (:class:`EncodedJpegFolder`, :mod:`~sdnet_trainer.data.jpeg`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset
from torchvision import datasets
from torchvision.transforms import v2

from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.config.schema import AugmentConfig, DataConfig
from sdnet_trainer.data.augment import IMAGENET_MEAN, IMAGENET_STD, crop_sizes
from sdnet_trainer.data.bad_samples import (
    ON_BAD_SAMPLE,
    BadSampleError,
    SkippedSamples,
    failure_reason,
    first_loadable,
)
from sdnet_trainer.data.jpeg import JPEG_SUFFIXES, DeviceDecoder, JpegCrop, read_jpeg
from sdnet_trainer.data.loader import DECODE
from sdnet_trainer.data.normalize import DeviceNormalize
from sdnet_trainer.data.transforms import build_transforms
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)


def imagenet_transforms(image_size: int) -> tuple[v2.Compose, v2.Compose]:
    """(train, val) transforms of the standard ImageNet recipe (``data.augment.preset=imagenet``
    at ``image_size``)."""
    return build_transforms(DataConfig(image_size=image_size, augment=AugmentConfig("imagenet")))


def require_root(cfg: DataConfig) -> Path:
    if cfg.root is None:
        raise ConfigError(f"data.root is required for data.name={cfg.name!r}; it is null")
    return Path(cfg.root).expanduser()


def require_rgb(cfg: DataConfig) -> None:
    # Both loaders decode to RGB and normalize with 3-channel statistics; any other channel count
    # would only surface later as a shape error inside the model's first layer.
    if cfg.channels != 3:
        raise ConfigError(
            f"data.channels={cfg.channels}, but data.name={cfg.name!r} yields RGB images "
            "(3 channels)"
        )


def _require_dir(path: Path, *, root: Path) -> None:
    if path.is_dir():
        return
    if path == root:
        raise ConfigError(f"data.root={str(root)!r} does not exist or is not a directory")
    raise ConfigError(
        f"data.root={str(root)!r} has no {path.name}/ folder: {str(path)!r} does not exist "
        f"(expected {path.name}/<class>/<image files>)"
    )


class CheckedImageFolder(datasets.ImageFolder):
    """An ImageFolder whose undecodable files follow ``data.on_bad_sample``.

    ``error`` raises :class:`BadSampleError` naming the file and the reason. ``skip`` loads, in
    place of sample ``i``, the first of ``i+1, i+2, ...`` (modulo the data set) that decodes, with
    its own label: a function of the files alone, so every epoch, worker and resumed run gets the
    same replacement. Each bad file is logged once (WARNING) and every replaced load is counted
    in :attr:`skipped`.
    """

    def __init__(
        self, root: str, *, transform: Any, on_bad_sample: str = "error", loader: Any = None
    ) -> None:
        if loader is None:
            super().__init__(root, transform=transform)
        else:
            super().__init__(root, transform=transform, loader=loader)
        check_choice("data.on_bad_sample", on_bad_sample, ON_BAD_SAMPLE)
        self.on_bad_sample = on_bad_sample
        self.skipped = SkippedSamples(len(self.samples)) if on_bad_sample == "skip" else None

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        size = len(self.samples)
        sample, target = first_loadable(
            index,
            size,
            self._load,
            self.skipped,
            none_loads=f"none of the {size} files under {self.root} can be decoded; "
            "check data.root",
        )
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    def _load(self, index: int) -> tuple[Any, Any] | None:
        """(image, label) of ``index``; None when it is a known or newly found bad file (skip)."""
        skipped = self.skipped
        if skipped is not None and skipped.is_bad(index):
            return None
        path, target = self.samples[index]
        try:
            return self.loader(path), target
        except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, ... for bad files
            reason = failure_reason(err, path)
            if skipped is None:
                raise BadSampleError(
                    f"data: cannot decode {path} ({reason}); fix or remove the file, or set "
                    f"data.on_bad_sample=skip"
                ) from err
            if skipped.mark_bad(index):
                logger.warning(
                    "data: skipping %s (%s): it cannot be decoded; the next file that decodes "
                    "is loaded in its place (data.on_bad_sample=skip)",
                    path,
                    reason,
                )
            return None


class EncodedJpegFolder(CheckedImageFolder):
    """A class folder tree of JPEG files for ``data.decode=cuda``: items are
    (:class:`~sdnet_trainer.data.jpeg.EncodedImage`, label); :attr:`device_decoder` finishes them
    on the device. A file whose header does not read as JPEG follows ``data.on_bad_sample`` like
    an undecodable file on the CPU path."""

    def __init__(
        self,
        root: str,
        *,
        image_size: int,
        train: bool,
        on_bad_sample: str = "error",
        hflip: float = 0.5,
        resize_size: int | None = None,
        cpu_transform: Any = None,
    ) -> None:
        super().__init__(
            root,
            transform=JpegCrop(image_size, train=train, hflip=hflip, resize_size=resize_size),
            on_bad_sample=on_bad_sample,
            loader=read_jpeg,
        )
        others = [path for path, _ in self.samples if not path.lower().endswith(JPEG_SUFFIXES)]
        if others:
            raise ConfigError(
                f"data.decode=cuda decodes JPEG files only, but {len(others)} of the "
                f"{len(self.samples)} files under {root} are not .jpg/.jpeg (e.g. {others[0]}); "
                f"convert them or set data.decode=cpu"
            )
        self.image_size, self.train = image_size, train
        self.cpu_transform = cpu_transform
        normalize = DeviceNormalize(IMAGENET_MEAN, IMAGENET_STD)
        self.device_decoder = DeviceDecoder(image_size, normalize=normalize)

    def decoded(self) -> CheckedImageFolder:
        """The same files through the CPU path (PIL, float): what code that needs ready images
        outside the loader (the FLOPs count) reads: ``cpu_transform``, else the ImageNet
        recipe's."""
        transform = self.cpu_transform
        if transform is None:
            train_tf, val_tf = imagenet_transforms(self.image_size)
            transform = train_tf if self.train else val_tf
        return CheckedImageFolder(
            self.root,
            transform=transform,
            on_bad_sample=self.on_bad_sample,
        )


def _image_folder(
    split_dir: Path, cfg: DataConfig, *, train: bool, transform: v2.Compose
) -> CheckedImageFolder:
    try:
        if cfg.decode == "cuda":  # one crop size for train and val (validate_augment)
            sizes = crop_sizes(cfg)
            return EncodedJpegFolder(
                str(split_dir),
                image_size=sizes.train_crop,
                train=train,
                on_bad_sample=cfg.on_bad_sample,
                hflip=cfg.augment.hflip,
                resize_size=sizes.val_resize,
                cpu_transform=transform,
            )
        return CheckedImageFolder(
            str(split_dir), transform=transform, on_bad_sample=cfg.on_bad_sample
        )
    except FileNotFoundError as err:
        # torchvision raises this for "no class sub-folders" and for "a class folder without a
        # single image file"; both mean the folder tree is not what data.root should point to.
        raise ConfigError(
            f"data.root={str(split_dir.parent)!r}: {str(split_dir)!r} is not a usable class "
            f"folder tree (expected {split_dir.name}/<class>/<image files>): {err}"
        ) from err


def _check_classes(
    cfg: DataConfig, train: CheckedImageFolder, val: CheckedImageFolder, *, root: Path
) -> None:
    # ImageFolder numbers classes by sorted folder name, so differing folder sets silently
    # mislabel the validation split.
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise ConfigError(
            f"data.root={str(root)!r}: train/ and val/ have different class folders "
            f"(only in train: {only_train[:5]}, only in val: {only_val[:5]})"
        )
    # data.num_classes null: the class folders decide (resolve_num_classes).
    if cfg.num_classes is not None and len(train.classes) != cfg.num_classes:
        raise ConfigError(
            f"data.num_classes={cfg.num_classes}, but data.root={str(root)!r} has "
            f"{len(train.classes)} class folders; set data.num_classes (and model.num_classes) "
            f"to {len(train.classes)}"
        )


def build_imagefolder(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    """(train, val) from ``root/train/<class>/*`` and ``root/val/<class>/*``; files that cannot be
    decoded follow ``data.on_bad_sample`` (see :class:`CheckedImageFolder`)."""
    root = require_root(cfg)
    require_rgb(cfg)
    _require_dir(root, root=root)
    train_dir, val_dir = root / "train", root / "val"
    _require_dir(train_dir, root=root)
    _require_dir(val_dir, root=root)
    check_choice("data.decode", cfg.decode, DECODE)
    train_tf, val_tf = build_transforms(cfg)
    train = _image_folder(train_dir, cfg, train=True, transform=train_tf)
    val = _image_folder(val_dir, cfg, train=False, transform=val_tf)
    _check_classes(cfg, train, val, root=root)
    logger.info(
        "imagefolder %s: %d train / %d val images, %d classes",
        root,
        len(train),
        len(val),
        len(train.classes),
    )
    return train, val
