"""Compatibility path: the Trainer lives in ``sdnet_trainer.training.trainer``.

Configs and scripts that name ``sdnet_trainer.trainer.Trainer`` (``trainer._target_``) keep
working; new code names ``sdnet_trainer.Trainer``.
"""

from sdnet_trainer.training.classes import resolve_trainer_class
from sdnet_trainer.training.trainer import Trainer

__all__ = ["Trainer", "resolve_trainer_class"]
