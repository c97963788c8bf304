"""Datasets read from disk: an ImageNet-style class folder tree, and torchvision's CIFAR-10.

Every way the data can be missing or malformed becomes a :class:`ConfigError` naming ``data.root``
and the path, raised before any training process spends time building a model.

An image file that is there but cannot be decoded (truncated, not an image) only shows when it is
loaded, mid-training and often in a DataLoader worker; ``data.on_bad_sample`` decides what happens
then (:class:`CheckedImageFolder`): ``error`` stops with the file's path, ``skip`` loads the next
file that decodes in its place and counts it (:class:`SkippedSamples`). CIFAR-10 is read from
pickled arrays, not per-image files, so the policy does not apply to it. Both take their
transforms from ``data.augment`` (:func:`~sdnet_trainer.data.augment.build_transforms`).

On CUDA the loader hands images to the device as uint8 and they are converted to float and
normalized there (:func:`defer_normalization`, :class:`DeviceNormalize`): a quarter of the bytes
to copy, and the per-pixel float work off the loader's cores. ``data.decode=cuda`` goes further:
the loader only reads the JPEG files and draws each one's crop, and the device decodes them with
nvjpeg, crops and resizes (:class:`EncodedJpegFolder`, :class:`DeviceDecoder`).
"""

from __future__ import annotations

import copy
import io
import logging
import multiprocessing
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import datasets, transforms
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.config.schema import AugmentConfig, DataConfig
from sdnet_trainer.data.augment import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    EVAL_CROP_RATIO,
    IMAGENET_MEAN,
    IMAGENET_STD,
    build_transforms,
    crop_sizes,
)
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

CIFAR10_IMAGE_SIZE = 32
CIFAR10_NUM_CLASSES = 10

# data.on_bad_sample: what an image file that cannot be decoded does.
ON_BAD_SAMPLE = ("error", "skip")


def imagenet_transforms(image_size: int) -> tuple[v2.Compose, v2.Compose]:
    """(train, val) transforms of the standard ImageNet recipe (``data.augment.preset=imagenet``
    at ``image_size``)."""
    return build_transforms(DataConfig(image_size=image_size, augment=AugmentConfig("imagenet")))


def cifar10_transforms() -> tuple[v2.Compose, v2.Compose]:
    """(train, val) transforms of the standard CIFAR-10 recipe: pad-and-crop plus flips
    (``data.augment.preset=cifar`` at 32 px, CIFAR-10's statistics)."""
    cfg = DataConfig(image_size=CIFAR10_IMAGE_SIZE, augment=AugmentConfig("cifar"))
    return build_transforms(cfg, mean=CIFAR10_MEAN, std=CIFAR10_STD)


class DeviceNormalize:
    """The end of the float path (uint8 to float in [0, 1], then ``Normalize``) for a batch that
    arrives as uint8 [B, C, H, W] on the training device: the same operations in the same order,
    so on the CPU the result equals the float path's bit for bit. The float conversion is v2's
    ``ToDtype(float32, scale=True)`` (``x * (1 / 255)``), or with ``divide`` the older
    ``ToTensor``'s (``x / 255``): the two differ in the last bit for some values.

    ``memory_format`` is the layout of the float result (``torch.channels_last`` for
    ``model.channels_last``); the values do not depend on it.
    """

    def __init__(
        self, mean: Sequence[float], std: Sequence[float], *, divide: bool = False
    ) -> None:
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.divide = divide
        self._stats: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _key(self) -> tuple[Any, ...]:
        return self.mean, self.std, self.divide

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceNormalize) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"DeviceNormalize(mean={self.mean}, std={self.std}, divide={self.divide})"

    def __getstate__(self) -> dict[str, Any]:
        # Loader workers started by spawn receive data sets pickled, this with them: device
        # tensors must not travel (a worker would initialise CUDA).
        return {**self.__dict__, "_stats": {}}

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        stats = self._stats.get(device)
        if stats is None:  # copied to the device once, not per batch
            mean = torch.tensor(self.mean, dtype=torch.float32, device=device).view(-1, 1, 1)
            std = torch.tensor(self.std, dtype=torch.float32, device=device).view(-1, 1, 1)
            stats = self._stats[device] = (mean, std)
        return stats

    def __call__(
        self, images: torch.Tensor, *, memory_format: torch.memory_format = torch.contiguous_format
    ) -> torch.Tensor:
        mean, std = self._on(images.device)
        # uint8, or already float in [0, 255] (resized on the device): a new float tensor.
        out = images.to(torch.float32, memory_format=memory_format, copy=True)
        out = out.div_(255) if self.divide else out.mul_(1.0 / 255)  # as ToTensor / ToDtype
        return out.sub_(mean).div_(std)  # as Normalize


