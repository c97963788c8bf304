"""The run's state between steps: counters that the Trainer, the hooks and the checkpointer read.

``RunState`` is the one place where the step, the data position and the health counters live.
The Trainer advances it after every step, hooks read it (and never the Trainer's internals), and
the checkpointer saves the counters and restores them on resume. ``StepResult`` is what one
``train_step`` hands to the hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sdnet_trainer.config.checks import check_positive
from sdnet_trainer.config.schema import Config
from sdnet_trainer.errors import ConfigError

# The counters a checkpoint keeps, under its "trainer" entry (the name predates this class).
SAVED_COUNTERS = (
    "step",
    "epoch",
    "epoch_sample",
    "samples_seen",
    "skipped_steps",
    "nonfinite_steps",
)


@dataclass(frozen=True)
class EpochShape:
    """How steps make up an epoch at the current batch layout."""

    global_batch_size: int  # samples per optimizer step, over all ranks
    steps_per_epoch: int

    def exhausted(self, epoch_sample: int) -> bool:
        """No full global batch is left in an epoch from sample ``epoch_sample`` on."""
        return epoch_sample + self.global_batch_size > self.steps_per_epoch * self.global_batch_size


@dataclass
class RunState:
    """Where the run is. A step counts even when it was skipped (fp16 overflow, non-finite)."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    epoch_sample: int = 0  # position in the current epoch's sample order
    samples_seen: int = 0
    skipped_steps: int = 0  # fp16 steps the GradScaler skipped on inf/NaN gradients
    nonfinite_steps: int = 0  # steps skipped by health.nonfinite=skip
    last_checkpoint_step: int = -1  # not saved: a resumed run sets it to the step it resumed at
    epoch_ended: bool = False  # the step just taken finished an epoch
    # The latest value of each metric fit returns (train/loss, val/*, summary/*).
    metrics: dict[str, float] = field(default_factory=dict)

    def advance(self, shape: EpochShape) -> None:
        """Count the step that just ran and move the data position; an epoch ends when no full
        global batch is left in it."""
        self.step += 1
        self.samples_seen += shape.global_batch_size
        self.epoch_sample += shape.global_batch_size
        self.epoch_ended = shape.exhausted(self.epoch_sample)
        if self.epoch_ended:
            self.next_epoch()

    def next_epoch(self) -> None:
        self.epoch += 1
        self.epoch_sample = 0

    def state_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in SAVED_COUNTERS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in SAVED_COUNTERS:
            setattr(self, name, int(state[name]))


@dataclass(frozen=True)
class StepResult:
    """One optimizer step as the hooks see it. ``loss`` and ``grad_norm`` stay on the device
    (reading them is a host synchronisation: hooks do it at log points only)."""

    # This rank's part of the step's loss, times the gradient divisor (distributed/reduction.py):
    # its mean over the ranks whose loss counts is the step's loss, the mean over the global
    # batch's counted targets.
    loss: torch.Tensor
    grad_norm: torch.Tensor  # global, unscaled
    data_wait_s: float  # host time spent fetching and copying the step's batches
    seconds: float  # the whole step, host time
    # All ranks agreed a step held a NaN/Inf and skipped it: this step's where the verdict is read
    # at once, the previous step's where the fused optimizer skipped it on the device (applied).
    nonfinite: bool
    stop_requested: bool  # a rank received a stop signal: save and leave after this step
    save_due: bool  # rank 0's clock says a timed checkpoint is due (checkpoint.every_n_minutes)
    # On the device, 1.0 where the update was applied, 0.0 where it was skipped (a non-finite
    # step, perhaps not yet known on the host): the hooks that move state (the weight average,
    # a MoE's routing bias) scale their update by it, so a skipped step moves nothing.
    applied: torch.Tensor | None = None
    # False: fault tolerance's vote discarded the step (a peer group failed during it); the run's
    # counters do not move and the same samples are trained again (sdnet_trainer/ft/data.py).
    committed: bool = True


def validate_loop(cfg: Config) -> None:
    """``loop.*`` other than the batch split (sdnet_trainer.distributed.batching): how long the
    run trains and how often it evaluates; checked before launch (sdnet_trainer.preflight)."""
    loop = cfg.loop
    if (loop.max_steps is None) == (loop.max_epochs is None):
        raise ConfigError(
            f"set exactly one of loop.max_steps ({loop.max_steps}) and "
            f"loop.max_epochs ({loop.max_epochs}); the other must be null"
        )
    check_positive("loop.max_steps", loop.max_steps, allow_none=True)
    check_positive("loop.max_epochs", loop.max_epochs, allow_none=True)
    check_positive("loop.eval_every_n_steps", loop.eval_every_n_steps, allow_none=True)
    check_positive("loop.eval_batch_size", loop.eval_batch_size, allow_none=True)
    check_positive("loop.eval_max_batches", loop.eval_max_batches, allow_none=True)
