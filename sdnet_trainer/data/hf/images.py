"""Labelled images from a Hugging Face dataset (``data.name=hf``, ``data.text_column`` null).

``data.image_column`` holds an ``Image`` feature (or raw encoded bytes), ``data.label_column`` a
``ClassLabel`` or an integer column; see :mod:`sdnet_trainer.data.hf`.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image as PILImage
from torch.utils.data import Dataset

from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.bad_samples import (
    ON_BAD_SAMPLE,
    BadSampleError,
    SkippedSamples,
    failure_reason,
    first_loadable,
)
from sdnet_trainer.data.folders import require_rgb
from sdnet_trainer.data.hf.load import TRAIN_SPLIT, VAL_SPLITS, require_column, require_datasets
from sdnet_trainer.data.transforms import build_transforms
from sdnet_trainer.errors import ConfigError

if TYPE_CHECKING:
    import datasets as hf_datasets

logger = logging.getLogger(__name__)

# Without a validation split, images hold out every HOLDOUT_EVERY-th row of train.
HOLDOUT_EVERY = 10


def _open_image(value: Any, root: Path) -> PILImage.Image:
    """The RGB image of one cell: an ``Image`` feature's ``{"bytes", "path"}`` or raw bytes, read
    as ImageFolder's loader reads a file (PIL, then ``convert("RGB")``)."""
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
    else:
        data, path = value, None
    if data is None:
        if not path:
            raise ValueError("the cell holds no image (null)")
        # An image stored by path: a relative one is taken from data.root, where a dataset that
        # keeps its files beside its table has them.
        file = Path(str(path))
        data = (file if file.is_absolute() or file.exists() else root / file).read_bytes()
    return PILImage.open(io.BytesIO(data)).convert("RGB")


class HFImages(Dataset):
    """``(image, label)`` from a table's image and label columns, images transformed like an
    image folder's; undecodable images follow ``data.on_bad_sample`` (see
    :class:`~sdnet_trainer.data.folders.CheckedImageFolder`: ``skip`` loads the next row that
    decodes, with its own label, the same one every time).

    ``rows``: the table's rows this data set holds, in order (a held-out part); None: all.
    """

    def __init__(
        self,
        table: hf_datasets.Dataset,
        *,
        image_column: str,
        label_column: str,
        transform: Any,
        num_classes: int,
        classes: list[str] | None = None,
        rows: Sequence[int] | None = None,
        on_bad_sample: str = "error",
        root: str | Path = "",
        split: str = TRAIN_SPLIT,
    ) -> None:
        check_choice("data.on_bad_sample", on_bad_sample, ON_BAD_SAMPLE)
        datasets = require_datasets()
        table = table.select_columns([image_column, label_column])
        if isinstance(table.features[image_column], datasets.Image):
            # Handed over undecoded, so the decoding (and its errors) are this class's, as for a
            # file of an image folder.
            table = table.cast_column(image_column, datasets.Image(decode=False))
        self.table = table
        # Rows are read straight from the Arrow columns: the datasets formatter costs several
        # times more per row (~0.4 ms against ~0.04 ms), as much as decoding a small image. A
        # table viewed through an indices mapping (Dataset.select) is left to the formatter,
        # which resolves the mapping.
        self._arrow = table.data if getattr(table, "_indices", None) is None else None
        self.rows = None if rows is None else np.asarray(rows, dtype=np.int64)
        self.image_column, self.label_column = image_column, label_column
        self.transform = transform
        self.num_classes = num_classes
        self.classes = classes
        self.on_bad_sample = on_bad_sample
        self.root, self.split = Path(root), split
        self.skipped = SkippedSamples(len(self)) if on_bad_sample == "skip" else None

    def __len__(self) -> int:
        return len(self.table) if self.rows is None else len(self.rows)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        size = len(self)
        image, label = first_loadable(
            index,
            size,
            self._load,
            self.skipped,
            none_loads=f"none of the {size} images of the {self.split!r} split of {self.root} can "
            f"be decoded; check data.root and data.image_column",
        )
        if self.transform is not None:
            image = self.transform(image)
        return image, label

    def _cells(self, row: int) -> tuple[Any, Any]:
        """(image cell, label) of the table's row ``row``."""
        if self._arrow is None:
            cells = self.table[row]
            return cells[self.image_column], cells[self.label_column]
        image = self._arrow.column(self.image_column)[row].as_py()
        return image, self._arrow.column(self.label_column)[row].as_py()

    def _load(self, index: int) -> tuple[PILImage.Image, int] | None:
        """(image, label) of sample ``index``; None when it is a known or newly found bad image."""
        skipped = self.skipped
        if skipped is not None and skipped.is_bad(index):
            return None
        row = index if self.rows is None else int(self.rows[index])
        cell, label = self._cells(row)
        try:
            image = _open_image(cell, self.root)
        except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, ... for bad data
            where = f"row {row} of the {self.split!r} split of {self.root}"
            reason = failure_reason(err, "")
            if skipped is None:
                raise BadSampleError(
                    f"data: cannot decode the image of {where} ({reason}); fix or remove the "
                    f"row, or set data.on_bad_sample=skip"
                ) from err
            if skipped.mark_bad(index):
                logger.warning(
                    "data: skipping %s (%s): its image cannot be decoded; the next row that "
                    "decodes is loaded in its place (data.on_bad_sample=skip)",
                    where,
                    reason,
                )
            return None
        return image, int(label)

    def __repr__(self) -> str:
        return (
            f"HFImages(root={str(self.root)!r}, split={self.split!r}, rows={len(self)}, "
            f"num_classes={self.num_classes})"
        )