# The tails of a transform that defer_normalization moves to the device: v2's
# PILToTensor | ToImage -> ToDtype(float32, scale=True) -> Normalize (data.augment's pipelines),
# and the older ToTensor -> Normalize (a transform of one's own).
_TO_UINT8 = (v2.PILToTensor, v2.ToImage)


def _deferrable_tail(transform: Any) -> tuple[Any, DeviceNormalize] | None:
    """(the transform up to uint8 tensors, the device half) of a transform that ends in a tail
    above; None for any other."""
    if isinstance(transform, v2.Compose) and len(transform.transforms) >= 3:
        *head, to_uint8, to_float, normalize = transform.transforms
        if (
            type(to_uint8) in _TO_UINT8
            and type(to_float) is v2.ToDtype
            and to_float.dtype == torch.float32
            and to_float.scale
            and type(normalize) is v2.Normalize
        ):
            device_half = DeviceNormalize(normalize.mean, normalize.std)
            return v2.Compose([*head, to_uint8]), device_half
    if isinstance(transform, transforms.Compose) and len(transform.transforms) >= 2:
        *head, to_tensor, normalize = transform.transforms
        if type(to_tensor) is transforms.ToTensor and type(normalize) is transforms.Normalize:
            device_half = DeviceNormalize(normalize.mean, normalize.std, divide=True)
            # PILToTensor: the pixels as uint8 [C, H, W], without ToTensor's float conversion.
            return transforms.Compose([*head, transforms.PILToTensor()]), device_half
    return None


def defer_normalization(dataset: Dataset) -> tuple[Dataset, DeviceNormalize] | None:
    """``dataset`` delivering uint8 tensors, and what turns them into its float images on the
    device; None where ``dataset`` is not one of the data sets built here (imagefolder, CIFAR-10)
    or its transform does not end in one of the tails above. A transform with anything after
    ``Normalize`` (``data.augment.random_erase``: erasing fills with 0, the mean colour, in
    normalized units) is not deferred: the loader then hands over float images.

    The result is a shallow copy with its own transform (files, labels and the skip counter are
    shared): the original keeps producing float images for whoever else reads it (the FLOPs
    count, export).
    """
    if not isinstance(dataset, (CheckedImageFolder, datasets.CIFAR10)):
        return None
    tail = _deferrable_tail(dataset.transform)
    if tail is None:
        return None
    uint8_transform, device_half = tail
    uint8 = copy.copy(dataset)
    uint8.transform = uint8_transform
    uint8.transforms = datasets.vision.StandardTransform(uint8.transform, uint8.target_transform)
    return uint8, device_half


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


T = TypeVar("T")


def first_loadable(
    index: int,
    size: int,
    load: Callable[[int], T | None],
    skipped: SkippedSamples | None,
    *,
    none_loads: str,
) -> T:
    """``load(index)``; where it gives None (a bad sample under ``data.on_bad_sample=skip``), the
    first of ``index + 1, index + 2, ...`` (wrapping around) that loads, counted in ``skipped``.
    The same replacement every time, so resuming stays exact. ``none_loads``: the message when
    no sample of the ``size`` loads."""
    start = range(size)[int(index)]  # IndexError out of range, like ImageFolder
    for offset in range(size):
        loaded = load((start + offset) % size)
        if loaded is None:
            continue
        if offset and skipped is not None:
            skipped.add()
        return loaded
    raise BadSampleError(f"data: {none_loads} (data.on_bad_sample=skip)")


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


