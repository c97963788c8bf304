"""sdnet_trainer: a thin, PyTorch-native orchestration layer for distributed training."""

from sdnet_trainer.compat import check_torch

# First: an older torch fails here in one line naming the torch needed, not later on a missing name.
check_torch()

from sdnet_trainer.cli import launch  # noqa: E402
from sdnet_trainer.config import Config, compose  # noqa: E402
from sdnet_trainer.errors import ConfigError  # noqa: E402
from sdnet_trainer.training.hooks import HookBase  # noqa: E402
from sdnet_trainer.training.state import RunState, StepResult  # noqa: E402
from sdnet_trainer.training.trainer import Trainer  # noqa: E402

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
