"""Datasets, samplers and the DataLoader policy.

:func:`build_datasets` picks the (train, val) pair named by ``data.name``; the samplers of
:mod:`~sdnet_trainer.data.sampler` split them across ranks; :func:`build_loader` wraps them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import Dataset

from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.config.schema import Config, DataConfig
from sdnet_trainer.data.augment import BatchMixer, changed_augment_keys, validate_augment
from sdnet_trainer.data.bad_samples import ON_BAD_SAMPLE, BadSampleError, SkippedSamples
from sdnet_trainer.data.chat import TEMPLATES as CHAT_TEMPLATES
from sdnet_trainer.data.loader import build_loader, check_loader_options
from sdnet_trainer.data.sampler import GlobalBatchSampler, ShardedEvalSampler
from sdnet_trainer.data.synthetic import SyntheticImages
from sdnet_trainer.data.token_cache import IGNORE_INDEX, PackedTokens
from sdnet_trainer.data.tokens import MarkovTokens, TextBytes, TokenWindows
from sdnet_trainer.data.windows import random_windows
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.lazy import loaded_types, resolve

logger = logging.getLogger(__name__)

# The language-model data sets: (inputs, targets) token sequences rather than labelled images.
LM_DATASETS = ("tokens", "text", "chat")

# Each builder returns (train, val); val is None where the data has no validation split. They are
# named as "module:function" and imported when used: the image data sets' modules import
# torchvision, which a run of other data never needs (see sdnet_trainer/lazy.py).
_BUILDERS: dict[str, str] = {
    "synthetic": "sdnet_trainer.data.synthetic:build_synthetic",
    "imagefolder": "sdnet_trainer.data.folders:build_imagefolder",
    "cifar10": "sdnet_trainer.data.cifar:build_cifar10",
    # Language models: (inputs, targets) token sequences.
    "tokens": "sdnet_trainer.data.tokens:build_tokens",
    "text": "sdnet_trainer.data.text:build_text",
    "chat": "sdnet_trainer.data.chat:build_chat",
    # Labelled images, or text for a language model when data.text_column is set.
    "hf": "sdnet_trainer.data.hf:build_hf",
    # Tar shards (WebDataset layout) of images or of text, local or at an fsspec URL.
    "shards": "sdnet_trainer.data.shards:build_shards",
}
# The image data sets' classes, exported here and imported on first access for the same reason.
_LAZY_EXPORTS = {
    "CheckedImageFolder": "sdnet_trainer.data.folders:CheckedImageFolder",
    "HFImages": "sdnet_trainer.data.hf:HFImages",
    "ShardImages": "sdnet_trainer.data.shards:ShardImages",
    "ShardText": "sdnet_trainer.data.shards:ShardText",
}


def __getattr__(name: str) -> Any:
    target = _LAZY_EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return resolve(target)


def is_language_model_data(cfg: DataConfig, dataset: Dataset | None = None) -> bool:
    """(inputs, targets) token sequences rather than labelled images. The config says so for
    most data sets; shards say so by their contents (``.txt`` members), so pass the built
    ``dataset`` where there is one."""
    if cfg.name in LM_DATASETS or (cfg.name == "hf" and cfg.text_column is not None):
        return True
    # Shard text exists only where its module is imported; other runs need not import it.
    shard_text = loaded_types("sdnet_trainer.data.shards.text", "ShardText")
    return any(isinstance(current, shard_text) for current in _unwrapped(dataset))


def build_datasets(cfg: DataConfig) -> tuple[Dataset, Dataset | None]:
    """The (train, val) datasets named by ``cfg.name``."""
    target = _BUILDERS.get(cfg.name)
    if target is None:
        raise ConfigError(
            f"data.name={cfg.name!r} is not a known dataset; choose one of {sorted(_BUILDERS)}"
        )
    builder: Callable[[DataConfig], tuple[Dataset, Dataset | None]] = resolve(target)
    return builder(cfg)


# Data sets whose samples are generated tensors, not image files: data.augment does not apply.
_GENERATED_IMAGES = ("synthetic",)


def validate_data(cfg: Config) -> None:
    """``data.*`` and its fit to ``model.num_classes``, checked before launch. A language model's
    vocabulary and context are checked against the data by the model's own validator."""
    data = cfg.data
    validate_augment(data)
    if is_language_model_data(data):
        check_positive("data.seq_len", data.seq_len)
        _refuse_image_options(data)
    else:
        check_positive("data.num_classes", data.num_classes, allow_none=True)
        check_positive("model.num_classes", cfg.model.num_classes, allow_none=True)
        both = cfg.model.num_classes is not None and data.num_classes is not None
        if both and cfg.model.num_classes != data.num_classes:
            raise ConfigError(
                f"model.num_classes={cfg.model.num_classes} differs from "
                f"data.num_classes={data.num_classes}"
            )
    check_positive("data.image_size", data.image_size)
    if random_windows(data) and not is_language_model_data(data):  # checks its choices too
        raise ConfigError(
            f"data.windows=random draws windows from a token stream; data.name={data.name!r} "
            f"holds images: set data.windows=stride (its default)"
        )
    check_choice("data.on_bad_sample", data.on_bad_sample, ON_BAD_SAMPLE)
    if data.chat_template is not None:
        check_choice("data.chat_template", data.chat_template, sorted(CHAT_TEMPLATES))
    check_loader_options(data)
    if data.name in _GENERATED_IMAGES and changed_augment_keys(data.augment):
        logger.warning(
            "%s: data.name=%r generates its images as tensors; data.augment applies to image "
            "files (imagefolder, cifar10, shards, hf) and is ignored here",
            ", ".join(changed_augment_keys(data.augment)),
            data.name,
        )


