"""sdnet_trainer: a thin, PyTorch-native orchestration layer for distributed training."""

from sdnet_trainer.cli import launch
from sdnet_trainer.config import Config, compose
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.training.hooks import HookBase
from sdnet_trainer.training.state import RunState, StepResult
from sdnet_trainer.training.trainer import Trainer

__all__ = [
    "Config",
    "ConfigError",
    "HookBase",
    "RunState",
    "StepResult",
    "Trainer",
    "compose",
    "launch",
]
__version__ = "0.1.0"
