"""The experiment trackers behind MetricsWriter: each one read back with its own reader (csv,
TensorBoard's event reader, MLflow's client) against metrics.jsonl; the MLflow run continued
through the writer's checkpoint state; the validation of logging.trackers."""

from __future__ import annotations

import csv
import importlib.util
import logging
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sdnet_trainer.checkpoint.parts import Part
from sdnet_trainer.config.observability import LoggingConfig, MLflowConfig
from sdnet_trainer.config.schema import CheckpointConfig, Config
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.observability.trackers import CSV_FILE, MLFLOW_DIR, flatten
from sdnet_trainer.observability.writers import (
    METRICS_FILE,
    TENSORBOARD_DIR,
    MetricsWriter,
    validate_trackers,
)
from sdnet_trainer.training.checkpointer import Checkpointer
from sdnet_trainer.training.state import RunState
from tests.support import read_jsonl

CONFIG = {
    "model": {"name": "simple_cnn", "_target_": None},
    "optim": {"lr": 0.05, "betas": [0.9, 0.99]},
    "loop": {"max_steps": 4},
}
# Two log points and an evaluation with keys of their own, then a summary, as a run writes them.
WRITES = [
    (2, {"train/loss": 2.302585092994046, "train/lr": 0.05, "perf/samples_per_s": 1234.5}),
    (4, {"train/loss": 1.0 / 3.0, "train/lr": 0.05, "perf/samples_per_s": 987.25}),
    (4, {"val/loss": 0.1 + 0.2, "val/top1": 41.5}),
    (4, {"summary/steps": 4.0, "summary/samples_per_s": 1111.0}),
]


