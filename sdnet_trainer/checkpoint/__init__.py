"""Checkpoints: the folder a run saves into (``manager``: the commit protocol, over ``files``,
``lock``, ``disk`` and ``untrusted``, which reads a checkpoint that may be hostile). What a run
saves and when is the training loop's hook over this folder: sdnet_trainer.training.checkpointer.

The names users and the rest of the package import are re-exported here.
"""

from sdnet_trainer.checkpoint.checks import validate_checkpoint
from sdnet_trainer.checkpoint.files import MANIFEST
from sdnet_trainer.checkpoint.lock import LOCK
from sdnet_trainer.checkpoint.manager import CheckpointManager
from sdnet_trainer.checkpoint.untrusted import (
    Checkpoint,
    CheckpointError,
    find_checkpoint,
    read_checkpoint,
)

__all__ = [
    "LOCK",
    "MANIFEST",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "find_checkpoint",
    "read_checkpoint",
    "validate_checkpoint",
]
