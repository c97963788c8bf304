"""Hugging Face datasets on disk (``data.name=hf``): labelled images, or text for a language model.

``data.root`` is one of:

- a dataset written by ``save_to_disk``: a ``DatasetDict`` (a folder with ``dataset_dict.json``)
  or a single ``Dataset`` (a folder with ``state.json``), read with ``load_from_disk``
  (memory-mapped, no copy);
- a folder of ``.parquet`` or of ``.arrow`` files (not both), read with ``load_dataset("parquet"
  | "arrow", data_dir=root)``. Splits follow the Hub's naming rules for file and folder names:
  ``train*`` or ``train/``, ``validation*`` / ``val*`` / ``valid*`` / ``dev*`` or such a folder,
  ``test*`` or ``test/`` (e.g. the Hub's own ``data/train-00000-of-00004.parquet``); files that
  match no split name all form the train split. ``datasets`` converts them once into its Arrow
  cache (``HF_DATASETS_CACHE``, normally ``~/.cache/huggingface/datasets``) and memory-maps that;
- a single ``.parquet`` or ``.arrow`` file: the train split.

Train is the ``train`` split; validation is the first of ``validation``, ``val``, ``valid``,
``dev``, ``test`` that exists. Without one, a part of train is held out: every 10th row for
images (a label-sorted table still gives every class to both), the last ~10% of the tokens for
text (as ``data.name=text`` does).

Images (``data.text_column`` null): ``data.image_column`` holds an ``Image`` feature (or raw
encoded bytes), ``data.label_column`` a ``ClassLabel`` or an integer column. Each image is decoded
with PIL, converted to RGB and transformed exactly as an image folder's files are (``data.augment``,
:func:`~sdnet_trainer.data.augment.build_transforms`); one that does not decode
follows ``data.on_bad_sample`` as in :class:`~sdnet_trainer.data.folders.CheckedImageFolder`. The
number of classes, :attr:`HFImages.num_classes`, is the ``ClassLabel``'s (a ``data.num_classes``
that is set must equal it); a plain integer column states only a lower bound, the largest label +
1, which a null ``data.num_classes`` takes with a warning and a set one may exceed.

Text (``data.text_column`` set): every row's text, in row order, is one token stream, cut into
windows of ``data.seq_len + 1`` tokens at stride ``data.seq_len``, the format of
:class:`~sdnet_trainer.data.tokens.TextBytes`: ``(inputs, targets)``, targets shifted by one.
With ``data.tokenizer`` null the tokens are the UTF-8 bytes (``data.vocab_size=256``) and rows are
joined by a newline; otherwise they are the ids of the Hugging Face tokenizer that
``data.tokenizer`` names (a ``tokenizer.json`` file, a folder holding one, or a Hub name), each
row encoded with the tokenizer's own special tokens (its BOS/EOS, if it adds them, mark where
documents meet), and ``data.vocab_size`` must hold all its ids. The text is tokenized once when
the data set is built, on every rank, and held in memory.

Both kinds are map-style with a length, so the global-index sampler's guarantees (exact resume,
world-size changes) hold unchanged, and both pickle for loader workers (a memory-mapped table
pickles as its file path).

``datasets`` (and ``tokenizers`` for ``data.tokenizer``) are optional: ``pip install
'sdnet_trainer[hf]'``.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image as PILImage
from torch.utils.data import Dataset

from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.augment import build_transforms
from sdnet_trainer.data.folders import (
    ON_BAD_SAMPLE,
    BadSampleError,
    SkippedSamples,
    _reason,
    _require_rgb,
    first_loadable,
)
from sdnet_trainer.data.tokens import _TEXT_VAL_FRACTION, BYTE_VOCAB, TextBytes, TokenWindows
from sdnet_trainer.errors import ConfigError

if TYPE_CHECKING:
    import datasets as hf_datasets
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'sdnet_trainer[hf]'"

TRAIN_SPLIT = "train"
# The split that validates, in order of preference; "test" last, as Hub test splits often have
# no labels (ClassLabel -1), which the label check reports.
VAL_SPLITS = ("validation", "val", "valid", "dev", "test")
# Without a validation split, images hold out every HOLDOUT_EVERY-th row of train.
HOLDOUT_EVERY = 10

_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow"}
# Rows read from the table per batch while tokenizing.
_TEXT_BATCH_ROWS = 4096


def _require_datasets() -> Any:
    """The ``datasets`` module, or one clear error naming the extra that installs it."""
    try:
        import datasets
    except ImportError as err:
        raise ConfigError(
            f"data.name=hf needs the Hugging Face `datasets` package, which is not installed: "
            f"{INSTALL_HINT}"
        ) from err
    return datasets


@contextlib.contextmanager
def _quiet_progress(datasets: Any) -> Iterator[None]:
    """No per-split progress bars from ``datasets`` while loading: every rank would print them
    into the training log. The caller's setting is restored afterwards."""
    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


