"""Configuration: typed schemas, Hydra registration and composition.

Whole-config checks run in :func:`sdnet_trainer.preflight.validate`, which calls the validator
beside each component; :mod:`sdnet_trainer.config.checks` holds the helpers they share.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import cast

from omegaconf import DictConfig, OmegaConf

from sdnet_trainer.config.resolvers import register_resolvers
from sdnet_trainer.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DDPConfig,
    DistConfig,
    ElasticConfig,
    HealthConfig,
    LoggingConfig,
    LoopConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    SchedConfig,
)
from sdnet_trainer.config.store import CONFIG_MODULE, recipe_names, register_configs
from sdnet_trainer.config.synonyms import check_overrides, synonym_hint
from sdnet_trainer.errors import ConfigError

register_resolvers()
register_configs()


def to_config(cfg: DictConfig) -> Config:
    """The composed DictConfig as the typed ``Config`` dataclass (interpolations resolved)."""
    _reject_unknown_keys(cfg, prefix="")
    # The config is composed onto the Config schema (see config/store.py), so to_object builds
    # that dataclass.
    return cast(Config, OmegaConf.to_object(cfg))


def _reject_unknown_keys(node: DictConfig, *, prefix: str) -> None:
    """Hydra's ``+key=value`` lifts the schema's struct flag, and ``to_object`` would then drop the
    stray key silently; a key the schema does not know is an error wherever it came from."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return  # a free-form dict such as optim.kwargs
    fields = {f.name for f in dataclasses.fields(schema)}
    for key in node:
        name = prefix + str(key)
        if key not in fields:
            # By meaning first (nanoGPT's n_embd is our dim), then by spelling.
            synonym = synonym_hint(name)
            close = difflib.get_close_matches(str(key), sorted(fields), n=1)
            hint = (
                f"; {synonym}"
                if synonym
                else f"; did you mean {prefix}{close[0]}?"
                if close
                else ""
            )
            raise ConfigError(
                f"unknown config key {name} ({schema.__name__} has no field {key!r}){hint}"
            )
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _reject_unknown_keys(child, prefix=f"{name}.")


def compose(overrides: Sequence[str] = ()) -> Config:
    """Compose the config exactly as the CLI would, without running anything.

    ``compose(["+recipe=resnet152", "loop.max_steps=10"])`` is the typed config a launch with those
    arguments trains with: handy in notebooks and tests.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    check_overrides(overrides)
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        return to_config(hydra_compose(config_name="config", overrides=list(overrides)))


__all__ = [
    "CheckpointConfig",
    "ElasticConfig",
    "HealthConfig",
    "Config",
    "DataConfig",
    "DDPConfig",
    "DistConfig",
    "LoggingConfig",
    "LoopConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "RunConfig",
    "SchedConfig",
    "compose",
    "recipe_names",
    "to_config",
]
