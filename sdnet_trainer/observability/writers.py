"""The run's metrics, fanned out to the trackers of ``logging.trackers`` (rank 0) and to sinks.

``write(step, {"train/loss": 0.3, ...})`` is called on every rank at the same points (the
metrics hook's log points, evaluations, the final summary). Only the enabled writer (rank 0)
builds trackers (sdnet_trainer.observability.trackers): TensorBoard, metrics.jsonl, metrics.csv,
MLflow, W&B. Sinks (the Prometheus exporter) receive every write on every rank.

The writer is also a checkpoint part: ``state_dict`` holds the MLflow and W&B run ids, so a
resumed run continues the same tracker runs. The part is replicated (every rank saves the same
ids): ``start`` hands rank 0's ids to the other ranks in one broadcast.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import torch.distributed as dist

from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.config.observability import LoggingConfig
from sdnet_trainer.config.schema import Config
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.observability.trackers import (
    EXTRAS,
    FAILED,
    FINISHED,
    KILLED,
    METRICS_FILE,
    TENSORBOARD_DIR,
    CsvTracker,
    JsonlTracker,
    MLflowTracker,
    TensorBoardTracker,
    Tracker,
    WandbTracker,
    missing_extra,
)

logger = logging.getLogger(__name__)

__all__ = ["METRICS_FILE", "TENSORBOARD_DIR", "MetricsWriter", "Sink", "validate_trackers"]

TRACKERS = ("tensorboard", "jsonl", "csv", "mlflow", "wandb")  # logging.trackers
RESUMABLE = ("mlflow", "wandb")  # those whose run id the checkpoint keeps
WANDB_MODES = ("online", "offline", "disabled")
_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's stores through SQLAlchemy
# A tracker run id read from a checkpoint (untrusted): MLflow's own rule for run ids, which also
# keeps out every character W&B forbids in one.
_RUN_ID = re.compile(r"[A-Za-z0-9][\w\-]{0,255}")


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class _Checkpoint(Protocol):  # sdnet_trainer.checkpoint.Checkpoint, as far as used here
    def has_key(self, key: str) -> bool: ...


def _build(name: str, cfg: LoggingConfig, directory: Path, run_name: str) -> Tracker:
    if name == "tensorboard":
        return TensorBoardTracker(directory)
    if name == "jsonl":
        return JsonlTracker(directory)
    if name == "csv":
        return CsvTracker(directory)
    if name == "mlflow":
        return MLflowTracker(cfg.mlflow, directory=directory, run_name=run_name)
    if name == "wandb":
        return WandbTracker(cfg.wandb, directory=directory, run_name=run_name)
    raise ConfigError(f"logging.trackers: unknown tracker {name!r} (one of {', '.join(TRACKERS)})")


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _status(error: BaseException | None) -> str:
    """How the run ended, from the exception on its way out (None: it finished). SystemExit is a
    stop signal's exit (after its checkpoint) and KeyboardInterrupt a Ctrl-C: KILLED."""
    if error is None:
        return FINISHED
    return KILLED if isinstance(error, (SystemExit, KeyboardInterrupt)) else FAILED