def _check_image_column(cfg: DataConfig, ds: hf_datasets.Dataset, split: str) -> None:
    datasets = require_datasets()
    column = require_column(cfg, ds, "image_column", split)
    feature = ds.features[column]
    if isinstance(feature, datasets.Image):
        return
    if isinstance(feature, datasets.Value) and feature.dtype in ("binary", "large_binary"):
        return  # encoded image files as raw bytes
    raise ConfigError(
        f"data.image_column={column!r} of the {split!r} split of data.root={cfg.root!r} holds "
        f"{feature}, not images (an Image feature or encoded image bytes)"
    )


def _integer_labels(feature: Any, datasets: Any) -> bool:
    import pyarrow as pa

    return isinstance(feature, datasets.Value) and pa.types.is_integer(feature.pa_type)


def read_classes(
    cfg: DataConfig, labelled: list[tuple[str, hf_datasets.Dataset]]
) -> tuple[int, list[str] | None]:
    """(number of classes, class names or None) of ``data.label_column`` over the splits in
    ``labelled``: a ``ClassLabel``'s count and names, or the largest label + 1 for a plain
    integer column (see :func:`count_classes`). Every label is checked: present, >= 0, and below
    a ``ClassLabel``'s count."""
    import pyarrow.compute as pc

    datasets = require_datasets()
    column = cfg.label_column
    names: list[str] | None = None
    for split, ds in labelled:
        feature = ds.features[column]
        if isinstance(feature, datasets.ClassLabel):
            if names is not None and feature.names != names:
                raise ConfigError(
                    f"data.label_column={column!r}: the {split!r} split of data.root={cfg.root!r} "
                    f"names its classes differently from train ({feature.names[:5]} vs "
                    f"{names[:5]}), so the same number would mean different classes"
                )
            names = list(feature.names)
        elif not _integer_labels(feature, datasets):
            raise ConfigError(
                f"data.label_column={column!r} of the {split!r} split of data.root={cfg.root!r} "
                f"holds {feature}, not integer class labels (a ClassLabel or an integer column)"
            )
    largest = -1
    for split, ds in labelled:
        # The column of the whole underlying table: a held-out part of train shares its table,
        # whose rows are all checked once per split, which is what matters.
        labels = ds.data.column(column)
        if labels.null_count:
            raise ConfigError(
                f"data.label_column={column!r} of the {split!r} split of data.root={cfg.root!r} "
                f"has {labels.null_count} rows without a label"
            )
        if len(labels) == 0:
            continue
        bounds = pc.min_max(labels).as_py()
        if bounds["min"] < 0:
            raise ConfigError(
                f"data.label_column={column!r} of the {split!r} split of data.root={cfg.root!r} "
                f"holds the label {bounds['min']} (-1 marks a split without labels, such as many "
                f"test splits); labels must be class numbers >= 0"
            )
        largest = max(largest, int(bounds["max"]))
    if names is not None:
        if largest >= len(names):
            raise ConfigError(
                f"data.label_column={column!r} of data.root={cfg.root!r} holds the label "
                f"{largest}, but its ClassLabel has {len(names)} classes"
            )
        return len(names), names
    return largest + 1, None


