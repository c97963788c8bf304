"""Where rank 0 logs a run's scalars: one small class per tracker, all behind ``Tracker``.

``MetricsWriter`` (sdnet_trainer.observability.writers) builds the trackers that
``logging.trackers`` names and makes the same three calls to each: ``start(run_id, config)`` once
the checkpoint is loaded, ``write(step, metrics)`` at every log point and for the final summary,
``close(status)`` on every path out of the run. The file trackers (TensorBoard, metrics.jsonl,
metrics.csv) append to files in the run directory, so a resumed run in the same directory simply
continues them. MLflow and W&B keep a run on a tracking service: ``start`` returns its id, the
checkpoint keeps it, and a resumed run passes it back to continue the same tracker run.
"""

from __future__ import annotations

import csv
import importlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar
from urllib.parse import urlparse

from sdnet_trainer.config.observability import MLflowConfig, WandbConfig
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CSV_FILE = "metrics.csv"
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"  # the MLflow store folder (logging.mlflow.tracking_uri)

# How a run ended, in MLflow's words (W&B takes an exit code instead).
FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"

# Tracker name -> (module it imports, the sdnet_trainer extra that installs it).
EXTRAS = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}


def missing_extra(tracker: str) -> str:
    """The message for a tracker whose package is not installed."""
    extra = EXTRAS[tracker][1]
    return (
        f"logging.trackers has {tracker}, which is not installed: "
        f"pip install 'sdnet_trainer[{extra}]'"
    )


def import_extra(tracker: str) -> ModuleType:
    try:
        return importlib.import_module(EXTRAS[tracker][0])
    except ImportError as exc:
        raise ConfigError(missing_extra(tracker)) from exc


class Tracker:
    """One destination for the run's scalars. ``resumable``: it keeps a run id in the checkpoint."""

    name: ClassVar[str]
    resumable: ClassVar[bool] = False

    def start(self, run_id: str | None, config: dict[str, Any]) -> str | None:
        """Open the tracker's run, continuing ``run_id`` when given and still there, and record
        the resolved ``config``; returns the id to keep (None: nothing to keep)."""
        return None

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        raise NotImplementedError

    def close(self, status: str) -> None:
        """End the run (``status``: FINISHED, FAILED or KILLED); a second call does nothing."""


# ---------------------------------------------------------------------- files in the run directory


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer: SummaryWriter | None = SummaryWriter(log_dir=str(directory / TENSORBOARD_DIR))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        assert self._writer is not None, "write after close"
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def close(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class JsonlTracker(Tracker):
    """One JSON object per write: ``{"step": 10, "train/loss": 0.3, ...}``; easy to compare and
    plot, and what ``sdnet_trainer.sweep`` reads."""

    name = "jsonl"

    def __init__(self, directory: Path) -> None:
        # Open for the whole run, line-buffered: every write reaches the file at once.
        self._file = open(directory / METRICS_FILE, "a", buffering=1)  # noqa: SIM115

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self, status: str) -> None:
        self._file.close()


class CsvTracker(Tracker):
    """``metrics.csv`` in long format: a ``step,key,value`` header, then one row per scalar.

    The keys of a run are not known up front (evaluation metrics, the final summary and the
    per-rank columns of another world size appear later), and a resumed run appends to the same
    file. A wide file (one column per key) would have to rewrite its header and every earlier row
    whenever a key appears; the long layout only ever appends, so a crash cannot leave a header
    that disagrees with its rows, and spreadsheet or pandas users get the wide table with one
    pivot (``pd.read_csv(path).pivot_table(index="step", columns="key", values="value")``).
    Values are written in Python's shortest round-trip form: reading one back gives the same float.
    """

    name = "csv"
    HEADER = ("step", "key", "value")

    def __init__(self, directory: Path) -> None:
        path = directory / CSV_FILE
        fresh = not path.exists() or path.stat().st_size == 0
        self._file = open(path, "a", newline="")  # noqa: SIM115
        self._rows = csv.writer(self._file, lineterminator="\n")
        if fresh:
            self._rows.writerow(self.HEADER)
            self._file.flush()

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._rows.writerows((step, key, float(value)) for key, value in metrics.items())
        self._file.flush()  # one system call per log point, and the file is current for readers

    def close(self, status: str) -> None:
        self._file.close()


# ---------------------------------------------------------------------- tracking services


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": "0.1"}``: MLflow params are flat strings.
    Lists stay one value (JSON)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(value, default=str)
        else:
            flat[name] = str(value)
    return flat


def is_local_store(uri: str) -> bool:
    """A tracking URI that names a folder: MLflow's file store."""
    return urlparse(uri).scheme in ("", "file")


