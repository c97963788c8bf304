"""Sweeps whose trials are full distributed runs, and the table that compares them.

``python -m sdnet_trainer -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=N
optim.lr=0.1,0.3`` runs each trial as its own ``torchrun --standalone`` job, one after another
(the launcher lives in hydra_plugins/sdnet_trainer_plugins/, because Hydra loads launchers only
from that namespace).
A trial's processes each compose their own config, so the launcher hands them the trial's
directory explicitly; what comes back is read from the files the trial left there:

    <sweep dir>/<trial>/trial.json      the trial's number, overrides, command and exit code
    <sweep dir>/<trial>/metrics.jsonl   the Trainer's metrics (rank 0)
    <sweep dir>/summary.csv, summary.md one row per trial: the overrides that vary, final metrics

``python -m sdnet_trainer.sweep SWEEP_DIR`` rewrites and prints the summary of any sweep directory,
also one run with Hydra's in-process launcher (overrides then come from each trial's .hydra/).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sdnet_trainer.lazy import freeze_imports

TRIAL_FILE = "trial.json"
METRICS_FILE = "metrics.jsonl"  # written by sdnet_trainer.observability.writers.MetricsWriter
SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"


def final_metrics(rows: Iterable[dict]) -> dict[str, float]:
    """The metrics ``Trainer.fit`` returns, rebuilt from ``metrics.jsonl`` rows: the last value
    of train/loss, of every val/ metric (the last evaluation) and of the summary/ figures."""
    final: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key == "train/loss" or key.startswith(("val/", "summary/")):
                final[key] = value
    return final


def read_final_metrics(run_dir: Path) -> dict[str, float]:
    """``final_metrics`` of a run directory; empty where the run wrote no metrics."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return {}
    return final_metrics(json.loads(line) for line in path.read_text().splitlines() if line.strip())


def torchrun_command(
    program: Sequence[str],
    overrides: Sequence[str],
    *,
    run_dir: Path,
    nproc_per_node: int | str,
    torchrun_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """``python -m torch.distributed.run --standalone ...`` for one trial.

    ``--standalone`` gives each trial its own rendezvous on a free port, so trials never meet.
    ``hydra.run.dir`` pins the directory: every worker composes the config on its own, and the
    launcher must know where the trial writes.
    """
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc_per_node}",
        *torchrun_args,
        *program,
        *overrides,
        f"hydra.run.dir={override_value(str(run_dir))}",
    ]


def override_value(value: str) -> str:
    """``value`` as a Hydra override value: quoted where Hydra's grammar would read it otherwise."""
    if re.fullmatch(r"[\w/.\-+:@~%]+", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def write_trial(
    run_dir: Path, *, num: int, overrides: Sequence[str], command: Sequence[str], returncode: int
) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "num": num,
        "overrides": list(overrides),
        "command": list(command),
        "returncode": returncode,
    }
    (run_dir / TRIAL_FILE).write_text(json.dumps(record, indent=2) + "\n")


@dataclass
class Trial:
    num: int
    run_dir: Path
    overrides: list[str]
    returncode: int | None  # None: not known (a trial of Hydra's in-process launcher)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.returncode not in (0, None):
            return f"failed (exit {self.returncode})"
        return "ok" if self.metrics else "no metrics"


def find_trials(sweep_dir: Path) -> list[Trial]:
    """The trials under ``sweep_dir``, in trial order: each folder with a trial.json, or with
    the .hydra/overrides.yaml Hydra writes for every job."""
    trials = []
    for run_dir in (p for p in Path(sweep_dir).iterdir() if p.is_dir()):
        record = run_dir / TRIAL_FILE
        hydra_overrides = run_dir / ".hydra" / "overrides.yaml"
        if record.is_file():
            data = json.loads(record.read_text())
            trial = Trial(data["num"], run_dir, list(data["overrides"]), data["returncode"])
        elif hydra_overrides.is_file():
            num = int(run_dir.name) if run_dir.name.isdigit() else -1
            trial = Trial(
                num, run_dir, list(yaml.safe_load(hydra_overrides.read_text()) or []), None
            )
        else:
            continue
        trial.metrics = read_final_metrics(run_dir)
        trials.append(trial)
    return sorted(trials, key=lambda t: (t.num, t.run_dir.name))


def summary_table(
    trials: Sequence[Trial], metrics: Sequence[str] | None = None
) -> tuple[list[str], list[list]]:
    """Header and rows: trial, each override key whose value differs between trials (all of them
    for a single trial), status, then ``metrics`` (default: train/loss and every val/ metric)."""
    keys = _varying_keys([t.overrides for t in trials])
    if metrics is None:
        found = {k for t in trials for k in t.metrics if k == "train/loss" or k.startswith("val/")}
        metrics = sorted(found, key=lambda k: (k != "train/loss", k))
    header = ["trial", *keys, "status", *metrics]
    rows = []
    for trial in trials:
        values = dict(_split_override(o) for o in trial.overrides)
        rows.append(
            [
                trial.num,
                *(values.get(k, "") for k in keys),
                trial.status,
                *(trial.metrics.get(m, "") for m in metrics),
            ]
        )
    return header, rows


def write_summary(sweep_dir: Path, metrics: Sequence[str] | None = None) -> str:
    """Write summary.csv and summary.md to ``sweep_dir``; returns the markdown table."""
    sweep_dir = Path(sweep_dir)
    header, rows = summary_table(find_trials(sweep_dir), metrics)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    (sweep_dir / SUMMARY_CSV).write_text(buffer.getvalue())
    table = _markdown(header, rows)
    (sweep_dir / SUMMARY_MD).write_text(table + "\n")
    return table


def _markdown(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    def cell(value) -> str:
        if isinstance(value, float) and math.isfinite(value):
            return f"{value:.6g}"
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _split_override(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key, value


def _varying_keys(overrides: Sequence[Sequence[str]]) -> list[str]:
    """Override keys in first-seen order, restricted to those whose value is not the same in every
    trial (a key missing from some trials counts as varying)."""
    parsed = [dict(_split_override(o) for o in trial) for trial in overrides]
    keys = list(dict.fromkeys(k for trial in parsed for k in trial))
    if len(parsed) < 2:
        return keys
    return [k for k in keys if len({trial.get(k) for trial in parsed}) > 1]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(
            "usage: python -m sdnet_trainer.sweep SWEEP_DIR   (a folder of trial folders)",
            file=sys.stderr,
        )
        return 2
    print(write_summary(Path(args[0])))
    return 0


if __name__ == "__main__":
    freeze_imports()  # a process of its own: see sdnet_trainer/lazy.py
    sys.exit(main())