def _refuse_image_options(data: DataConfig) -> None:
    """Language-model data has token sequences, not images to transform or mix."""
    keys = changed_augment_keys(data.augment)
    keys += [f"data.{key}" for key in ("mixup_alpha", "cutmix_alpha") if getattr(data, key) > 0]
    if keys:
        raise ConfigError(
            f"{', '.join(keys)}: image augmentation and mixing, but data.name={data.name!r} "
            f"is language-model data (token sequences); drop those keys"
        )


def _unwrapped(dataset: Dataset | None) -> Iterator[object]:
    """``dataset`` and the data sets it wraps (``.dataset``: the training loader's per-sample
    seeding, ``torch.utils.data.Subset``, a subclass's own wrappers), outermost first."""
    current: object = dataset
    for _ in range(16):  # wrappers nest a few levels; a cycle must not loop forever
        if current is None:
            return
        yield current
        current = getattr(current, "dataset", None)


def data_num_classes(dataset: Dataset | None) -> int | None:
    """How many classes ``dataset`` says it has: its ``num_classes`` (synthetic images, shards,
    Hugging Face ``ClassLabel``) or the length of its ``classes`` (ImageFolder class folders,
    CIFAR-10); None when it says nothing."""
    for current in _unwrapped(dataset):
        count = getattr(current, "num_classes", None)
        if isinstance(count, int):
            return count
        classes = getattr(current, "classes", None)
        if isinstance(classes, (list, tuple)):
            return len(classes)
    return None


def resolve_num_classes(cfg: Config, train_set: Dataset) -> None:
    """``data.num_classes`` and ``model.num_classes`` from the data: null keys take the count the
    training set states; set keys must agree with it. Changes ``cfg`` in place (so checkpoints and
    exports record the count) and logs where it came from."""
    if is_language_model_data(cfg.data, train_set):
        return
    found = data_num_classes(train_set)
    keys = {"data.num_classes": cfg.data.num_classes, "model.num_classes": cfg.model.num_classes}
    for key, value in keys.items():
        if value is not None and found is not None and value != found:
            raise ConfigError(
                f"{key}={value}, but the training data ({type(train_set).__name__}, data.name="
                f"{cfg.data.name!r}) has {found} classes; drop the key to take the data's count"
            )
    count = found or cfg.data.num_classes or cfg.model.num_classes
    if count is None:
        raise ConfigError(
            f"model.num_classes is null and the training data ({type(train_set).__name__}) does "
            f"not say how many classes it has (no num_classes or classes attribute): set "
            f"model.num_classes"
        )
    source = "from the data" if found is not None else "from the config"
    cfg.data.num_classes = cfg.model.num_classes = count
    logger.info("num_classes=%d (%s)", count, source)


def host_decoded(dataset: Dataset) -> Dataset:
    """``dataset`` with its images decoded on the host: for an image folder decoded on the GPU
    (``data.decode=cuda``), the same files through the CPU path (what the FLOPs count reads);
    any other data set as it is."""
    # Matched without importing data/folders.py, which imports torchvision (sdnet_trainer/lazy.py).
    if isinstance(dataset, loaded_types("sdnet_trainer.data.folders", "EncodedJpegFolder")):
        return dataset.decoded()
    return dataset


def skipped_samples(dataset: Dataset | None) -> Callable[[], int] | None:
    """How many samples of ``dataset`` were replaced so far under ``data.on_bad_sample=skip``
    (workers' loads included), as a callable for
    :class:`~sdnet_trainer.training.hooks.MetricsHook`; None when the data set keeps no such count
    (another policy or data set).

    ``dataset`` may be a wrapper: ``.dataset`` is followed (the training loader's per-sample
    seeding, ``torch.utils.data.Subset``, a subclass's own wrappers), so
    ``skipped_samples(trainer.data.train_loader.dataset)`` finds the count.
    """
    for current in _unwrapped(dataset):
        counter = getattr(current, "skipped", None)
        if isinstance(counter, SkippedSamples):
            return counter
    return None


__all__ = [
    "BatchMixer",
    "LM_DATASETS",
    "ON_BAD_SAMPLE",
    "BadSampleError",
    "CheckedImageFolder",
    "HFImages",
    "IGNORE_INDEX",
    "PackedTokens",
    "ShardImages",
    "ShardText",
    "GlobalBatchSampler",
    "MarkovTokens",
    "ShardedEvalSampler",
    "SkippedSamples",
    "SyntheticImages",
    "TextBytes",
    "TokenWindows",
    "build_datasets",
    "build_loader",
    "data_num_classes",
    "host_decoded",
    "is_language_model_data",
    "resolve_num_classes",
    "skipped_samples",
    "validate_data",
]
