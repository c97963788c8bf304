"""Where a step's batches come from, and which replica groups share the step.

``Trainer.source`` is a :class:`StepSource`: without fault tolerance this class (the loader's
batches, one replica group, nothing to agree on); under ``fault_tolerance.enabled``
``training/fault_tolerance.py``'s ``FaultTolerantSource`` (the quorum, this group's share of the
batch, the groups' gradient average and vote). The step calls the same methods either way.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from sdnet_trainer.data.loader import RunData


class StepSource:
    """Without fault tolerance: the loader's next batch, one group, nothing to agree on."""

    def __init__(self, data: RunData) -> None:
        self.data = data

    @property
    def groups(self) -> int:
        """The replica groups that share this step's global batch."""
        return 1

    def begin_step(self) -> None:
        """Before the step's first batch (fault tolerance: the quorum)."""

    def next_batch(self) -> Any:
        """This rank's next micro-batch, on the device."""
        return self.data.next_batch()

    def average_count(self, count: torch.Tensor) -> torch.Tensor:
        """The group's count of targets averaged over the replica groups that share the step."""
        return count

    def commit(self, model: nn.Module) -> bool:
        """After backward: the gradients averaged over the replica groups, and whether the step
        counts (False: discard it and train the same samples again)."""
        return True

    def running(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> AbstractContextManager:
        """Around the training loop (fault tolerance's semi-synchronous modes wrap it)."""
        return nullcontext()

    def close(self) -> None:
        """Release what the peers hold (the fault-tolerance manager)."""


__all__ = ["StepSource"]
