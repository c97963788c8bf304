"""The run's checkpointing: which state is saved, when, and how a run resumes from it.

``Checkpointer`` receives the stateful parts of a run (model, optimizer, schedule, counters,
loss scaler, gradient-communication state, random streams), each with a ``state_dict`` /
``load_state_dict`` pair, and owns everything else: when to save (every N steps, every N
minutes by rank 0's clock, on a stop signal, at the end), synchronous or asynchronous saving,
pruning (through ``CheckpointManager``, which owns the folder: staging, manifest, atomic
commit, restricted reads) and resuming. The Trainer hands it the parts and calls it as a hook.

Every part is one top-level entry of the DCP state dict (sdnet_trainer.checkpoint.parts: model and
optimizer go through torch's distributed state-dict helpers, so a checkpoint loads into any layout
and world size). Per-rank parts (random
streams, PowerSGD's error feedback) are saved under ``NAME/rankR`` and restored only on the same
world size; elsewhere their ``reset`` re-derives them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from omegaconf import OmegaConf
from torch import nn
from torch.optim import Optimizer

from sdnet_trainer.checkpoint import Checkpoint, CheckpointManager
from sdnet_trainer.checkpoint.parts import ModelState, OptimizerState, Part, Stateful
from sdnet_trainer.config.schema import CheckpointConfig, Config
from sdnet_trainer.models.base_fingerprint import adapters_meta, check_adapters_base
from sdnet_trainer.models.lora import is_adapted
from sdnet_trainer.training.ema import WeightAverage
from sdnet_trainer.training.health import PhaseTracker
from sdnet_trainer.training.hooks import HookBase
from sdnet_trainer.training.state import RunState, StepResult

logger = logging.getLogger(__name__)


class Checkpointer(HookBase):
    """Saves and restores a run's parts; as a hook, decides when to save.

    Every rank constructs one at the same point (the manager creates a process group) and calls
    it collectively. ``meta`` travels in the manifest (the config and Trainer class: export
    rebuilds the model from them without the run directory). ``report(step, metrics)`` receives
    each save's ``checkpoint/save_seconds`` (the time the loop was held: the copy to host memory
    under ``async_save``), ``checkpoint/bytes`` (this rank's) and ``checkpoint/step``.
    ``run_id`` (``run.id``, the same on
    every rank and across torchrun's restarts) makes ``directory`` this run's until ``close``:
    another run saving there is refused with a ConfigError on every rank (see CheckpointManager).
    ``before_save`` runs at the start of every save, before any state is read: the Trainer settles
    a step verdict still in flight there, so that no checkpoint holds a step that is to be
    rejected (see ``optimizer_step.OptimizerStep.settle``).
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        directory: str | Path,
        parts: dict[str, Part],
        rank: int,
        world_size: int,
        meta: dict[str, Any],
        run_id: str,
        phase: PhaseTracker | None = None,
        before_save: Callable[[], None] | None = None,
        report: Callable[[int, dict[str, float]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.before_save = before_save
        self.report = report
        self.parts = parts
        self.rank = rank
        self.world_size = world_size
        self.meta = meta
        self.phase = phase
        self.manager = CheckpointManager(
            directory,
            keep_last=cfg.keep_last,
            async_save=cfg.async_save,
            rank=rank,
            world_size=world_size,
            run_id=run_id,
            storage_options=dict(cfg.storage_options),
        )
        self._last_save_time = time.monotonic()

    def _key(self, name: str) -> str:
        return f"{name}/rank{self.rank}" if self.parts[name].per_rank else name

    # ------------------------------------------------------------------ when to save

    def save_due(self) -> bool:
        """Rank 0's clock says a timed checkpoint is due (``checkpoint.every_n_minutes``); the
        ranks agree on it in the step's all-reduce, so all of them save at the same step."""
        minutes = self.cfg.every_n_minutes
        return (
            self.rank == 0
            and minutes is not None
            and time.monotonic() - self._last_save_time >= 60 * minutes
        )

    def after_step(self, state: RunState, result: StepResult) -> None:
        every = self.cfg.every_n_steps
        periodic = every is not None and state.step % every == 0
        on_stop = result.stop_requested and self.cfg.save_on_exit
        if (periodic or result.save_due or on_stop) and state.step != state.last_checkpoint_step:
            self.save(state)

    def after_train(self, state: RunState) -> None:
        if self.cfg.save_on_exit and state.step != state.last_checkpoint_step:
            self.save(state)

    def close(self) -> None:
        """Wait for an async save in flight (raising its error); release the checkpoint
        directory's lock and the manager's process group."""
        self.manager.close()

    # ------------------------------------------------------------------ saving and resuming

    def save(self, state: RunState) -> None:
        if self.before_save is not None:
            self.before_save()  # may raise: then nothing of this step is saved
        if self.phase is not None:
            self.phase.enter("checkpoint save", step=state.step)
        started = time.perf_counter()
        entries = {}
        for name, part in self.parts.items():
            value = part.state.state_dict()
            if not (part.per_rank and value == {}):  # a comm hook without memory: nothing to keep
                entries[self._key(name)] = value
        nbytes = self.manager.save(state.step, entries, meta=self.meta)
        state.last_checkpoint_step = state.step
        self._last_save_time = time.monotonic()
        if self.report is not None:
            seconds = time.perf_counter() - started
            self.report(
                state.step,
                {
                    "checkpoint/save_seconds": seconds,
                    "checkpoint/bytes": float(nbytes),
                    "checkpoint/step": float(state.step),
                },
            )

    def resume(self, state: RunState) -> Checkpoint | None:
        """Load ``checkpoint.resume`` (none, auto or a path) into the parts; None if nothing was
        loaded. Collective."""
        checkpoint = self.manager.resolve_resume(self.cfg.resume)
        if checkpoint is None:
            return None
        if "lora" in self.meta:  # adapters go back into this run's base: it must be theirs
            check_adapters_base(
                checkpoint.meta.get("lora"),
                self.meta["lora"],
                source=f"checkpoint.resume={checkpoint.path}",
            )
        same_world = checkpoint.world_size == self.world_size
        request: dict[str, Any] = {}
        later: list[Callable[[], None]] = []
        for name, part in self.parts.items():
            key = self._key(name)
            present = checkpoint.has_key(key)
            if (part.per_rank and not same_world) or (
                not present and (part.per_rank or part.optional)
            ):
                if part.reset is not None:
                    later.append(part.reset)
                continue
            load_request = getattr(part.state, "load_request", None)
            request[key] = (
                load_request(checkpoint, key) if load_request else part.state.state_dict()
            )
        self.manager.load(checkpoint, request)
        for name, part in self.parts.items():
            if (key := self._key(name)) in request:
                part.state.load_state_dict(request[key])
        for reset in later:
            reset()
        state.last_checkpoint_step = state.step
        logger.info(
            "resumed from %s: step %d, epoch %d, sample %d of the epoch (written by %d ranks%s)",
            checkpoint.path,
            state.step,
            state.epoch,
            state.epoch_sample,
            checkpoint.world_size,
            "" if same_world else "; random streams re-derived",
        )
        return checkpoint


def run_parts(
    *,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: Stateful,
    state: RunState,
    scaler: Stateful | None,
    comm: Stateful | None,
    rng_state: Stateful,
    rederive_rng: Callable[[], None],
    ema: WeightAverage | None = None,
    trackers: Stateful | None = None,
) -> dict[str, Part]:
    """A training run's parts, in load order (the random streams last: nothing loaded after them
    may draw from them). ``scaler`` is None without fp16 loss scaling, ``comm`` without DDP,
    ``ema`` without ``model.ema``; ``trackers`` holds the MLflow / W&B run ids that a resumed
    run continues."""
    parts = {
        # With model.lora's adapters, only they: the frozen base is the run's to rebuild.
        "model": Part(ModelState(model, trainable_only=is_adapted(model))),
        "optim": Part(OptimizerState(model, optimizer)),
        "scheduler": Part(scheduler),
        "trainer": Part(state),  # the counters, under the entry name checkpoints have always used
    }
    if ema is not None:
        # Absent when the checkpoint was written without model.ema: start it from the weights.
        parts["ema"] = Part(ema, optional=True, reset=ema.restart)
    if trackers is not None:
        parts["trackers"] = Part(trackers, optional=True)  # absent from older checkpoints
    if scaler is not None:
        parts["scaler"] = Part(scaler, optional=True)  # absent when written without fp16
    # Per rank: PowerSGD's error feedback and the random streams differ between ranks.
    if comm is not None:
        parts["comm"] = Part(comm, per_rank=True)
    parts["rng"] = Part(rng_state, per_rank=True, reset=rederive_rng)
    return parts


def run_meta(
    cfg: Config, trainer_class: type, global_batch_size: int, world_size: int
) -> dict[str, Any]:
    """What a checkpoint records besides its parts: the layout that wrote it, and the resolved
    config and Trainer class, from which export rebuilds the model without the run directory."""
    meta = {
        "global_batch_size": global_batch_size,
        "world_size": world_size,
        "trainer": f"{trainer_class.__module__}.{trainer_class.__qualname__}",
        "config": plain_config(cfg),
    }
    if cfg.model.lora.enabled:  # the model entry holds the adapters; the base is model.weights'
        meta["lora"] = adapters_meta(cfg.model.weights)  # with the base folder's fingerprint
    return meta


def plain_config(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain data (the checkpoint's record, the trackers' params)."""
    return cast(dict[str, Any], OmegaConf.to_container(OmegaConf.structured(cfg)))
