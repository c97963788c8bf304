"""``data.name=shards``: the train and validation data sets from the shard sets at
``data.root``, their indexes loaded and checked against the config before any sample is read."""

from __future__ import annotations

import logging
from typing import Any

from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.bad_samples import ON_BAD_SAMPLE
from sdnet_trainer.data.shards.images import ShardImages
from sdnet_trainer.data.shards.index import (
    INDEX_SUFFIX,
    TEXT_EXT,
    ShardError,
    ShardIndex,
    load_index,
)
from sdnet_trainer.data.shards.listing import (
    CLASSES_FILE,
    SPLITS,
    _drop_remote_filesystems,
    _is_pattern,
    _list_split,
    _read_classes,
    expand_braces,
)
from sdnet_trainer.data.shards.reading import _ShardSet
from sdnet_trainer.data.shards.text import ShardText
from sdnet_trainer.data.tokens import BYTE_VOCAB
from sdnet_trainer.data.transforms import build_transforms
from sdnet_trainer.data.windows import random_windows, refuse_random_windows
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)


def _load_split(urls: list[str], cfg: DataConfig) -> tuple[list[ShardIndex], list[int]]:
    """The indexes of ``urls`` and the shards' sizes now; a shard shorter than its index is an
    error, or under skip a warning (its members past the end are then skipped when read)."""
    indexes, sizes = [], []
    for url in urls:
        index, actual = load_index(url)
        if actual != index.tar_bytes:
            if actual < index.tar_bytes and cfg.on_bad_sample == "skip":
                logger.warning(
                    "data: shard %s has %d bytes, its index %d: the members past the end are "
                    "skipped (data.on_bad_sample=skip)",
                    url,
                    actual,
                    index.tar_bytes,
                )
            else:
                past = [
                    k for k, o, n in zip(index.keys, index.offsets, index.sizes) if o + n > actual
                ]
                which = f"; key {past[0]!r} is past its end" if past else ""
                raise ShardError(
                    f"data: shard {url} has {actual} bytes, but its index says {index.tar_bytes} "
                    f"(truncated or replaced since it was indexed{which}); re-create the shard "
                    f"and its {INDEX_SUFFIX}"
                )
        indexes.append(index)
        sizes.append(actual)
    return indexes, sizes


def _is_text(indexes: list[ShardIndex], *, root: str, split: str) -> bool:
    """Whether the shard set holds text (else images); a mix is an error."""
    kinds = {ext == TEXT_EXT for index in indexes for ext in index.exts}
    if len(kinds) > 1:
        raise ConfigError(
            f"data.root={root!r}: the {split} shards mix images and text members; a shard set "
            f"holds one or the other"
        )
    return kinds == {True}


def _images(
    indexes: list[ShardIndex],
    sizes: list[int],
    cfg: DataConfig,
    *,
    transform: Any,
    classes: list[str] | None,
) -> ShardImages:
    # The class count known before reading the labels: classes.json, else the config.
    bound, source = (
        (len(classes), f"the {len(classes)} classes of {CLASSES_FILE}")
        if classes is not None
        else (cfg.num_classes, f"data.num_classes={cfg.num_classes}")
    )
    if bound is not None:
        for index in indexes:
            for key, label in zip(index.keys, index.labels):
                if label >= bound:
                    raise ShardError(
                        f"data: shard {index.url}, key {key!r}: label {label} is out of range "
                        f"for {source}"
                    )
    dataset = ShardImages(
        indexes,
        transform=transform,
        on_bad_sample=cfg.on_bad_sample,
        classes=classes,
        shard_bytes=sizes,
    )
    if classes is None and cfg.num_classes is not None:
        dataset.num_classes = cfg.num_classes  # the labels fit it (checked above)
    return dataset


def _text(
    indexes: list[ShardIndex], sizes: list[int], cfg: DataConfig, *, random: bool
) -> ShardText:
    if cfg.vocab_size != BYTE_VOCAB:
        raise ConfigError(
            f"data.vocab_size={cfg.vocab_size}: text shards are read as bytes, so it must be "
            f"{BYTE_VOCAB} (set model.gpt.vocab_size={BYTE_VOCAB})"
        )
    return ShardText(
        indexes,
        seq_len=cfg.seq_len,
        on_bad_sample=cfg.on_bad_sample,
        shard_bytes=sizes,
        random=random,
    )


def build_shards(cfg: DataConfig) -> tuple[_ShardSet, _ShardSet | None]:
    """(train, val) from tar shards at ``data.root``: a folder (or URL) with ``train/`` and
    ``val/`` shard sets, or a brace pattern naming the training shards only (no validation set).

    Image shards give :class:`ShardImages` with the transforms of ``data=imagefolder``; text
    shards (``.txt`` members) give :class:`ShardText`, byte-level windows as ``data=text``."""
    if cfg.root is None:
        raise ConfigError("data.root is required for data.name='shards'; it is null")
    check_choice("data.on_bad_sample", cfg.on_bad_sample, ON_BAD_SAMPLE)
    random = random_windows(cfg)
    root = str(cfg.root)
    pattern = _is_pattern(root)
    splits = (
        {"train": expand_braces(root)} if pattern else {s: _list_split(root, s) for s in SPLITS}
    )
    loaded = {split: _load_split(urls, cfg) for split, urls in splits.items()}
    text = {
        split: _is_text(indexes, root=root, split=split) for split, (indexes, _) in loaded.items()
    }
    if len(set(text.values())) > 1:
        raise ConfigError(
            f"data.root={root!r}: one of train/ and val/ holds text, the other images"
        )
    if text["train"]:
        # Training windows as data.windows says; validation's at stride (data/windows.py).
        built: dict[str, _ShardSet] = {
            s: _text(*loaded[s], cfg, random=random and s == "train") for s in loaded
        }
    else:
        refuse_random_windows(cfg, "image shards")
        if cfg.channels != 3:
            raise ConfigError(
                f"data.channels={cfg.channels}, but image shards yield RGB images (3 channels)"
            )
        classes = None if pattern else _read_classes(root)
        if classes is not None and cfg.num_classes is not None and len(classes) != cfg.num_classes:
            raise ConfigError(
                f"data.num_classes={cfg.num_classes}, but data.root={root!r} has {len(classes)} "
                f"classes ({CLASSES_FILE}); set data.num_classes (and model.num_classes) to "
                f"{len(classes)}"
            )
        transforms = dict(zip(SPLITS, build_transforms(cfg)))
        built = {
            s: _images(*loaded[s], cfg, transform=transforms[s], classes=classes) for s in loaded
        }
    train, val = built["train"], built.get("val")
    _drop_remote_filesystems(root)
    logger.info(
        "shards %s: %s %d train / %s val samples in %d / %s shards",
        root,
        "text" if text["train"] else "images",
        len(train),
        "no" if val is None else len(val),
        len(train.urls),
        "no" if val is None else len(val.urls),
    )
    return train, val
