"""logging.trackers through the real CLI: metrics.jsonl, metrics.csv and MLflow hold the same
final loss, and a stop/resume appends to the same MLflow run (its id kept in the checkpoint)."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from sdnet_trainer.observability.trackers import CSV_FILE, MLFLOW_DIR
from sdnet_trainer.observability.writers import METRICS_FILE
from tests.support import TINY, read_jsonl, run_cli

# The tiny CNN, 8 steps an epoch at any world size (256 samples, global batch 32), every tracker
# that needs no network, logging every 2 steps.
COMMON = TINY + [
    "loop.global_batch_size=32",
    "logging.trackers=[jsonl,csv,mlflow]",
    "logging.mlflow.experiment=e2e",
]
ENV = {"MLFLOW_DISABLE_TELEMETRY": "true"}


def _final_losses(run_dir: Path) -> tuple[float, float]:
    """The last train/loss of metrics.jsonl and of metrics.csv."""
    jsonl = [row["train/loss"] for row in read_jsonl(run_dir / METRICS_FILE) if "train/loss" in row]
    with open(run_dir / CSV_FILE, newline="") as file:
        rows = [float(r["value"]) for r in csv.DictReader(file) if r["key"] == "train/loss"]
    return jsonl[-1], rows[-1]


def test_jsonl_csv_and_mlflow_agree_and_a_resume_continues_the_mlflow_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read the run's folder store here

    # Two launches, two run directories (as two jobs would have), one checkpoint directory; the
    # MLflow store is run.root's (outputs/, under the launch directory).
    shared = [*COMMON, f"checkpoint.dir={tmp_path / 'checkpoints'}"]
    run_dir = tmp_path / "outputs" / "first"
    first = run_cli(
        [*shared, "loop.max_steps=4", f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=2, env=ENV
    )
    assert first.returncode == 0, first.output

    client = MlflowClient((tmp_path / "outputs" / MLFLOW_DIR).resolve().as_uri())
    experiment = client.get_experiment_by_name("e2e")
    (run,) = client.search_runs([experiment.experiment_id])
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    assert run.data.params["loop.max_steps"] == "4"  # the resolved config, as params
    assert run.data.params["model.name"] == "simple_cnn"
    jsonl_loss, csv_loss = _final_losses(run_dir)
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")]
    assert [step for step, _ in history] == [2, 4]
    assert jsonl_loss == csv_loss == history[-1][1]
    assert "summary/samples_per_s" in run.data.metrics  # the final summary too

    # Resumed from its checkpoint (written by 2 ranks, read by 1) and trained on to step 8.
    run_dir = tmp_path / "outputs" / "second"
    second = run_cli(
        [*shared, "loop.max_steps=8", f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=ENV
    )
    assert second.returncode == 0, second.output
    assert "resumed from" in second.output and f"continuing MLflow run {run_id}" in second.output

    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")]
    assert [step for step, _ in history] == [2, 4, 6, 8]
    jsonl_loss, csv_loss = _final_losses(run_dir)
    assert jsonl_loss == csv_loss == history[-1][1]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_its_extra_stops_the_launch_with_the_install_command(tmp_path):
    launch = run_cli(
        [*TINY, "logging.trackers=[jsonl,wandb]", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
    )
    assert launch.returncode == 2, launch.output
    assert "pip install 'sdnet_trainer[wandb]'" in launch.output
    assert "Traceback" not in launch.output


def test_every_rank_holds_rank_0s_run_ids_and_its_failure(tmp_path):
    """The checkpoint part is replicated: after ``start`` every rank's state must be rank 0's
    (DCP saves one rank's copy of it, which one depends on the sizes of the other entries). Rank
    0 alone talks to MLflow; when it cannot, every rank stops with the reason."""
    launch = run_cli([str(tmp_path)], cwd=tmp_path, nproc=2, script=Path(__file__), env=ENV)
    assert launch.returncode == 0, launch.output
    states = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert states[0]["ids"] == states[1]["ids"]
    assert states[0]["ids"]["mlflow"] and states[0]["ids"]["wandb"] == ""
    assert "rank 0 could not start logging.trackers: logging.mlflow" in states[1]["error"]
    assert states[0]["error"].startswith("logging.mlflow (tracking_uri file:///dev/null/")


def _broadcast_worker(out: Path) -> None:
    """On 2 ranks (gloo): a writer per rank with MLflow on rank 0, then one whose store
    cannot be created; each rank records its ids and the second writer's error."""
    import torch.distributed as dist

    from sdnet_trainer.config.observability import LoggingConfig, MLflowConfig
    from sdnet_trainer.observability.writers import MetricsWriter

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"

    def writer(uri: str) -> MetricsWriter:
        cfg = LoggingConfig(trackers=["mlflow"], mlflow=MLflowConfig(tracking_uri=uri))
        directory = out / "run"
        return MetricsWriter(directory, cfg, enabled=rank == 0, run_name="ranks", config={})

    good = writer((out / "mlruns").as_uri())
    good.start()
    good.close()
    bad = writer("file:///dev/null/mlruns")  # under a file: no folder can be made there
    try:
        bad.start()
        error = ""
    except Exception as exc:
        error = str(exc)
    bad.close()
    (out / f"rank{rank}.json").write_text(json.dumps({"ids": good.state_dict(), "error": error}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _broadcast_worker(Path(sys.argv[1]))