# --------------------------------------------------------------------------------------------
# Reading data.root
# --------------------------------------------------------------------------------------------


def _root(cfg: DataConfig) -> Path:
    if cfg.root is None:
        raise ConfigError(
            "data.root is required for data.name='hf'; it is null (set it to a dataset saved "
            "with save_to_disk, or a folder of .parquet/.arrow files)"
        )
    root = Path(cfg.root).expanduser()
    if not root.exists():
        raise ConfigError(f"data.root={cfg.root!r} does not exist")
    return root


def _data_files(root: Path) -> list[Path]:
    """The .parquet/.arrow files under ``root`` (or ``root`` itself), leaving out the hidden and
    ``__``-prefixed paths that ``load_dataset`` leaves out."""
    if root.is_file():
        return [root] if root.suffix in _FILE_BUILDERS else []
    return sorted(
        path
        for path in root.rglob("*")
        if path.suffix in _FILE_BUILDERS
        and path.is_file()
        and not any(part.startswith((".", "__")) for part in path.relative_to(root).parts)
    )


def load_splits(cfg: DataConfig) -> dict[str, hf_datasets.Dataset]:
    """The splits of ``data.root`` by name (a single ``Dataset`` is the ``train`` split)."""
    datasets = _require_datasets()
    root = _root(cfg)
    saved = root.is_dir() and any(
        (root / marker).is_file() for marker in ("dataset_dict.json", "state.json")
    )
    with _quiet_progress(datasets):
        if saved:
            loaded = _guarded(cfg, lambda: datasets.load_from_disk(str(root)))
        else:
            files = _data_files(root)
            suffixes = sorted({path.suffix for path in files})
            if not files:
                raise ConfigError(
                    f"data.root={cfg.root!r} holds neither a dataset saved with save_to_disk "
                    f"(dataset_dict.json or state.json) nor .parquet/.arrow files"
                )
            if len(suffixes) > 1:
                raise ConfigError(
                    f"data.root={cfg.root!r} mixes .parquet and .arrow files; keep one format "
                    f"(e.g. {files[0]} and {next(p for p in files if p.suffix != files[0].suffix)})"
                )
            builder = _FILE_BUILDERS[suffixes[0]]
            if root.is_file():
                loaded = _guarded(
                    cfg, lambda: datasets.load_dataset(builder, data_files={"train": str(root)})
                )
            else:
                loaded = _guarded(cfg, lambda: datasets.load_dataset(builder, data_dir=str(root)))
    if isinstance(loaded, datasets.Dataset):
        return {TRAIN_SPLIT: loaded}
    return dict(loaded)


def _guarded(cfg: DataConfig, load: Any) -> Any:
    """``load()``, with whatever a malformed folder makes ``datasets`` or pyarrow raise turned
    into one error that names ``data.root``."""
    try:
        return load()
    except ConfigError:
        raise
    except Exception as err:  # datasets/pyarrow raise many types (ArrowInvalid, FileNotFound, ...)
        raise ConfigError(
            f"data.root={cfg.root!r} cannot be read as a Hugging Face dataset: "
            f"{type(err).__name__}: {err}"
        ) from err


