"""Configuration: typed schemas, Hydra registration, composition and validation."""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from sdnet_trainer.config.resolvers import register_resolvers
from sdnet_trainer.config.schema import (Config, DataConfig, DDPConfig, DistConfig, LoggingConfig,
                                         LoopConfig, LossConfig, ModelConfig, OptimConfig,
                                         ParallelConfig, PrecisionConfig, RunConfig, SchedConfig)
from sdnet_trainer.config.store import CONFIG_MODULE, recipe_names, register_configs
from sdnet_trainer.config.validate import micro_batch_size, validate

register_resolvers()
register_configs()


def to_config(cfg: DictConfig) -> Config:
    """The composed DictConfig as the typed ``Config`` dataclass (interpolations resolved)."""
    return OmegaConf.to_object(cfg)


def compose(overrides: Sequence[str] = ()) -> Config:
    """Compose the config exactly as the CLI would, without running anything.

    ``compose(["+recipe=resnet152", "loop.max_steps=10"])`` is the typed config a launch with those
    arguments trains with: handy in notebooks and tests.
    """
    from hydra import compose as hydra_compose, initialize_config_module

    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        return to_config(hydra_compose(config_name="config", overrides=list(overrides)))


__all__ = [
    "Config", "DataConfig", "DDPConfig", "DistConfig", "LoggingConfig", "LoopConfig", "LossConfig",
    "ModelConfig", "OptimConfig", "ParallelConfig", "PrecisionConfig", "RunConfig", "SchedConfig",
    "compose", "micro_batch_size", "recipe_names", "to_config", "validate",
]
