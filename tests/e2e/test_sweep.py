"""A Hydra multirun whose trials are full torchrun jobs (hydra/launcher=torchrun)."""

from __future__ import annotations

import csv
import json

import pytest

from tests.support import TINY, last_metric, read_jsonl, run_cli

# The sweep sets optim.lr itself. No checkpoint at the end: the summary reads the metrics.
SMALL = [o for o in TINY if not o.startswith("optim.lr=")] + [
    "loop.max_steps=4",
    "checkpoint.save_on_exit=false",
]


def test_two_trial_sweep_runs_each_trial_under_torchrun_and_summarises(tmp_path):
    sweep_dir = tmp_path / "sweep"
    launch = run_cli(
        [
            "-m",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            f"hydra.sweep.dir={sweep_dir}",
            *SMALL,
            "optim.lr=0.02,0.05",
        ],
        cwd=tmp_path,
        timeout=240,
    )
    assert launch.returncode == 0, launch.output

    with open(sweep_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["trial"], r["optim.lr"], r["status"]) for r in rows] == [
        ("0", "0.02", "ok"),
        ("1", "0.05", "ok"),
    ]
    for row in rows:
        trial_dir = sweep_dir / row["trial"]
        assert (
            "world size 2" in (trial_dir / "train.log").read_text()
        )  # a distributed run, not in-process
        trial = json.loads((trial_dir / "trial.json").read_text())
        assert trial["returncode"] == 0 and f"optim.lr={row['optim.lr']}" in trial["overrides"]
        metrics = read_jsonl(trial_dir / "metrics.jsonl")
        assert last_metric(metrics, "train/lr") == pytest.approx(float(row["optim.lr"]))
        for key in ("train/loss", "val/loss", "val/top1", "val/top5"):
            assert float(row[key]) == pytest.approx(last_metric(metrics, key), rel=1e-12)
    assert rows[0]["val/loss"] != rows[1]["val/loss"]  # two different trainings

    table = (sweep_dir / "summary.md").read_text()
    assert table.startswith(
        "| trial | optim.lr | status | train/loss | val/loss | val/top1 | val/top5 |"
    )
    assert table.strip() in launch.output  # printed at the end
    assert (sweep_dir / "multirun.yaml").exists() and not (tmp_path / "outputs").exists()
