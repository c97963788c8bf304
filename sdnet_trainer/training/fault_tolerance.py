"""The ft room in a Trainer (:func:`attach`), and its figures at each log point: one log line, and
``ft/*`` keys for the metrics writer (TensorBoard, JSONL, the trackers and, through its sink,
Prometheus as ``sdnet_ft_*``).

The training loop's side of fault tolerance lives here, in training/: the room
(sdnet_trainer.ft) receives what it needs as arguments and imports nothing of the training loop,
so the two folders do not import each other (tests/unit/test_architecture.py)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sdnet_trainer.ft.data import ShareBatches
from sdnet_trainer.ft.room import FaultTolerance
from sdnet_trainer.observability.writers import MetricsWriter
from sdnet_trainer.training.hooks import HookBase
from sdnet_trainer.training.state import RunState, StepResult

if TYPE_CHECKING:
    from sdnet_trainer.training.trainer import Trainer

logger = logging.getLogger(__name__)


def attach(trainer: Trainer) -> tuple[FaultTolerance, ShareBatches, FaultToleranceHook]:
    """``fault_tolerance.enabled``: the room over the trainer's checkpoint parts (what a joining
    group receives), this rank's share of each step's batch, and the metrics hook."""
    cfg, env, dims = trainer.cfg, trainer.env, trainer.dims
    batches = ShareBatches(
        trainer.data.train_loader.dataset,
        trainer.data.train_sampler,
        global_batch_size=trainer.layout.global_batch_size,
        group_size=dims.dp,
        group_rank=dims.dp_rank(env.rank),
    )
    rederive_rng = trainer.checkpointer.parts["rng"].reset
    assert rederive_rng is not None
    room = FaultTolerance(
        cfg.fault_tolerance,
        group_rank=env.rank,
        group_size=env.world_size,
        distributed=env.distributed,
        parts=trainer.checkpointer.parts,
        after_load=rederive_rng,
        step=trainer.state.step,
    )
    every = cfg.logging.log_every_n_steps
    return room, batches, FaultToleranceHook(room, writer=trainer.writer, every_n_steps=every)


class FaultToleranceHook(HookBase):
    """Every ``every_n_steps`` steps and at the end: the quorum, recoveries, degraded and skipped
    steps."""

    def __init__(self, room: FaultTolerance, *, writer: MetricsWriter, every_n_steps: int) -> None:
        self.room, self.writer, self.every_n_steps = room, writer, every_n_steps

    def after_step(self, state: RunState, result: StepResult) -> None:
        if state.step % self.every_n_steps == 0:
            self._report(state)

    def after_train(self, state: RunState) -> None:
        self._report(state)
        state.metrics.update(self.room.metrics())

    def _report(self, state: RunState) -> None:
        figures = self.room.metrics()
        self.writer.write(state.step, figures)
        logger.info(
            "step %d | ft quorum %d of %d groups %s | recoveries %d (%.2f s) | degraded steps %d "
            "| skipped steps %d",
            state.step,
            int(figures["ft/quorum_size"]),
            self.room.cfg.groups,
            self.room.quorum_groups(),
            int(figures["ft/recoveries"]),
            figures["ft/recovery_seconds"],
            int(figures["ft/degraded_steps"]),
            int(figures["ft/skipped_steps"]),
        )

    def close(self) -> None:
        self.room.close()


__all__ = ["FaultToleranceHook", "attach"]
