"""sdnet_trainer: a thin, PyTorch-native orchestration layer for distributed training."""

import gc

# Importing torch, Hydra and this package creates about a million objects that all live as long
# as the process. Cyclic garbage collections during the import walk them again and again and find
# nothing to free: a fifth of the import's CPU time, in every process a launch starts. The
# collector is off while the package imports, and back as it was after.
_collecting = gc.isenabled()
gc.disable()
try:
    from sdnet_trainer.compat import check_torch

    # First: an older torch fails here in one line naming the torch needed, not later on a
    # missing name.
    check_torch()

    from sdnet_trainer.cli import launch
    from sdnet_trainer.config import Config, compose
    from sdnet_trainer.errors import ConfigError
    from sdnet_trainer.training.hooks import HookBase
    from sdnet_trainer.training.state import RunState, StepResult
    from sdnet_trainer.training.trainer import Trainer
finally:
    if _collecting:
        gc.enable()

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
