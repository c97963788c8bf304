"""Datasets, samplers and the DataLoader policy.

:func:`build_datasets` picks the (train, val) pair named by ``data.name``; the samplers of
:mod:`~sdnet_trainer.data.sampler` split them across ranks; :func:`build_loader` wraps them.
"""

from __future__ import annotations

import logging
from typing import Callable

from torch.utils.data import Dataset

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.folders import build_cifar10, build_imagefolder
from sdnet_trainer.data.loader import build_loader
from sdnet_trainer.data.sampler import GlobalBatchSampler, ShardedEvalSampler
from sdnet_trainer.data.synthetic import SyntheticImages, build_synthetic
from sdnet_trainer.data.tokens import MarkovTokens, TextBytes, build_text, build_tokens
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

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


__all__ = [
    "GlobalBatchSampler",
    "MarkovTokens",
    "ShardedEvalSampler",
    "SyntheticImages",
    "TextBytes",
    "build_datasets",
    "build_loader",
]
