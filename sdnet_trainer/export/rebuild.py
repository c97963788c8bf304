"""Rebuilding a checkpoint's model as data: its training config read without interpolation, the
Trainer class that rebuilds it (never one the checkpoint names, unless ``trainer=`` does), its
weights loaded through DCP from any layout, and an example batch for tracing it."""

from __future__ import annotations

import logging
import re
from typing import Any, cast

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from sdnet_trainer.checkpoint import Checkpoint, CheckpointError, CheckpointManager
from sdnet_trainer.config import Config
from sdnet_trainer.data import is_language_model_data
from sdnet_trainer.data.augment import crop_sizes
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.base_fingerprint import adapters_meta, check_adapters_base
from sdnet_trainer.models.lora_names import base_name
from sdnet_trainer.models.registry import hf_weights_reader
from sdnet_trainer.training.classes import resolve_trainer_class
from sdnet_trainer.training.trainer import Trainer

logger = logging.getLogger(__name__)

# The Trainer export rebuilds with unless trainer= names another, under the names it is recorded by.
DEFAULT_TRAINER = "sdnet_trainer.Trainer"
_DEFAULT_TRAINER_NAMES = frozenset(
    {DEFAULT_TRAINER, f"{Trainer.__module__}.{Trainer.__qualname__}"}
)

# Two, not one: torch.export specialises a dimension whose example size is 1, so an example batch
# of 1 could not be exported with a dynamic batch dimension.
EXAMPLE_BATCH = 2


def training_config(checkpoint: Checkpoint) -> Config:
    """The typed training config the checkpoint was written with, read as data: every string that
    holds ``${`` is escaped first (see ``escape_interpolations``), so no interpolation or resolver
    named by the checkpoint runs and such a string keeps its literal text."""
    saved = checkpoint.meta.get("config")
    if not isinstance(saved, dict):
        raise ConfigError(
            f"checkpoint={str(checkpoint.path)!r} holds no training config (its manifest's "
            f"meta has no 'config'): it predates exportable checkpoints"
        )
    try:
        # to_object of a structured Config is a Config instance.
        return cast(
            Config,
            OmegaConf.to_object(
                OmegaConf.merge(OmegaConf.structured(Config), escape_interpolations(saved))
            ),
        )
    except OmegaConfBaseException as err:
        raise ConfigError(
            f"checkpoint={str(checkpoint.path)!r}: its training config does not fit this "
            f"version's schema: {str(err).splitlines()[0]}"
        ) from None


# Any run of backslashes right before "${": OmegaConf reads "\${" as a literal "${" and "\\" before
# an interpolation as one backslash.
_INTERPOLATION = re.compile(r"(\\*)\$\{")