# data.decode
DECODE = ("cpu", "cuda")
JPEG_SUFFIXES = (".jpg", ".jpeg")
_JPEG_MAGIC = b"\xff\xd8\xff"


@dataclass
class _JpegFile:
    """A JPEG file read but not decoded: its bytes and its header (size, mode)."""

    data: bytes
    header: Image.Image  # opened lazily by PIL: the pixels are never decoded here
    path: str


@dataclass
class EncodedImage:
    """One sample under ``data.decode=cuda``: the file's bytes and where to crop it."""

    data: torch.Tensor  # uint8 [n]: the JPEG file
    box: tuple[int, int, int, int]  # (top, left, height, width) in the file's pixels
    flip: bool
    path: str


@dataclass
class EncodedImages:
    """A batch of :class:`EncodedImage`; the loader pins it (``pin_memory``) for the copy."""

    data: list[torch.Tensor]
    boxes: list[tuple[int, int, int, int]]
    flips: list[bool]
    paths: list[str]

    def pin_memory(self) -> EncodedImages:
        return EncodedImages(
            [d.pin_memory() for d in self.data], self.boxes, self.flips, self.paths
        )


def collate_encoded(samples: list[tuple[EncodedImage, int]]) -> tuple[EncodedImages, torch.Tensor]:
    """The loader's ``collate_fn`` under ``data.decode=cuda``: files differ in length, so they
    stay a list instead of being stacked."""
    images = [image for image, _ in samples]
    batch = EncodedImages(
        [i.data for i in images], [i.box for i in images], [i.flip for i in images],
        [i.path for i in images],
    )  # fmt: skip
    return batch, torch.tensor([label for _, label in samples], dtype=torch.int64)


def _read_jpeg(path: str) -> _JpegFile:
    """The file's bytes and header. What does not parse as a JPEG raises here, in the loader,
    where ``data.on_bad_sample`` handles it like a file PIL cannot decode."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(_JPEG_MAGIC):
        raise ValueError("not a JPEG file (data.decode=cuda decodes JPEG only)")
    header = Image.open(io.BytesIO(data))  # reads the header only
    if header.format not in ("JPEG", "MPO"):  # MPO: a camera's JPEG with extra frames
        raise ValueError(f"a {header.format} file, not JPEG (data.decode=cuda decodes JPEG only)")
    return _JpegFile(data, header, path)


class JpegCrop:
    """The loader's part of the ImageNet recipe under ``data.decode=cuda``: the box of the file's
    pixels that becomes the ``image_size`` square, and whether to flip it, from the file's size
    alone. Train draws a ``RandomResizedCrop`` box and a horizontal flip (probability ``hflip``)
    in the same order as the PIL path, so per-sample seeding keeps them reproducible; val takes
    the center crop of the image resized to ``resize_size`` (default ``image_size / 0.875``) on
    its short side, in the file's pixels."""

    def __init__(
        self,
        image_size: int,
        *,
        train: bool,
        hflip: float = 0.5,
        resize_size: int | None = None,
    ) -> None:
        self.image_size, self.train, self.hflip = image_size, train, hflip
        self.resize_size = resize_size or round(image_size / EVAL_CROP_RATIO)
        self._crop = transforms.RandomResizedCrop(image_size)  # its default scale and ratio

    def box(self, width: int, height: int) -> tuple[tuple[int, int, int, int], bool]:
        """((top, left, height, width), flip) for an image of ``width`` x ``height``."""
        if self.train:
            # get_params reads only the size: an empty tensor of that shape stands in.
            shape = torch.empty(1, 1, 1).expand(1, height, width)
            top, left, h, w = self._crop.get_params(shape, self._crop.scale, self._crop.ratio)
            # As RandomHorizontalFlip, which the PIL path leaves out (no draw) at p = 0.
            flip = self.hflip > 0 and bool(torch.rand(1) < self.hflip)
            return (int(top), int(left), int(h), int(w)), flip
        # Resize(short side -> resize_size) then CenterCrop(size), mapped back.
        side = self.image_size * min(width, height) / self.resize_size
        h, w = min(height, round(side)), min(width, round(side))
        return (round((height - h) / 2), round((width - w) / 2), h, w), False

    def __call__(self, jpeg: _JpegFile) -> EncodedImage:
        width, height = jpeg.header.size
        box, flip = self.box(width, height)
        data = torch.frombuffer(bytearray(jpeg.data), dtype=torch.uint8)
        return EncodedImage(data, box, flip, jpeg.path)


