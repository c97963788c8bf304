"""Compatibility path: the Trainer lives in ``sdnet_trainer.training.trainer``.

Configs and scripts that name ``sdnet_trainer.trainer.Trainer`` (``trainer._target_``) keep
working; new code names ``sdnet_trainer.Trainer``.
"""

from sdnet_trainer.training.trainer import Trainer, resolve_trainer_class

__all__ = ["Trainer", "resolve_trainer_class"]