def escape_interpolations(value: Any) -> Any:
    """``value`` (JSON-like data: dicts, lists, scalars) with every string escaped so that OmegaConf
    gives back its literal text: ``${x}`` becomes ``\\${x}`` and the backslashes right before a
    ``${`` are doubled. Strings without ``${`` are never interpreted and stay as they are."""
    if isinstance(value, str):
        return _INTERPOLATION.sub(lambda m: m[1] * 2 + "\\${", value) if "${" in value else value
    if isinstance(value, dict):
        return {key: escape_interpolations(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [escape_interpolations(item) for item in value]
    return value


def config_yaml(cfg: Config) -> str:
    """``cfg`` as YAML that OmegaConf loads back to the same values, ``${`` included (escaped)."""
    data = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=False, enum_to_str=True)
    return OmegaConf.to_yaml(escape_interpolations(data))


def recorded_trainer(checkpoint: Checkpoint, cfg: Config) -> str | None:
    """The Trainer class the checkpoint says wrote it, as text (never imported), when it is not
    this package's Trainer: its manifest's ``meta.trainer``, else the config's
    ``trainer._target_``. A class of a script run directly (``__main__.Name``) is named by the
    config's ``trainer._target_`` when that names a class of the same name."""
    meta = checkpoint.meta.get("trainer")
    target = cfg.trainer._target_ if isinstance(cfg.trainer._target_, str) else ""
    recorded = meta if isinstance(meta, str) and meta else target
    if not recorded or recorded in _DEFAULT_TRAINER_NAMES:
        return None
    name = recorded.rpartition(".")[2]
    if (
        recorded.startswith("__main__.")
        and not target.startswith("__main__.")
        and target.rpartition(".")[2] == name
    ):
        return target
    return recorded


def trainer_hint(recorded: str) -> str:
    """The ``trainer=`` argument that rebuilds with the ``recorded`` class."""
    if recorded.startswith("__main__."):
        name = recorded.rpartition(".")[2]
        return (
            f"trainer=my_package.my_module.{name} (the checkpoint records {recorded!r}, a class "
            f"of a script run directly: name it by an importable dotted path)"
        )
    return f"trainer={recorded}"


def trainer_class(checkpoint: Checkpoint, cfg: Config, override: str | None) -> type[Trainer]:
    """The class named by ``trainer=`` if given, else ``sdnet_trainer.Trainer``: the class the
    checkpoint records is information, never imported here. Logs the recorded class when it is
    another one."""
    recorded = recorded_trainer(checkpoint, cfg)
    if override:
        cls = resolve_trainer_class(override, key="trainer")
        if recorded is not None and recorded != override:
            logger.info(
                "rebuilding the model with trainer=%s; the checkpoint records the Trainer class %r",
                override,
                recorded,
            )
        return cls
    if recorded is not None:
        logger.warning(
            "the checkpoint records the Trainer class %r; export does not import classes a "
            "checkpoint names and rebuilds the model with %s; to rebuild it with the recorded "
            "class, pass %s",
            recorded,
            DEFAULT_TRAINER,
            trainer_hint(recorded),
        )
    return Trainer


def load_model(trainer: Trainer, checkpoint: Checkpoint, *, ema: bool = False) -> nn.Module:
    """The bare model of ``trainer`` with the checkpoint's weights (with ``ema``, their moving
    average: ``model.ema``), in eval mode on the CPU. Every model entry of the checkpoint must
    have its place in the model, and the other way round. A LoRA run's checkpoint holds its
    adapters alone, which go into the base the run trained them on (``_lora_base``)."""
    entry = "ema" if ema else "model"
    if ema and not checkpoint.has_key("ema"):
        raise ConfigError(
            f"ema=true: checkpoint={str(checkpoint.path)!r} holds no average of the weights "
            "(it was written without model.ema.enabled=true)"
        )
    lora = trainer.cfg.model.lora.enabled
    check_lora_base(checkpoint, trainer.cfg)
    model = _lora_base(trainer) if lora else trainer.build_model()
    state = model.state_dict()
    if lora:  # the checkpoint holds the adapters: the frozen base is the run's own (above)
        state = {name: value for name, value in state.items() if base_name(name) is None}
    # A tied weight (an embedding shared with the output layer) is one tensor under two names;
    # the checkpoint may hold it under one of them only.
    request = {
        name: value
        for name, value in state.items()
        if name not in _aliases(state) or checkpoint.has_key(f"{entry}.{name}")
    }
    what = f"the model {type(trainer).__name__}.build_model builds"
    extra = _unmatched(checkpoint, state, entry)
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ConfigError(
            f"checkpoint={str(checkpoint.path)!r} holds weights {what} has no place for: "
            f"{', '.join(extra[:5])}{more}"
        )
    manager = CheckpointManager(
        checkpoint.path.parent, keep_last=1, async_save=False, rank=0, world_size=1
    )
    try:
        # DCP fills these tensors in place, resharding whatever layout the writer used.
        manager.load(checkpoint, {entry: request})
    except CheckpointError as err:
        raise ConfigError(
            f"checkpoint={str(checkpoint.path)!r} does not hold the weights of {what}: {err}"
        ) from None
    finally:
        manager.close()
    model.load_state_dict(state, strict=not lora)
    return model.eval()


def check_lora_base(checkpoint: Checkpoint, cfg: Config) -> None:
    """A LoRA checkpoint's adapters go into the base folder its config names: refused where the
    folder no longer holds the base they were trained on (models/base_fingerprint.py)."""
    if cfg.model.lora.enabled:
        check_adapters_base(
            checkpoint.meta.get("lora"),
            adapters_meta(cfg.model.weights),
            source=f"checkpoint={str(checkpoint.path)!r}",
        )


def _lora_base(trainer: Trainer) -> nn.Module:
    """A LoRA run's model (``model.lora``) with its frozen base as the run had it: the weights
    of ``model.weights=hf:PATH``, or the init of the run's seed (built on the CPU from the
    generator state the Trainer's build starts from: the same values)."""
    cfg = trainer.cfg
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.loop.seed)
        model = trainer.build_model()
    reader = hf_weights_reader(cfg.model)
    if reader is not None:
        reader.load(model)
    return model


