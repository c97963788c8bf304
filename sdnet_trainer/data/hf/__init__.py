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
:class:`~sdnet_trainer.data.tokens.TextBytes`: ``(inputs, targets)``, targets shifted by one. With
``data.tokenizer`` null the tokens are the UTF-8 bytes (``data.vocab_size=256``) and rows are
joined by a newline; otherwise they are the ids of the tokenizer that ``data.tokenizer`` names (a
``tokenizer.json`` file, a folder holding one, a tiktoken BPE file, or a Hub name; read by
:mod:`sdnet_trainer.data.tokenizer`), each row encoded with the tokenizer's own special tokens (its
BOS/EOS, if it adds them, mark where documents meet), and ``data.vocab_size`` must hold all its
ids. The text is tokenized once when the data set is built, on every rank, and held in memory.

Both kinds are map-style with a length, so the global-index sampler's guarantees (exact resume,
world-size changes) hold unchanged, and both pickle for loader workers (a memory-mapped table
pickles as its file path).

``datasets`` (and ``tokenizers`` for ``data.tokenizer``) are optional: ``pip install
'sdnet_trainer[hf]'``.
"""

from __future__ import annotations

from torch.utils.data import Dataset

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.hf.images import (
    HOLDOUT_EVERY,
    HFImages,
    build_hf_images,
    count_classes,
    read_classes,
)
from sdnet_trainer.data.hf.load import (
    INSTALL_HINT,
    TRAIN_SPLIT,
    VAL_SPLITS,
    load_splits,
    pick_splits,
)
from sdnet_trainer.data.hf.text import build_hf_text, token_stream


def build_hf(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    """The (train, val) pair of ``data.root``: labelled images, or text windows when
    ``data.text_column`` is set (see the module docstring)."""
    splits = load_splits(cfg)
    train, val, val_name = pick_splits(cfg, splits)
    name = val_name or ""
    if cfg.text_column is not None:
        return build_hf_text(cfg, train, val, name)
    return build_hf_images(cfg, train, val, name)


__all__ = [
    "HOLDOUT_EVERY",
    "INSTALL_HINT",
    "TRAIN_SPLIT",
    "VAL_SPLITS",
    "HFImages",
    "build_hf",
    "build_hf_images",
    "build_hf_text",
    "count_classes",
    "load_splits",
    "pick_splits",
    "read_classes",
    "token_stream",
]
