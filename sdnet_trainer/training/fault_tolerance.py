"""The ft room in a Trainer (:func:`attach`): the step's source under fault tolerance, and the
room's figures at each log point: one log line, and ``ft/*`` keys for the metrics writer
(TensorBoard, JSONL, the trackers and, through its sink, Prometheus as ``sdnet_ft_*``).

The training loop's side of fault tolerance lives here, in training/: the room
(sdnet_trainer.ft) receives what it needs as arguments and imports nothing of the training loop,
so the two folders do not import each other (tests/unit/test_architecture.py)."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from sdnet_trainer.checkpoint.parts import Part
from sdnet_trainer.config.schema import Config
from sdnet_trainer.data.loader import RunData
from sdnet_trainer.distributed.env import DistEnv
from sdnet_trainer.distributed.mesh import ParallelDims
from sdnet_trainer.ft.data import ShareBatches
from sdnet_trainer.ft.room import FaultTolerance
from sdnet_trainer.observability.writers import MetricsWriter
from sdnet_trainer.training.hooks import HookBase
from sdnet_trainer.training.state import RunState, StepResult
from sdnet_trainer.training.step_source import StepSource

logger = logging.getLogger(__name__)


def attach(
    cfg: Config,
    env: DistEnv,
    dims: ParallelDims,
    *,
    data: RunData,
    state: RunState,
    writer: MetricsWriter,
    parts: dict[str, Part],
    global_batch_size: int,
) -> tuple[FaultTolerantSource, FaultToleranceHook]:
    """``fault_tolerance.enabled``: the room over the run's checkpoint ``parts`` (what a joining
    group receives; their ``rng`` part re-derives the random state after a load), the step's
    source (this rank's share of each step's batch of ``data``, the quorum's agreement), and the
    metrics hook."""
    batches = ShareBatches(
        data.train_loader.dataset,
        data.train_sampler,
        global_batch_size=global_batch_size,
        group_size=dims.dp,
        group_rank=dims.dp_rank(env.rank),
    )
    rederive_rng = parts["rng"].reset
    assert rederive_rng is not None
    room = FaultTolerance(
        cfg.fault_tolerance,
        group_rank=env.rank,
        group_size=env.world_size,
        distributed=env.distributed,
        parts=parts,
        after_load=rederive_rng,
        step=state.step,
        device=env.device,
    )
    source = FaultTolerantSource(room, batches, data=data, state=state)
    every = cfg.logging.log_every_n_steps
    return source, FaultToleranceHook(room, writer=writer, every_n_steps=every)


class FaultTolerantSource(StepSource):
    """A step under fault tolerance (training/step_source.py's ``StepSource``): the quorum first (a
    joining group receives the state there), then this rank's share of the step's global batch,
    divided among the quorum's groups; in sync mode the groups' mean count of targets, and after
    backward the gradients averaged over the groups and the groups' vote."""

    def __init__(
        self, room: FaultTolerance, batches: ShareBatches, *, data: RunData, state: RunState
    ) -> None:
        super().__init__(data)
        self.room, self.batches, self.state = room, batches, state
        self.share = room.share

    @property
    def groups(self) -> int:
        return self.share.groups

    def begin_step(self) -> None:
        self.share = self.room.begin_step()

    def next_batch(self) -> Any:
        state = self.state
        batch = self.batches.batch(self.share, epoch=state.epoch, epoch_sample=state.epoch_sample)
        return self.data.to_device(batch)

    def average_count(self, count: torch.Tensor) -> torch.Tensor:
        return self.room.average(count)

    def commit(self, model: nn.Module) -> bool:
        if self.room.cfg.mode != "sync":
            return True  # semi-sync: the quorum and the commit are inside optimizer.step
        self.room.reduce_gradients(model)  # averaged over the quorum's groups
        return self.room.should_commit()

    def running(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> AbstractContextManager:
        return self.room.semi_sync(model, optimizer)

    def close(self) -> None:
        self.room.close()


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


__all__ = ["FaultToleranceHook", "FaultTolerantSource", "attach"]