def _unmatched(checkpoint: Checkpoint, state: dict[str, Any], entry: str) -> list[str]:
    """The checkpoint's ``entry`` (model or ema) keys that are no entry of ``state`` (nor inside
    one)."""
    prefix = entry + "."
    keys = sorted(k[len(prefix) :] for k in checkpoint._keys if k.startswith(prefix))
    unmatched = []
    for key in keys:
        parts = key.split(".")
        if not any(".".join(parts[:i]) in state for i in range(1, len(parts) + 1)):
            unmatched.append(key)
    return unmatched


def _aliases(state: dict[str, Any]) -> set[str]:
    """Names whose tensor shares its memory with a tensor listed earlier."""
    seen: set[tuple[int, int | torch.SymInt, tuple[int, ...]]] = set()
    aliases = set()
    for name, value in state.items():
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            continue
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if key in seen:
            aliases.add(name)
        seen.add(key)
    return aliases


def example_inputs(trainer: Trainer) -> tuple[torch.Tensor, ...]:
    """Positional inputs for tracing the model, batch size EXAMPLE_BATCH.

    A Trainer subclass may define ``example_input()`` (a tensor or a tuple of them). A subclass
    with its own datasets gives its validation set's first samples, since its data config need not
    describe them. Otherwise the data config says: token ids ``(batch, data.seq_len)`` for
    language data, else images of ``data.channels`` at the size evaluation fed the model: the
    eval transform's crop for image files (``data.augment.val_crop_size``, by default
    ``data.image_size``), ``data.image_size`` for generated images."""
    custom = getattr(trainer, "example_input", None)
    if callable(custom):
        inputs = custom()
        return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if type(trainer).build_datasets is not Trainer.build_datasets:
        return _from_dataset(trainer)
    data = trainer.cfg.data
    g = torch.Generator().manual_seed(0)
    if is_language_model_data(data):
        return (torch.randint(0, data.vocab_size, (EXAMPLE_BATCH, data.seq_len), generator=g),)
    size = data.image_size if data.name == "synthetic" else crop_sizes(data).val_crop
    return (torch.randn(EXAMPLE_BATCH, data.channels, size, size, generator=g),)


def _from_dataset(trainer: Trainer) -> tuple[torch.Tensor, ...]:
    train, val = trainer.build_datasets()
    # Map-style datasets (build_datasets' contract) have a length; torch's Dataset type omits it.
    dataset = val if val is not None and len(val) else train  # type: ignore[arg-type]
    samples = [dataset[i % len(dataset)] for i in range(EXAMPLE_BATCH)]  # type: ignore[arg-type]
    first = samples[0]
    if isinstance(first, torch.Tensor):
        return (torch.stack(samples),)
    if isinstance(first, (tuple, list)) and isinstance(first[0], torch.Tensor):
        return (torch.stack([s[0] for s in samples]),)  # (inputs, targets, ...): the inputs
    raise ConfigError(
        f"{type(trainer).__name__}: cannot tell the model's input from a dataset sample of "
        f"type {type(first).__name__}; define {type(trainer).__name__}.example_input() "
        f"returning an example batch"
    )
