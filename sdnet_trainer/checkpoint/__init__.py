"""Checkpoints: what a run saves and when (``checkpointer``), over the folder it saves into.

The names users and the rest of the package import are re-exported here.
"""

from sdnet_trainer.checkpoint.manager import (
    LOCK,
    MANIFEST,
    Checkpoint,
    CheckpointError,
    CheckpointManager,
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
]