@pytest.fixture(autouse=True)
def mlflow_env(monkeypatch):
    """No MLflow telemetry from the tests; the file-store opt-in as the test found it."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "unset")  # restored at teardown
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")


def _writer(directory: Path, trackers: list[str], config: dict = CONFIG, **logging_args: Any):
    # The store in the run directory here (a composed config puts it under run.root).
    logging_args.setdefault("mlflow", MLflowConfig(tracking_uri=str(directory / MLFLOW_DIR)))
    cfg = LoggingConfig(trackers=trackers, **logging_args)
    return MetricsWriter(directory, cfg, enabled=True, run_name="unit", config=config)


def _write_all(writer: MetricsWriter, writes=WRITES) -> None:
    for step, metrics in writes:
        writer.write(step, metrics)


def _client(directory: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient((directory / MLFLOW_DIR).resolve().as_uri())


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def _reference(path: Path) -> list[tuple[int, str, float]]:
    """Every (step, key, value) of metrics.jsonl, in order."""
    return [(row["step"], k, v) for row in read_jsonl(path) for k, v in row.items() if k != "step"]


# ---------------------------------------------------------------------- files


def test_csv_holds_every_scalar_of_the_jsonl_exactly_and_appends_on_reopen(tmp_path):
    writer = _writer(tmp_path, ["jsonl", "csv"])
    _write_all(writer, WRITES[:2])
    writer.close()
    # A resumed run in the same directory: new keys appear, the header is not repeated.
    writer = _writer(tmp_path, ["jsonl", "csv"])
    _write_all(writer, WRITES[2:])
    writer.close()

    lines = (tmp_path / CSV_FILE).read_text().splitlines()
    assert lines[0] == "step,key,value" and lines.count("step,key,value") == 1
    rows = [(int(r["step"]), r["key"], float(r["value"])) for r in _csv_rows(tmp_path / CSV_FILE)]
    reference = _reference(tmp_path / METRICS_FILE)
    assert len(reference) == sum(len(m) for _, m in WRITES)
    assert rows == reference  # bit-exact floats: 1/3 and 0.1 + 0.2 survive the text round trip


def test_csv_writes_nan_that_reads_back_as_nan(tmp_path):
    writer = _writer(tmp_path, ["csv"])
    writer.write(1, {"train/loss": math.nan})
    writer.close()
    (row,) = _csv_rows(tmp_path / CSV_FILE)
    assert math.isnan(float(row["value"]))


def test_a_writer_that_is_not_enabled_writes_nothing_but_feeds_its_sinks(tmp_path):
    class Sink:
        def __init__(self) -> None:
            self.writes: list[tuple[int, dict]] = []
            self.closed = False

        def write(self, step: int, metrics: dict[str, float]) -> None:
            self.writes.append((step, metrics))

        def close(self) -> None:
            self.closed = True

    sink = Sink()
    cfg = LoggingConfig(trackers=["tensorboard", "jsonl", "csv", "mlflow"])
    writer = MetricsWriter(
        tmp_path / "run", cfg, enabled=False, run_name="r", config=CONFIG, sinks=[sink]
    )
    writer.start()  # one process, no process group: nothing to share
    _write_all(writer)
    writer.close()
    assert not (tmp_path / "run").exists()
    assert sink.writes == WRITES and sink.closed


# ---------------------------------------------------------------------- MLflow


def test_every_tracker_holds_the_same_scalars_and_mlflow_the_config(tmp_path):
    writer = _writer(tmp_path, ["tensorboard", "jsonl", "csv", "mlflow"])
    writer.start()
    _write_all(writer)
    run_id = writer.state_dict()["mlflow"]
    writer.close()

    reference = _reference(tmp_path / METRICS_FILE)
    csv_rows = [
        (int(r["step"]), r["key"], float(r["value"])) for r in _csv_rows(tmp_path / CSV_FILE)
    ]
    assert csv_rows == reference

    # MLflow, read back with its own client from the run directory's store.
    client = _client(tmp_path)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "unit"
    assert client.get_experiment(run.info.experiment_id).name == "sdnet_trainer"
    keys = {key for _, key, _ in reference}
    assert set(run.data.metrics) == keys  # '/' kept in the names
    for key in keys:
        expected = [(step, value) for step, k, value in reference if k == key]
        assert _history(client, run_id, key) == expected
    assert run.data.params == flatten(CONFIG)
    assert run.data.params["optim.betas"] == "[0.9, 0.99]"

    # TensorBoard keeps float32 values.
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    events.Reload()
    for step, key, value in reference:
        (event,) = [e for e in events.Scalars(key) if e.step == step]
        assert event.value == pytest.approx(value, rel=1e-6)


def test_a_restored_writer_continues_the_same_mlflow_run(tmp_path, caplog):
    first = _writer(tmp_path, ["mlflow"])
    first.start()
    _write_all(first, WRITES[:1])
    state = first.state_dict()
    try:
        raise SystemExit(143)  # a stop signal's exit, after its checkpoint
    except SystemExit:
        first.close()
    client = _client(tmp_path)
    assert client.get_run(state["mlflow"]).info.status == "KILLED"

    # The resumed run trains longer: its config differs in one value.
    longer = {**CONFIG, "loop": {"max_steps": 8}}
    second = _writer(tmp_path, ["mlflow"], config=longer)
    second.load_state_dict(state)
    with caplog.at_level(logging.WARNING):
        second.start()
    assert second.state_dict() == state
    _write_all(second, WRITES[1:2])
    second.close()

    run = client.get_run(state["mlflow"])
    assert run.info.status == "FINISHED"
    assert _history(client, state["mlflow"], "train/loss") == [
        (2, WRITES[0][1]["train/loss"]),
        (4, WRITES[1][1]["train/loss"]),
    ]
    assert run.data.params["loop.max_steps"] == "4"  # MLflow keeps the first value ...
    assert "not updated: loop.max_steps" in caplog.text  # ... and the run says so
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_a_run_id_this_store_lacks_starts_a_new_run(tmp_path, caplog):
    writer = _writer(tmp_path, ["mlflow"])
    writer.load_state_dict({"mlflow": "0123456789abcdef0123456789abcdef", "wandb": ""})
    with caplog.at_level(logging.WARNING):
        writer.start()
    run_id = writer.state_dict()["mlflow"]
    writer.close()
    assert run_id != "0123456789abcdef0123456789abcdef"
    assert "is not in" in caplog.text and "starting a new run" in caplog.text
    assert _client(tmp_path).get_run(run_id).info.status == "FINISHED"


def test_an_exception_ends_the_mlflow_run_as_failed(tmp_path):
    named = MLflowConfig(tracking_uri=str(tmp_path / MLFLOW_DIR), run_name="named", experiment="e")
    writer = _writer(tmp_path, ["mlflow"], mlflow=named)
    writer.start()
    run_id = writer.state_dict()["mlflow"]
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("the step failed")
        finally:
            writer.close()
    run = _client(tmp_path).get_run(run_id)
    assert (run.info.status, run.info.run_name) == ("FAILED", "named")


def test_metric_names_mlflow_refuses_are_mapped_not_fatal(tmp_path):
    writer = _writer(tmp_path, ["mlflow"])
    writer.start()
    writer.write(1, {"val/acc@1": 0.5})
    run_id = writer.state_dict()["mlflow"]
    writer.close()
    assert _client(tmp_path).get_run(run_id).data.metrics == {"val/acc_1": 0.5}


def test_the_run_ids_survive_a_checkpoint_and_older_checkpoints_load(tmp_path):
    def checkpointer(writer: MetricsWriter, state: RunState, resume: str) -> Checkpointer:
        return Checkpointer(
            CheckpointConfig(resume=resume),
            directory=tmp_path / "checkpoints",
            parts={"trainer": Part(state), "trackers": Part(writer, optional=True)},
            rank=0,
            world_size=1,
            meta={},
            run_id="trackers-test",
        )

    saved = _writer(tmp_path / "a", [])
    ids = {"mlflow": "d2a3f0c9a1b84e5f9c0d1e2f3a4b5c6d", "wandb": "x7k2m9p1"}
    saved.load_state_dict(ids)
    state = RunState(step=3)
    ckpt = checkpointer(saved, state, "none")
    ckpt.save(state)
    ckpt.close()

    restored = _writer(tmp_path / "b", [])
    ckpt = checkpointer(restored, RunState(), "auto")
    assert ckpt.resume(RunState()) is not None
    ckpt.close()
    assert restored.state_dict() == ids  # strings in a replicated part, through the safe reader

    # A checkpoint that kept only an MLflow id (a tracker added since) still resumes.
    class MLflowOnly:
        def state_dict(self) -> dict[str, str]:
            return {"mlflow": ids["mlflow"]}

        def load_state_dict(self, state: dict[str, str]) -> None:
            raise AssertionError("only saved")

    older = tmp_path / "older"
    ckpt = Checkpointer(
        CheckpointConfig(resume="none"),
        directory=older,
        parts={"trackers": Part(MLflowOnly())},
        rank=0,
        world_size=1,
        meta={},
        run_id="trackers-test",
    )
    ckpt.save(RunState(step=1))
    ckpt.close()
    restored = _writer(tmp_path / "c", [])
    ckpt = Checkpointer(
        CheckpointConfig(resume="auto"),
        directory=older,
        parts={"trackers": Part(restored, optional=True)},
        rank=0,
        world_size=1,
        meta={},
        run_id="trackers-test",
    )
    assert ckpt.resume(RunState()) is not None
    ckpt.close()
    assert restored.state_dict() == {"mlflow": ids["mlflow"], "wandb": ""}


def test_a_checkpoint_id_that_is_not_a_run_id_is_ignored(tmp_path, caplog):
    writer = _writer(tmp_path, [])
    with caplog.at_level(logging.WARNING):
        writer.load_state_dict({"mlflow": "../../elsewhere", "wandb": 7})
    assert writer.state_dict() == {"mlflow": "", "wandb": ""}
    assert "'../../elsewhere' is not a run id" in caplog.text


# ---------------------------------------------------------------------- W&B


class _FakeRun:
    def __init__(self, calls: list, **kwargs: Any) -> None:
        self.calls, self.id = calls, kwargs["id"]

    def log(self, data: dict, step: int) -> None:
        self.calls.append(("log", step, data))

    def finish(self, exit_code: int) -> None:
        self.calls.append(("finish", exit_code))


def _stand_in(monkeypatch, name: str) -> types.ModuleType:
    """An importable module ``name`` (found by importlib too) for the length of the test."""
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    monkeypatch.setitem(sys.modules, name, module)
    return module


@pytest.fixture
def fake_wandb(monkeypatch):
    """wandb is an optional extra: a stand-in module records what the tracker asks of it."""
    calls: list = []
    module = _stand_in(monkeypatch, "wandb")

    def init(**kwargs: Any) -> _FakeRun:
        calls.append(("init", kwargs))
        return _FakeRun(calls, **kwargs)

    module.init = init
    module.util = types.SimpleNamespace(generate_id=lambda: "gen1d")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return calls


def test_wandb_runs_offline_without_a_key_and_resumes_by_id(tmp_path, fake_wandb):
    writer = _writer(tmp_path, ["wandb"])
    writer.start()
    writer.write(2, {"train/loss": 0.5})
    state = writer.state_dict()
    writer.close()
    (_, init), log, finish = fake_wandb
    assert init["id"] == "gen1d" and state == {"mlflow": "", "wandb": "gen1d"}
    assert (init["mode"], init["resume"], init["name"]) == ("offline", "allow", "unit")
    assert (init["project"], init["dir"], init["config"]) == (
        "sdnet_trainer",
        str(tmp_path),
        CONFIG,
    )
    assert log == ("log", 2, {"train/loss": 0.5}) and finish == ("finish", 0)

    fake_wandb.clear()
    resumed = _writer(tmp_path, ["wandb"])
    resumed.load_state_dict(state)
    resumed.start()
    resumed.close()
    assert fake_wandb[0][1]["id"] == "gen1d"


def test_wandb_goes_online_with_a_key(tmp_path, fake_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "k")
    writer = _writer(tmp_path, ["wandb"])
    writer.start()
    writer.close()
    assert fake_wandb[0][1]["mode"] == "online"


# ---------------------------------------------------------------------- validation


def _config(**logging_args: Any) -> Config:
    cfg = Config()
    for key, value in logging_args.items():
        setattr(cfg.logging, key, value)
    return cfg


def test_validation_accepts_every_tracker_once(monkeypatch):
    _stand_in(monkeypatch, "wandb")  # as if installed
    validate_trackers(_config(trackers=["tensorboard", "jsonl", "csv", "mlflow", "wandb"]))
    validate_trackers(_config(trackers=[]))


@pytest.mark.parametrize(
    ("trackers", "message"),
    [
        (
            ["jsonl", "mlfow"],
            r"logging.trackers='mlfow' is not one of .* \(did you mean 'mlflow'\?\)",
        ),
        (["csv", "jsonl", "csv"], "logging.trackers lists csv more than once"),
    ],
)
def test_validation_names_the_bad_tracker(trackers, message):
    with pytest.raises(ConfigError, match=message):
        validate_trackers(_config(trackers=trackers))


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_missing_extra_names_its_pip_install(tmp_path, monkeypatch, tracker):
    monkeypatch.setitem(sys.modules, tracker, None)  # import fails, as when not installed
    expected = rf"pip install 'sdnet_trainer\[{tracker}\]'"
    with pytest.raises(ConfigError, match=expected):
        validate_trackers(_config(trackers=["jsonl", tracker]))
    writer = _writer(tmp_path, ["jsonl", tracker])  # and when the run starts, without validation
    with pytest.raises(ConfigError, match=expected):
        writer.start()
    writer.close()


def test_validation_checks_the_wandb_mode_and_the_mlflow_store(monkeypatch):
    _stand_in(monkeypatch, "wandb")
    cfg = _config(trackers=["wandb"])
    cfg.logging.wandb.mode = "ofline"
    with pytest.raises(ConfigError, match="logging.wandb.mode='ofline'.*did you mean 'offline'"):
        validate_trackers(cfg)
    cfg = _config(trackers=["mlflow"])
    cfg.logging.mlflow.tracking_uri = "sqlite:///mlflow.db"
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    with pytest.raises(ConfigError, match="tracking_uri='sqlite:///mlflow.db' is a database"):
        validate_trackers(cfg)


def test_a_failing_tracker_is_reported_once_and_training_goes_on(tmp_path, caplog):
    """A tracking server that is down must not end the run: the other trackers keep every
    scalar, the failure is logged once per outage."""
    writer = _writer(tmp_path, ["jsonl", "csv"])
    broken = writer._trackers[1]
    failures = iter([OSError("server down"), OSError("still down"), None])

    def flaky(step, metrics, original=broken.write):
        failure = next(failures)
        if failure is not None:
            raise failure
        original(step, metrics)

    broken.write = flaky
    with caplog.at_level(logging.ERROR):
        for step in (1, 2, 3):
            writer.write(step, {"train/loss": float(step)})
    writer.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    failed = [r.getMessage() for r in caplog.records if "training goes on" in r.getMessage()]
    assert failed == ["logging to csv failed at step 1, training goes on: server down"]
    with open(tmp_path / CSV_FILE, newline="") as file:
        assert [row["step"] for row in csv.DictReader(file)] == ["3"]
