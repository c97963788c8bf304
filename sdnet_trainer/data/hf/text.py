"""Text for a language model from a Hugging Face dataset (``data.name=hf``, ``data.text_column``
set): UTF-8 bytes, or the ids of the tokenizer ``data.tokenizer`` names (read by
:mod:`sdnet_trainer.data.tokenizer`, as ``data=text`` and serving read it); see
:mod:`sdnet_trainer.data.hf`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.hf.load import TRAIN_SPLIT, require_column, require_datasets
from sdnet_trainer.data.tokenizer import TextTokenizer, load_tokenizer
from sdnet_trainer.data.tokens import _TEXT_VAL_FRACTION, BYTE_VOCAB, TextBytes, TokenWindows
from sdnet_trainer.data.windows import random_windows
from sdnet_trainer.errors import ConfigError

if TYPE_CHECKING:
    import datasets as hf_datasets

logger = logging.getLogger(__name__)

# Rows read from the table per batch while tokenizing.
_TEXT_BATCH_ROWS = 4096


def _texts(ds: hf_datasets.Dataset, column: str) -> Iterator[list[str]]:
    """The column's strings in row order, in batches; null rows are left out."""
    for batch in ds.select_columns([column]).iter(batch_size=_TEXT_BATCH_ROWS):
        yield [text for text in batch[column] if text is not None]


def token_stream(
    ds: hf_datasets.Dataset, column: str, tokenizer: TextTokenizer | None
) -> torch.Tensor:
    """All rows of ``column`` as one token stream: UTF-8 bytes joined by newlines (uint8), or the
    tokenizer's ids of each row with the special tokens its post-processor adds, concatenated
    (int32)."""
    if tokenizer is None:
        texts = (text.encode("utf-8") for batch in _texts(ds, column) for text in batch)
        raw = bytearray(b"\n".join(texts))
        if not raw:
            return torch.empty(0, dtype=torch.uint8)
        # A bytearray is writable, so torch.frombuffer shares it without a warning or a copy.
        return torch.frombuffer(raw, dtype=torch.uint8)
    parts = [
        np.asarray(ids, dtype=np.int32)
        for batch in _texts(ds, column)
        for ids in tokenizer.encode(batch, add_special_tokens=True)
    ]
    ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
    return torch.from_numpy(ids)


def _check_text_column(cfg: DataConfig, ds: hf_datasets.Dataset, split: str) -> str:
    datasets = require_datasets()
    column = require_column(cfg, ds, "text_column", split)
    feature = ds.features[column]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise ConfigError(
            f"data.text_column={column!r} of the {split!r} split of data.root={cfg.root!r} holds "
            f"{feature}, not text (a string column)"
        )
    return column


def _windows(data: torch.Tensor, seq_len: int, *, random: bool) -> TextBytes | TokenWindows:
    if data.dtype == torch.uint8:
        return TextBytes(data, seq_len=seq_len, random=random)
    return TokenWindows(data, seq_len=seq_len, random=random)


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
        vocab = tokenizer.vocab_size
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
    # data.windows=random for training alone: validation compares the same windows every time.
    train_set = _windows(train_ids, cfg.seq_len, random=random_windows(cfg))
    val_set = _windows(val_ids, cfg.seq_len, random=False)
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