class DeviceDecoder:
    """The device's part under ``data.decode=cuda``: decode a batch of JPEG files with nvjpeg
    (``torchvision.io.decode_jpeg(device="cuda")``), resize each file's box (:class:`JpegCrop`) to
    ``image_size``, flip where drawn, then normalize. Resizing runs on float pixels with
    antialiasing, so the pixels differ slightly from PIL's on the CPU path (the same crops, not
    bit for bit the same data)."""

    def __init__(self, image_size: int, *, normalize: DeviceNormalize) -> None:
        self.image_size, self.normalize = image_size, normalize

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceDecoder) and (self.image_size, self.normalize) == (
            other.image_size,
            other.normalize,
        )

    def __hash__(self) -> int:
        return hash((self.image_size, self.normalize))

    def __call__(
        self,
        batch: EncodedImages,
        device: torch.device,
        *,
        memory_format: torch.memory_format = torch.contiguous_format,
    ) -> torch.Tensor:
        try:
            images = decode_jpeg(batch.data, mode=ImageReadMode.RGB, device=device)
        except RuntimeError as err:
            raise BadSampleError(self._which_failed(batch, device, err)) from err
        size = self.image_size
        out = torch.empty(len(images), 3, size, size, dtype=torch.float32, device=device)
        for i, image in enumerate(images):
            top, left, height, width = batch.boxes[i]
            pixels = TF.resized_crop(image.float(), top, left, height, width, [size, size])
            out[i] = pixels.flip(-1) if batch.flips[i] else pixels
        return self.normalize(out.clamp_(0, 255), memory_format=memory_format)

    @staticmethod
    def _which_failed(batch: EncodedImages, device: torch.device, err: Exception) -> str:
        """The batch failed as a whole: decode its files one by one to name the culprit."""
        for data, path in zip(batch.data, batch.paths):
            try:
                decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
            except RuntimeError as single:
                return (
                    f"data: nvjpeg cannot decode {path} ({single}); fix or remove the file, or "
                    f"set data.decode=cpu (where data.on_bad_sample=skip can replace it)"
                )
        return f"data: nvjpeg failed on a batch of {len(batch.paths)} files ({err})"


class EncodedJpegFolder(CheckedImageFolder):
    """A class folder tree of JPEG files for ``data.decode=cuda``: items are
    (:class:`EncodedImage`, label); :attr:`device_decoder` finishes them on the device. A file
    whose header does not read as JPEG follows ``data.on_bad_sample`` like an undecodable file on
    the CPU path."""

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
            loader=_read_jpeg,
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
    root = _require_root(cfg)
    _require_rgb(cfg)
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


def _require_cifar_shape(cfg: DataConfig) -> None:
    # The CIFAR recipe crops to 32 and the head must have 10 outputs; other values are a
    # config mistake, not something to silently resize around.
    if cfg.image_size != CIFAR10_IMAGE_SIZE:
        raise ConfigError(
            f"data.image_size={cfg.image_size}, but data.name='cifar10' images are "
            f"{CIFAR10_IMAGE_SIZE}x{CIFAR10_IMAGE_SIZE}"
        )
    if cfg.num_classes is not None and cfg.num_classes != CIFAR10_NUM_CLASSES:
        raise ConfigError(
            f"data.num_classes={cfg.num_classes}, but CIFAR-10 has {CIFAR10_NUM_CLASSES} classes"
        )


