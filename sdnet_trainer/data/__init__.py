"""Datasets, samplers and the DataLoader policy.

:func:`build_datasets` picks the (train, val) pair named by ``data.name``; the samplers of
:mod:`~sdnet_trainer.data.sampler` split them across ranks; :func:`build_loader` wraps them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch.utils.data import Dataset

from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.config.schema import Config, DataConfig
from sdnet_trainer.data.folders import (
    ON_BAD_SAMPLE,
    BadSampleError,
    CheckedImageFolder,
    SkippedSamples,
    build_cifar10,
    build_imagefolder,
)
from sdnet_trainer.data.loader import build_loader, check_loader_options
from sdnet_trainer.data.sampler import GlobalBatchSampler, ShardedEvalSampler
from sdnet_trainer.data.synthetic import SyntheticImages, build_synthetic
from sdnet_trainer.data.tokens import MarkovTokens, TextBytes, build_text, build_tokens
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

# The language-model data sets: (inputs, targets) token sequences rather than labelled images.
LM_DATASETS = ("tokens", "text")

_BUILDERS: dict[str, Callable[[DataConfig], tuple[Dataset, Dataset]]] = {
    "synthetic": build_synthetic,
    "imagefolder": build_imagefolder,
    "cifar10": build_cifar10,
    # Language models: (inputs, targets) token sequences.
    "tokens": build_tokens,
    "text": build_text,
}


def build_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    """The (train, val) datasets named by ``cfg.name``."""
    builder = _BUILDERS.get(cfg.name)
    if builder is None:
        raise ConfigError(
            f"data.name={cfg.name!r} is not a known dataset; choose one of {sorted(_BUILDERS)}"
        )
    return builder(cfg)


def validate_data(cfg: Config) -> None:
    """``data.*`` and its fit to ``model.num_classes``, checked before launch. A language model's
    vocabulary and context are checked against the data by the model's own validator."""
    data = cfg.data
    if data.name in LM_DATASETS:
        check_positive("data.seq_len", data.seq_len)
    elif cfg.model.num_classes != data.num_classes:
        raise ConfigError(
            f"model.num_classes={cfg.model.num_classes} differs from "
            f"data.num_classes={data.num_classes}"
        )
    check_positive("data.image_size", data.image_size)
    check_choice("data.on_bad_sample", data.on_bad_sample, ON_BAD_SAMPLE)
    check_loader_options(data)


def skipped_samples(dataset: Dataset | None) -> Callable[[], int] | None:
    """How many samples of ``dataset`` were replaced so far under ``data.on_bad_sample=skip``
    (workers' loads included), as a callable for :class:`~sdnet_trainer.hooks.MetricsHook`; None
    when the data set keeps no such count (another policy or data set).

    ``dataset`` may be a wrapper: ``.dataset`` is followed (the training loader's per-sample
    seeding, ``torch.utils.data.Subset``, a subclass's own wrappers), so
    ``skipped_samples(trainer.data.train_loader.dataset)`` finds the count.
    """
    current: object = dataset
    for _ in range(16):  # wrappers nest a few levels; a cycle must not loop forever
        if current is None:
            return None
        counter = getattr(current, "skipped", None)
        if isinstance(counter, SkippedSamples):
            return counter
        current = getattr(current, "dataset", None)
    return None


__all__ = [
    "LM_DATASETS",
    "ON_BAD_SAMPLE",
    "BadSampleError",
    "CheckedImageFolder",
    "GlobalBatchSampler",
    "MarkovTokens",
    "ShardedEvalSampler",
    "SkippedSamples",
    "SyntheticImages",
    "TextBytes",
    "build_datasets",
    "build_loader",
    "skipped_samples",
    "validate_data",
]
