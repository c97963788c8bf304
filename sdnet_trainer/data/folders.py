"""Datasets read from disk: an ImageNet-style class folder tree, and torchvision's CIFAR-10.

Every way the data can be missing or malformed becomes a :class:`ConfigError` naming ``data.root``
and the path, raised before any training process spends time building a model.

An image file that is there but cannot be decoded (truncated, not an image) only shows when it is
loaded, mid-training and often in a DataLoader worker; ``data.on_bad_sample`` decides what happens
then (:class:`CheckedImageFolder`): ``error`` stops with the file's path, ``skip`` loads the next
file that decodes in its place and counts it (:class:`SkippedSamples`). CIFAR-10 is read from
pickled arrays, not per-image files, so the policy does not apply to it.
"""

from __future__ import annotations

import logging
import multiprocessing
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset
from torchvision import datasets, transforms

from sdnet_trainer.config.checks import check_choice
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

# data.on_bad_sample: what an image file that cannot be decoded does.
ON_BAD_SAMPLE = ("error", "skip")

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


class BadSampleError(ConfigError):
    """A data file that cannot be decoded, under ``data.on_bad_sample=error``.

    Raised in a DataLoader worker, it reaches the main process through torch's
    ``ExceptionWrapper.reraise``, which builds a new ``BadSampleError`` from "Caught
    BadSampleError in DataLoader worker process N." plus the worker's whole traceback. The
    constructor keeps only the original one-line message, so the CLI's ``config error: ...`` line
    names the file either way.
    """

    def __init__(self, message: str) -> None:
        super().__init__(_original_message(str(message), type(self)))


def _original_message(message: str, cls: type) -> str:
    """``message`` itself, or, for torch's re-raised worker traceback, its last line without the
    exception's qualified name."""
    if "Original Traceback" not in message:
        return message
    prefix = f"{cls.__module__}.{cls.__qualname__}: "
    lines = [line for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith(prefix):
            return line[len(prefix) :]
    return message


class SkippedSamples:
    """The samples replaced under ``data.on_bad_sample=skip``, shared with DataLoader workers.

    Calling it gives how many sample loads were replaced so far, by this process and by its loader
    workers (counted when loaded, so prefetched batches are included). It lives in shared memory
    created with the data set, before any worker starts: forked workers inherit it, spawned ones
    receive it with the data set. It also remembers which indices are known bad, so each bad file
    is logged once per run and not decoded again.
    """

    def __init__(self, size: int) -> None:
        context = multiprocessing.get_context()
        self._count = context.Value("q", 0)
        # Guarded by the count's lock for writes; a racing read at worst decodes a file again.
        self._bad = context.RawArray("b", size)

    def __call__(self) -> int:
        return int(self._count.value)

    def is_bad(self, index: int) -> bool:
        return bool(self._bad[index])

    def mark_bad(self, index: int) -> bool:
        """Remember ``index`` as undecodable; True the first time it is marked in this run."""
        with self._count.get_lock():
            first = not self._bad[index]
            self._bad[index] = 1
        return first

    def add(self) -> None:
        with self._count.get_lock():
            self._count.value += 1


def _reason(err: BaseException, path: str) -> str:
    """``Type: message``; PIL's "cannot identify image file <_io.BufferedReader name=...>" loses
    the file object's repr, as the path is in the message already."""
    text = str(err).replace(f"<_io.BufferedReader name={path!r}>", "").strip()
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class CheckedImageFolder(datasets.ImageFolder):
    """An ImageFolder whose undecodable files follow ``data.on_bad_sample``.

    ``error`` raises :class:`BadSampleError` naming the file and the reason. ``skip`` loads, in
    place of sample ``i``, the first of ``i+1, i+2, ...`` (modulo the data set) that decodes, with
    its own label: a function of the files alone, so every epoch, worker and resumed run gets the
    same replacement. Each bad file is logged once (WARNING) and every replaced load is counted
    in :attr:`skipped`.
    """

    def __init__(self, root: str, *, transform: Any, on_bad_sample: str = "error") -> None:
        super().__init__(root, transform=transform)
        check_choice("data.on_bad_sample", on_bad_sample, ON_BAD_SAMPLE)
        self.on_bad_sample = on_bad_sample
        self.skipped = SkippedSamples(len(self.samples)) if on_bad_sample == "skip" else None

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        size = len(self.samples)
        start = range(size)[index]  # IndexError out of range, like ImageFolder
        for offset in range(size):
            loaded = self._load((start + offset) % size)
            if loaded is None:
                continue
            if offset and self.skipped is not None:
                self.skipped.add()
            sample, target = loaded
            if self.transform is not None:
                sample = self.transform(sample)
            if self.target_transform is not None:
                target = self.target_transform(target)
            return sample, target
        raise BadSampleError(
            f"data: none of the {size} files under {self.root} can be decoded "
            f"(data.on_bad_sample=skip); check data.root"
        )

    def _load(self, index: int) -> tuple[Any, Any] | None:
        """(image, label) of ``index``; None when it is a known or newly found bad file (skip)."""
        skipped = self.skipped
        if skipped is not None and skipped.is_bad(index):
            return None
        path, target = self.samples[index]
        try:
            return self.loader(path), target
        except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, ... for bad files
            reason = _reason(err, path)
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


def _image_folder(
    split_dir: Path, *, transform: transforms.Compose, on_bad_sample: str
) -> CheckedImageFolder:
    try:
        return CheckedImageFolder(str(split_dir), transform=transform, on_bad_sample=on_bad_sample)
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
    if len(train.classes) != cfg.num_classes:
        raise ConfigError(
            f"data.num_classes={cfg.num_classes}, but data.root={str(root)!r} has "
            f"{len(train.classes)} class folders; set data.num_classes (and model.num_classes) "
            f"to {len(train.classes)}"
        )


def build_imagefolder(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    """(train, val) from ``root/train/<class>/*`` and ``root/val/<class>/*``; files that cannot be
    decoded follow ``data.on_bad_sample`` (see :class:`CheckedImageFolder`)."""
    root = _require_root(cfg)
    _require_rgb(cfg)
    _require_dir(root, root=root)
    train_dir, val_dir = root / "train", root / "val"
    _require_dir(train_dir, root=root)
    _require_dir(val_dir, root=root)
    train_tf, val_tf = imagenet_transforms(cfg.image_size)
    train = _image_folder(train_dir, transform=train_tf, on_bad_sample=cfg.on_bad_sample)
    val = _image_folder(val_dir, transform=val_tf, on_bad_sample=cfg.on_bad_sample)
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