class _CifarUnpickler(pickle.Unpickler):
    """What the CIFAR-10 files hold (dicts, lists, strings, numbers, uint8 arrays) and nothing
    else: a file in data.root is data, and unpickling must not run code that it names."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),  # the files were written by numpy 1
        ("numpy._core.multiarray", "_reconstruct"),  # and by numpy 2
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # Python 3's protocol-2 bytes
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which CIFAR-10 files do not")
        return super().find_class(module, name)


def _cifar_file(path: Path, *, root: Path) -> dict[str, Any]:
    """One pickled dict of ``cifar-10-batches-py``, read as Python 2 wrote it (latin1 strings)."""
    where = f"data.root={str(root)!r}: {path.name}"
    try:
        with open(path, "rb") as f:
            entry = _CifarUnpickler(f, encoding="latin1").load()
    except FileNotFoundError as err:
        raise ConfigError(
            f"data.root={str(root)!r} does not hold CIFAR-10 ({path} is missing); run once with "
            f"data.download=true on a machine with internet access to fetch it there"
        ) from err
    except Exception as err:  # unpickling a damaged file raises many types
        raise ConfigError(f"{where} is not a CIFAR-10 file ({type(err).__name__}: {err})") from err
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} is not a CIFAR-10 file (a {type(entry).__name__}, not a dict)")
    return entry


class CIFAR10Files(datasets.CIFAR10):
    """torchvision's CIFAR10 (its items, ``classes``, ``targets``) from any files in the format of
    the python version's archive: read with a restricted unpickler and checked field by field,
    instead of being accepted only with the official files' md5 sums."""

    def __init__(self, root: Path, *, train: bool, transform: Any) -> None:
        datasets.VisionDataset.__init__(self, str(root), transform=transform)
        self.train = train
        folder = root / self.base_folder
        rows, self.targets = [], []
        for name, _md5 in self.train_list if train else self.test_list:
            entry = _cifar_file(folder / name, root=root)
            data, labels = entry.get("data"), entry.get("labels")
            where = f"data.root={str(root)!r}: {name}"
            if not (
                isinstance(data, np.ndarray)
                and data.dtype == np.uint8
                and data.ndim == 2
                and data.shape[1] == 3 * 32 * 32
            ):
                raise ConfigError(f"{where}: data is not a uint8 array of N x 3072 pixels")
            if not (
                isinstance(labels, list)
                and len(labels) == len(data)
                and all(isinstance(x, int) and 0 <= x < CIFAR10_NUM_CLASSES for x in labels)
            ):
                raise ConfigError(f"{where}: labels is not a list of {len(data)} class numbers 0-9")
            rows.append(data)
            self.targets.extend(labels)
        self.data = np.vstack(rows).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))  # HWC
        meta = _cifar_file(folder / self.meta["filename"], root=root)
        names = meta.get(self.meta["key"])
        if not (isinstance(names, list) and len(names) == CIFAR10_NUM_CLASSES):
            raise ConfigError(
                f"data.root={str(root)!r}: batches.meta has no list of 10 label_names"
            )
        self.classes = [str(n) for n in names]
        self.class_to_idx = {n: i for i, n in enumerate(self.classes)}


def _cifar10_split(cfg: DataConfig, root: Path, *, train: bool, transform) -> datasets.CIFAR10:
    if cfg.download:  # torchvision fetches the archive and checks its md5 sum
        datasets.CIFAR10(str(root), train=train, download=True)
    return CIFAR10Files(root, train=train, transform=transform)


def build_cifar10(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    """(train, val) = CIFAR-10's 50k training and 10k test images."""
    root = _require_root(cfg)
    _require_rgb(cfg)
    _require_cifar_shape(cfg)
    train_tf, val_tf = build_transforms(cfg, mean=CIFAR10_MEAN, std=CIFAR10_STD)
    train = _cifar10_split(cfg, root, train=True, transform=train_tf)
    val = _cifar10_split(cfg, root, train=False, transform=val_tf)
    logger.info("cifar10 %s: %d train / %d val images", root, len(train), len(val))
    return train, val