def pick_splits(
    cfg: DataConfig, splits: dict[str, hf_datasets.Dataset]
) -> tuple[hf_datasets.Dataset, hf_datasets.Dataset | None, str | None]:
    """(train, val or None, val's split name)."""
    if TRAIN_SPLIT not in splits:
        raise ConfigError(
            f"data.root={cfg.root!r} has no {TRAIN_SPLIT!r} split; its splits are {sorted(splits)}"
        )
    val_name = next((name for name in VAL_SPLITS if name in splits), None)
    return splits[TRAIN_SPLIT], None if val_name is None else splits[val_name], val_name


def _require_column(cfg: DataConfig, ds: hf_datasets.Dataset, key: str, split: str) -> str:
    column = getattr(cfg, key)
    if column not in ds.column_names:
        raise ConfigError(
            f"data.{key}={column!r} is not a column of the {split!r} split of "
            f"data.root={cfg.root!r}; its columns are {ds.column_names}"
        )
    return column


# --------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------


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
        datasets = _require_datasets()
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
            reason = _reason(err, "")
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
    datasets = _require_datasets()
    column = _require_column(cfg, ds, "image_column", split)
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

    datasets = _require_datasets()
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
    _require_rgb(cfg)
    if cfg.decode != "cpu":
        raise ConfigError(
            f"data.decode={cfg.decode!r}: data.name='hf' decodes its images on the CPU; set "
            f"data.decode=cpu"
        )
    for split, ds in ((TRAIN_SPLIT, train), (val_name, val)):
        if ds is not None:
            _check_image_column(cfg, ds, split)
            _require_column(cfg, ds, "label_column", split)
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


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------