def count_classes(cfg: DataConfig, count: int, *, exact: bool) -> int:
    """The number of classes, from the data's ``count`` and a ``data.num_classes`` that is set.

    A ``ClassLabel`` (``exact``) states the count: a set key must equal it. An integer column
    only bounds it from below (a class may have no rows): a set key at least the largest label
    + 1 is the count; a null key takes the largest label + 1, with a warning."""
    expected = getattr(cfg, "num_classes", None)
    if expected is None:
        if not exact:
            logger.warning(
                "data.label_column=%r of data.root=%r is a plain integer column: the number of "
                "classes is taken as the largest label + 1 = %d (a ClassLabel feature would "
                "state it exactly; data.num_classes can set it)",
                cfg.label_column,
                cfg.root,
                count,
            )
        return count
    if expected == count or (not exact and expected > count):
        return expected
    source = "its ClassLabel has" if exact else "its largest label + 1 gives"
    raise ConfigError(
        f"data.num_classes={expected}, but data.root={cfg.root!r} ({cfg.label_column!r} column): "
        f"{source} {count} classes; set data.num_classes to {count} or leave it null to take "
        f"the data's count"
    )


def build_hf_images(
    cfg: DataConfig, train: hf_datasets.Dataset, val: hf_datasets.Dataset | None, val_name: str
) -> tuple[HFImages, HFImages]:
    require_rgb(cfg)
    if cfg.decode != "cpu":
        raise ConfigError(
            f"data.decode={cfg.decode!r}: data.name='hf' decodes its images on the CPU; set "
            f"data.decode=cpu"
        )
    for split, ds in ((TRAIN_SPLIT, train), (val_name, val)):
        if ds is not None:
            _check_image_column(cfg, ds, split)
            require_column(cfg, ds, "label_column", split)
    if len(train) == 0:
        raise ConfigError(f"data.root={cfg.root!r}: the {TRAIN_SPLIT!r} split has no rows")
    labelled = [(TRAIN_SPLIT, train)] + ([] if val is None else [(val_name, val)])
    num_classes, names = read_classes(cfg, labelled)
    num_classes = count_classes(cfg, num_classes, exact=names is not None)
    train_rows = val_rows = None
    if val is None:
        if len(train) < HOLDOUT_EVERY:
            raise ConfigError(
                f"data.root={cfg.root!r} has no validation split ({'/'.join(VAL_SPLITS)}) and "
                f"only {len(train)} train rows; holding out every {HOLDOUT_EVERY}th row for "
                f"validation needs at least {HOLDOUT_EVERY}"
            )
        rows = np.arange(len(train))
        held_out = rows % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
        train_rows, val_rows = rows[~held_out], rows[held_out]
        val = train
        val_name = f"every {HOLDOUT_EVERY}th row of train"
    train_tf, val_tf = build_transforms(cfg)
    common: dict[str, Any] = dict(
        image_column=cfg.image_column,
        label_column=cfg.label_column,
        num_classes=num_classes,
        classes=names,
        on_bad_sample=cfg.on_bad_sample,
        root=str(cfg.root),
    )
    train_set = HFImages(train, rows=train_rows, transform=train_tf, split=TRAIN_SPLIT, **common)
    val_set = HFImages(val, rows=val_rows, transform=val_tf, split=val_name, **common)
    logger.info(
        "hf %s: %d train / %d val images (%s), %d classes",
        cfg.root,
        len(train_set),
        len(val_set),
        val_name,
        num_classes,
    )
    return train_set, val_set
