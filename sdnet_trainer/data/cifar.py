"""torchvision's CIFAR-10 (``data.name=cifar10``), read without trusting pickle.

The python version's archive holds pickled arrays; :class:`CIFAR10Files` reads them with an
unpickler that admits only what the files hold (:class:`_CifarUnpickler`) and checks each field,
so a file in ``data.root`` is data and never code. Every way the files can be missing or
malformed becomes a :class:`ConfigError` naming ``data.root`` and the file. Transforms come from
``data.augment`` (:func:`~sdnet_trainer.data.augment.build_transforms`, CIFAR-10's statistics).
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset
from torchvision import datasets
from torchvision.transforms import v2

from sdnet_trainer.config.schema import AugmentConfig, DataConfig
from sdnet_trainer.data.augment import CIFAR10_MEAN, CIFAR10_STD
from sdnet_trainer.data.folders import require_rgb, require_root
from sdnet_trainer.data.transforms import build_transforms
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

CIFAR10_IMAGE_SIZE = 32
CIFAR10_NUM_CLASSES = 10


def cifar10_transforms() -> tuple[v2.Compose, v2.Compose]:
    """(train, val) transforms of the standard CIFAR-10 recipe: pad-and-crop plus flips
    (``data.augment.preset=cifar`` at 32 px, CIFAR-10's statistics)."""
    cfg = DataConfig(image_size=CIFAR10_IMAGE_SIZE, augment=AugmentConfig("cifar"))
    return build_transforms(cfg, mean=CIFAR10_MEAN, std=CIFAR10_STD)


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
    root = require_root(cfg)
    require_rgb(cfg)
    _require_cifar_shape(cfg)
    train_tf, val_tf = build_transforms(cfg, mean=CIFAR10_MEAN, std=CIFAR10_STD)
    train = _cifar10_split(cfg, root, train=True, transform=train_tf)
    val = _cifar10_split(cfg, root, train=False, transform=val_tf)
    logger.info("cifar10 %s: %d train / %d val images", root, len(train), len(val))
    return train, val