class MLflowTracker(Tracker):
    """An MLflow run through ``MlflowClient`` (no process-global active run): scalars as metrics
    at their step, the resolved config as params (dotted keys), FINISHED / FAILED / KILLED at
    the end.

    The default store is a folder, ``<run.root>/mlruns``: MLflow's file store, which needs nothing
    beyond mlflow-skinny. MLflow 3 keeps it in maintenance mode behind
    ``MLFLOW_ALLOW_FILE_STORE=true``, set here (unless already set) for local stores only;
    readers need it too (``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri
    file:<run.root>/mlruns``). MLflow's own default, ``sqlite:///mlflow.db``, needs SQLAlchemy,
    which mlflow-skinny lacks (``pip install mlflow`` brings it; then any database URI works).
    """

    name = "mlflow"
    resumable = True
    # MLflow's limit on a param's value; longer ones (a long list of paths) are cut to it.
    MAX_PARAM_LENGTH = 6000
    # Metric names may hold letters, digits, _ - . / and spaces (MLflow's rule on every OS): other
    # characters in a user's metric name become _, rather than failing the run at a log point.
    _NOT_IN_NAME = re.compile(r"[^\w./\- ]")

    def __init__(self, cfg: MLflowConfig, *, directory: Path, run_name: str) -> None:
        uri = cfg.tracking_uri or str(directory / MLFLOW_DIR)
        # A folder given as a path (the default, ${run.root}/mlruns) is resolved against the
        # launch directory, as the run directories are, once, so every rank and restart agree.
        self.uri = Path(uri).resolve().as_uri() if urlparse(uri).scheme == "" else uri
        self.experiment = cfg.experiment
        self.run_name = cfg.run_name or run_name
        self.run_id: str | None = None
        self._client: Any = None
        self._metric: Any = None  # mlflow.entities.Metric, imported with MLflow by start()

    def start(self, run_id: str | None, config: dict[str, Any]) -> str:
        import_extra(self.name)  # a clear message without the extra
        if is_local_store(self.uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        try:
            self._client = MlflowClient(self.uri)
            run = self._continue(run_id) if run_id else None
            if run is None:
                run = self._client.create_run(self._experiment_id(), run_name=self.run_name)
                logger.info("MLflow run %s in %s", run.info.run_id, self.uri)
            self.run_id = run.info.run_id
            self._log_params(run.data.params, flatten(config))
        except (MlflowException, OSError) as exc:  # a server that refuses, a folder not writable
            raise ConfigError(f"logging.mlflow (tracking_uri {self.uri}): {exc}") from exc
        return self.run_id

    def _continue(self, run_id: str) -> Any:
        """The checkpoint's run, set running again; None when this store does not have it (another
        ``tracking_uri``, or a run directory whose store was deleted)."""
        from mlflow.exceptions import MlflowException

        try:
            run = self._client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
            run = None
        if run is None or run.info.lifecycle_stage == "deleted":
            logger.warning(
                "MLflow run %s (kept in the checkpoint) is not in %s: starting a new run",
                run_id,
                self.uri,
            )
            return None
        self._client.update_run(run_id, status="RUNNING")
        logger.info("continuing MLflow run %s in %s", run_id, self.uri)
        return run

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        experiment = self._client.get_experiment_by_name(self.experiment)
        if experiment is None:
            try:
                return str(self._client.create_experiment(self.experiment))
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                # Another run created it in the meantime.
                experiment = self._client.get_experiment_by_name(self.experiment)
        if experiment.lifecycle_stage == "deleted":
            raise ConfigError(
                f"logging.mlflow.experiment={self.experiment!r} is deleted in {self.uri}: "
                "restore it (mlflow experiments restore) or name another one"
            )
        return str(experiment.experiment_id)

    def _log_params(self, logged: Mapping[str, str], params: dict[str, str]) -> None:
        """Log the params the run lacks. MLflow never changes a logged param, so a resumed run
        whose config differs (a longer ``loop.max_steps``) keeps the first values, and says so."""
        from mlflow.entities import Param

        params = {key: value[: self.MAX_PARAM_LENGTH] for key, value in params.items()}
        changed = sorted(key for key, value in params.items() if logged.get(key, value) != value)
        if changed:
            logger.warning(
                "MLflow run %s keeps its first params; not updated: %s",
                self.run_id,
                ", ".join(changed),
            )
        new = [Param(key, value) for key, value in params.items() if key not in logged]
        if new:
            self._client.log_batch(self.run_id, params=new)  # chunked by the client

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        assert self.run_id is not None, "MLflowTracker.write before start"
        now = int(time.time() * 1000)
        batch = [
            self._metric(self._NOT_IN_NAME.sub("_", key), float(value), now, step)
            for key, value in metrics.items()
        ]
        self._client.log_batch(self.run_id, metrics=batch)

    def close(self, status: str) -> None:
        if self.run_id is not None:
            run_id, self.run_id = self.run_id, None
            self._client.set_terminated(run_id, status=status)


class WandbTracker(Tracker):
    """A Weights & Biases run: scalars logged at their step, the resolved config as the run's
    config, the id chosen here (so the checkpoint can keep it) and resumed with ``resume="allow"``.
    ``mode`` null: online when ``WANDB_API_KEY`` is set, else offline (files under
    ``<run dir>/wandb``, uploaded later with ``wandb sync``)."""

    name = "wandb"
    resumable = True

    def __init__(self, cfg: WandbConfig, *, directory: Path, run_name: str) -> None:
        self.cfg = cfg
        self.directory = directory
        self.run_name = run_name
        self._run: Any = None

    def start(self, run_id: str | None, config: dict[str, Any]) -> str:
        wandb = import_extra(self.name)
        mode = self.cfg.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self._run = wandb.init(
            project=self.cfg.project,
            entity=self.cfg.entity,
            name=self.run_name,
            dir=str(self.directory),
            id=run_id or wandb.util.generate_id(),
            resume="allow",  # continue the run with this id if there is one, else create it
            mode=mode,
            config=config,
            allow_val_change=True,  # a resumed run may change settings (a longer max_steps)
        )
        return str(self._run.id)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        assert self._run is not None, "WandbTracker.write before start"
        self._run.log(dict(metrics), step=step)

    def close(self, status: str) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish(exit_code=0 if status == FINISHED else 1)