def load_tokenizer(name: str) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` named by ``data.tokenizer``: a ``tokenizer.json`` file, a
    folder holding one (a model folder saved by ``transformers``), or a Hub name (downloaded)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise ConfigError(
            f"data.tokenizer={name!r} needs the Hugging Face `tokenizers` package, which is not "
            f"installed: {INSTALL_HINT}"
        ) from err
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(
                f"data.tokenizer={name!r} is a folder without tokenizer.json (a fast tokenizer's "
                f"file, which transformers' save_pretrained writes)"
            )
    try:
        if path.is_file():
            return Tokenizer.from_file(str(path))
        return Tokenizer.from_pretrained(name)
    except Exception as err:  # tokenizers raises its own Exception type, hub errors, ...
        raise ConfigError(
            f"data.tokenizer={name!r} is neither a readable tokenizer.json file or folder nor a "
            f"Hugging Face Hub tokenizer that can be fetched: {type(err).__name__}: {err}"
        ) from err


def _texts(ds: hf_datasets.Dataset, column: str) -> Iterator[list[str]]:
    """The column's strings in row order, in batches; null rows are left out."""
    for batch in ds.select_columns([column]).iter(batch_size=_TEXT_BATCH_ROWS):
        yield [text for text in batch[column] if text is not None]


def token_stream(ds: hf_datasets.Dataset, column: str, tokenizer: Tokenizer | None) -> torch.Tensor:
    """All rows of ``column`` as one token stream: UTF-8 bytes joined by newlines (uint8), or the
    tokenizer's ids of each row, concatenated (int32)."""
    if tokenizer is None:
        texts = (text.encode("utf-8") for batch in _texts(ds, column) for text in batch)
        raw = bytearray(b"\n".join(texts))
        if not raw:
            return torch.empty(0, dtype=torch.uint8)
        # A bytearray is writable, so torch.frombuffer shares it without a warning or a copy.
        return torch.frombuffer(raw, dtype=torch.uint8)
    parts = [
        np.asarray(encoding.ids, dtype=np.int32)
        for batch in _texts(ds, column)
        for encoding in tokenizer.encode_batch(batch)
    ]
    ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
    return torch.from_numpy(ids)


def _check_text_column(cfg: DataConfig, ds: hf_datasets.Dataset, split: str) -> str:
    datasets = _require_datasets()
    column = _require_column(cfg, ds, "text_column", split)
    feature = ds.features[column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise ConfigError(
            f"data.text_column={column!r} of the {split!r} split of data.root={cfg.root!r} holds "
            f"{feature}, not text (a string column)"
        )
    return column


def _windows(data: torch.Tensor, seq_len: int) -> TextBytes | TokenWindows:
    if data.dtype == torch.uint8:
        return TextBytes(data, seq_len=seq_len)
    return TokenWindows(data, seq_len=seq_len)


def build_hf_text(
    cfg: DataConfig, train: hf_datasets.Dataset, val: hf_datasets.Dataset | None, val_name: str
) -> tuple[Dataset, Dataset]:
    if cfg.seq_len < 1:
        raise ConfigError(f"data.seq_len={cfg.seq_len} must be >= 1 for data.name='hf'")
    column = _check_text_column(cfg, train, TRAIN_SPLIT)
    if val is not None:
        _check_text_column(cfg, val, val_name)
    tokenizer = None
    if cfg.tokenizer is None:
        if cfg.vocab_size != BYTE_VOCAB:
            raise ConfigError(
                f"data.vocab_size={cfg.vocab_size}: data.name='hf' without data.tokenizer reads "
                f"UTF-8 bytes, so it must be {BYTE_VOCAB} (set model.gpt.vocab_size={BYTE_VOCAB}), "
                f"or name a tokenizer with data.tokenizer"
            )
        what = "bytes"
    else:
        tokenizer = load_tokenizer(cfg.tokenizer)
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        if cfg.vocab_size < vocab:
            raise ConfigError(
                f"data.vocab_size={cfg.vocab_size} is smaller than the {vocab} tokens of "
                f"data.tokenizer={cfg.tokenizer!r}; set model.gpt.vocab_size to at least {vocab}"
            )
        what = f"tokens of {cfg.tokenizer}"
    window = cfg.seq_len + 1
    train_ids = token_stream(train, column, tokenizer)
    if val is None:
        # At least one window each for val and train, as data.name=text.
        val_len = max(int(len(train_ids) * _TEXT_VAL_FRACTION), window)
        split = len(train_ids) - val_len
        train_ids, val_ids = train_ids[:split], train_ids[split:]
        val_name = f"the last {val_len} {what} of train"
    else:
        val_ids = token_stream(val, column, tokenizer)
    for name, ids in ((TRAIN_SPLIT, train_ids), (val_name, val_ids)):
        if len(ids) < window:
            raise ConfigError(
                f"data.root={cfg.root!r}: {name} holds {max(len(ids), 0)} {what} of "
                f"data.text_column={column!r}; data.seq_len={cfg.seq_len} needs at least {window} "
                f"(one window of seq_len + 1)"
            )
    train_set, val_set = _windows(train_ids, cfg.seq_len), _windows(val_ids, cfg.seq_len)
    logger.info(
        "hf text %s: %d train / %d val windows of %d %s (val: %s)",
        cfg.root,
        len(train_set),
        len(val_set),
        cfg.seq_len,
        what,
        val_name,
    )
    return train_set, val_set


# --------------------------------------------------------------------------------------------
# data.name=hf
# --------------------------------------------------------------------------------------------


def build_hf(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    """The (train, val) pair of ``data.root``: labelled images, or text windows when
    ``data.text_column`` is set (see the module docstring)."""
    splits = load_splits(cfg)
    train, val, val_name = pick_splits(cfg, splits)
    name = val_name or ""
    if cfg.text_column is not None:
        return build_hf_text(cfg, train, val, name)
    return build_hf_images(cfg, train, val, name)