class MetricsWriter:
    """Fans ``write`` out to rank 0's trackers and to every rank's sinks.

    ``enabled``: this rank logs (rank 0). ``config``: the resolved config as a plain dict, logged
    as the run's params. ``run_name``: the tracker run's name unless ``logging.mlflow.run_name``
    is set. The file trackers open their files here; ``start`` (once the checkpoint is loaded)
    opens the MLflow and W&B runs. ``close`` ends them as FINISHED, or FAILED / KILLED when it
    runs while an exception propagates (the Trainer calls it in a ``finally``)."""

    def __init__(
        self,
        output_dir: str | Path,
        cfg: LoggingConfig,
        *,
        enabled: bool,
        run_name: str,
        config: dict[str, Any],
        sinks: Sequence[Sink] = (),
    ) -> None:
        self.config = config
        self._sinks = list(sinks)
        self._ids = {name: "" for name in RESUMABLE}  # "": no run yet
        self._needs_ids = any(name in RESUMABLE for name in cfg.trackers)
        self._trackers: list[Tracker] = []
        self._failing: set[str] = set()  # trackers whose last write failed
        if enabled:
            directory = Path(output_dir)
            directory.mkdir(parents=True, exist_ok=True)
            for name in cfg.trackers:
                self._trackers.append(_build(name, cfg, directory, run_name))

    def start(self) -> None:
        """Open the tracker runs, continuing those whose ids ``load_state_dict`` restored, and
        log the config. Collective when ``logging.trackers`` has mlflow or wandb and the run has
        several ranks (one broadcast from rank 0); otherwise local."""
        error: Exception | None = None
        try:
            for tracker in self._trackers:
                run_id = tracker.start(self._ids.get(tracker.name) or None, self.config)
                if tracker.resumable and run_id is not None:
                    self._ids[tracker.name] = run_id
        except Exception as exc:  # told to the other ranks below, then raised
            error = exc
        if self._needs_ids and _world_size() > 1:
            # Rank 0 alone talks to the tracking services: every rank takes its run ids (the
            # checkpoint part is replicated, so all ranks must save the same) and its failure.
            box: list[Any] = [(self._ids, None if error is None else str(error))]
            dist.broadcast_object_list(box, src=0)
            self._ids, failure = box[0]
            if failure is not None and error is None:
                raise ConfigError(f"rank 0 could not start logging.trackers: {failure}")
        if error is not None:
            raise error

    def write(
        self, step: int, metrics: dict[str, float], *, this_rank: dict[str, float] | None = None
    ) -> None:
        """``metrics`` (the same on every rank) to the trackers and sinks; ``this_rank``, this
        rank's own readings, to its sinks only (the trackers write rank 0's files)."""
        own = {**metrics, **this_rank} if this_rank else metrics
        for sink in self._sinks:
            sink.write(step, own)
        for tracker in self._trackers:
            try:
                tracker.write(step, metrics)
            except Exception as exc:
                # A tracking server that is down for a while must not end a long run (the other
                # ranks would wait for rank 0 until the step timeout): the metrics stay in the
                # other trackers; said once per tracker until it writes again.
                if tracker.name not in self._failing:
                    logger.error(
                        "logging to %s failed at step %d, training goes on: %s",
                        tracker.name,
                        step,
                        exc,
                    )
                self._failing.add(tracker.name)
            else:
                self._failing.discard(tracker.name)

    # ------------------------------------------------------------------ checkpoint part

    def state_dict(self) -> dict[str, Any]:
        """The MLflow and W&B run ids ("" when none), the same on every rank after ``start``.
        Kept when this run does not use a tracker, so a later resume that does can continue it."""
        return dict(self._ids)

    def load_request(self, checkpoint: _Checkpoint, key: str) -> dict[str, Any]:
        """What to read back: the ids this checkpoint has (a tracker added later is absent from
        older checkpoints; asking DCP for it would fail the resume)."""
        return {name: "" for name in self._ids if checkpoint.has_key(f"{key}.{name}")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, run_id in state.items():
            if name not in self._ids:
                continue
            if not isinstance(run_id, str) or (run_id and not _RUN_ID.fullmatch(run_id)):
                logger.warning(
                    "the checkpoint's %s run id %r is not a run id: starting a new %s run",
                    name,
                    run_id,
                    name,
                )
                continue
            self._ids[name] = run_id

    # ------------------------------------------------------------------ the end

    def close(self) -> None:
        """End the tracker runs and close every sink; a second call does nothing. The status is
        read from the exception being handled, if any (close runs in the Trainer's ``finally``).
        A tracker that fails to close does not stop the others; its error is raised afterwards,
        unless an exception is already on its way out."""
        in_flight = sys.exc_info()[1]
        status = _status(in_flight)
        trackers, sinks = self._trackers, self._sinks
        self._trackers, self._sinks = [], []
        errors: list[Exception] = []
        for tracker in trackers:
            try:
                tracker.close(status)
            except Exception as exc:
                logger.error("closing the %s tracker failed: %s", tracker.name, exc)
                errors.append(exc)
        for sink in sinks:
            try:
                sink.close()
            except Exception as exc:
                logger.error("closing %s failed: %s", type(sink).__name__, exc)
                errors.append(exc)
        if errors and in_flight is None:
            raise errors[0]


def validate_trackers(cfg: Config) -> None:
    """``logging.trackers`` and the settings of the trackers it names, before launch."""
    logs = cfg.logging
    names = list(logs.trackers)
    for name in names:
        check_choice("logging.trackers", name, TRACKERS)
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"logging.trackers lists {', '.join(twice)} more than once")
    for name in names:
        if name in EXTRAS and importlib.util.find_spec(EXTRAS[name][0]) is None:
            raise ConfigError(missing_extra(name))
    if "mlflow" in names:
        if not logs.mlflow.experiment:
            raise ConfigError("logging.mlflow.experiment must name an experiment")
        uri = logs.mlflow.tracking_uri or ""
        database = urlparse(uri).scheme.split("+")[0] in _DATABASES
        if database and importlib.util.find_spec("sqlalchemy") is None:
            raise ConfigError(
                f"logging.mlflow.tracking_uri={uri!r} is a database, which needs the full MLflow "
                "package (SQLAlchemy): pip install mlflow; or leave it null for a local store"
            )
    if "wandb" in names and logs.wandb.mode is not None:
        check_choice("logging.wandb.mode", logs.wandb.mode, WANDB_MODES)
