"""The Trainer class a config names (``trainer._target_``), for the commands that build one."""

from __future__ import annotations

from hydra.utils import get_class

from sdnet_trainer.errors import ConfigError
from sdnet_trainer.training.trainer import Trainer


def resolve_trainer_class(target: str, *, key: str = "trainer._target_") -> type[Trainer]:
    """The Trainer (sub)class named by the dotted path ``target``; ``key`` names its source in
    errors."""
    try:
        cls = get_class(target)
    except Exception as err:  # hydra wraps import failures in several exception types
        raise ConfigError(f"{key}={target!r} cannot be imported: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise ConfigError(f"{key}={target!r} is not a subclass of sdnet_trainer.Trainer")
    return cls


__all__ = ["resolve_trainer_class"]
