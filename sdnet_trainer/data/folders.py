"""Datasets read from disk: an ImageNet-style class folder tree, and torchvision's CIFAR-10.

Every way the data can be missing or malformed becomes a :class:`ConfigError` naming ``data.root``
and the path, raised before any training process spends time building a model.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch.utils.data import Dataset
from torchvision import datasets, transforms

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Per-pixel statistics of the CIFAR-10 training set.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)

CIFAR10_IMAGE_SIZE = 32
CIFAR10_NUM_CLASSES = 10

# The usual evaluation recipe resizes the short side to image_size / 0.875 (256 for 224) and then
# center-crops image_size.
_EVAL_CROP_RATIO = 0.875


def imagenet_transforms(image_size: int) -> tuple[transforms.Compose, transforms.Compose]:
    """(train, val) transforms of the standard ImageNet recipe."""
    normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train = transforms.Compose(
        [
            transforms.RandomResizedCrop(image_size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]
    )
    val = transforms.Compose(
        [
            transforms.Resize(round(image_size / _EVAL_CROP_RATIO)),
            transforms.CenterCrop(image_size),
            transforms.ToTensor(),
            normalize,
        ]
    )
    return train, val


def cifar10_transforms() -> tuple[transforms.Compose, transforms.Compose]:
    """(train, val) transforms of the standard CIFAR-10 recipe: pad-and-crop plus flips."""
    normalize = transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)
    train = transforms.Compose(
        [
            transforms.RandomCrop(CIFAR10_IMAGE_SIZE, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]
    )
    val = transforms.Compose([transforms.ToTensor(), normalize])
    return train, val


def _require_root(cfg: DataConfig) -> Path:
    if cfg.root is None:
        raise ConfigError(f"data.root is required for data.name={cfg.name!r}; it is null")
    return Path(cfg.root).expanduser()


def _require_rgb(cfg: DataConfig) -> None:
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


def _image_folder(split_dir: Path, *, transform: transforms.Compose) -> datasets.ImageFolder:
    try:
        return datasets.ImageFolder(str(split_dir), transform=transform)
    except FileNotFoundError as err:
        # torchvision raises this for "no class sub-folders" and for "a class folder without a
        # single image file"; both mean the folder tree is not what data.root should point to.
        raise ConfigError(
            f"data.root={str(split_dir.parent)!r}: {str(split_dir)!r} is not a usable class "
            f"folder tree (expected {split_dir.name}/<class>/<image files>): {err}"
        ) from err


def _check_classes(
    cfg: DataConfig, train: datasets.ImageFolder, val: datasets.ImageFolder, *, root: Path
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
    if len(train.classes) != cfg.num_classes:
        raise ConfigError(
            f"data.num_classes={cfg.num_classes}, but data.root={str(root)!r} has "
            f"{len(train.classes)} class folders; set data.num_classes (and model.num_classes) "
            f"to {len(train.classes)}"
        )


def build_imagefolder(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    """(train, val) from ``root/train/<class>/*`` and ``root/val/<class>/*``."""
    root = _require_root(cfg)
    _require_rgb(cfg)
    _require_dir(root, root=root)
    train_dir, val_dir = root / "train", root / "val"
    _require_dir(train_dir, root=root)
    _require_dir(val_dir, root=root)
    train_tf, val_tf = imagenet_transforms(cfg.image_size)
    train = _image_folder(train_dir, transform=train_tf)
    val = _image_folder(val_dir, transform=val_tf)
    _check_classes(cfg, train, val, root=root)
    logger.info(
        "imagefolder %s: %d train / %d val images, %d classes",
        root,
        len(train),
        len(val),
        len(train.classes),
    )
    return train, val


def _require_cifar_shape(cfg: DataConfig) -> None:
    # The CIFAR recipe crops to 32 and the head must have 10 outputs; other values are a
    # config mistake, not something to silently resize around.
    if cfg.image_size != CIFAR10_IMAGE_SIZE:
        raise ConfigError(
            f"data.image_size={cfg.image_size}, but data.name='cifar10' images are "
            f"{CIFAR10_IMAGE_SIZE}x{CIFAR10_IMAGE_SIZE}"
        )
    if cfg.num_classes != CIFAR10_NUM_CLASSES:
        raise ConfigError(
            f"data.num_classes={cfg.num_classes}, but CIFAR-10 has {CIFAR10_NUM_CLASSES} classes"
        )


def _cifar10_split(cfg: DataConfig, root: Path, *, train: bool, transform) -> datasets.CIFAR10:
    try:
        return datasets.CIFAR10(str(root), train=train, download=cfg.download, transform=transform)
    except RuntimeError as err:
        if "not found" not in str(err).lower():
            raise
        raise ConfigError(
            f"data.root={str(root)!r} does not hold CIFAR-10 (cifar-10-batches-py missing or "
            f"corrupted); run once with data.download=true on a machine with internet access "
            f"to fetch it there"
        ) from err


def build_cifar10(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    """(train, val) = CIFAR-10's 50k training and 10k test images."""
    root = _require_root(cfg)
    _require_rgb(cfg)
    _require_cifar_shape(cfg)
    train_tf, val_tf = cifar10_transforms()
    train = _cifar10_split(cfg, root, train=True, transform=train_tf)
    val = _cifar10_split(cfg, root, train=False, transform=val_tf)
    logger.info("cifar10 %s: %d train / %d val images", root, len(train), len(val))
    return train, val
