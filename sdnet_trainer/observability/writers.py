"""Scalar metrics to TensorBoard and to ``metrics.jsonl``, written by rank 0 only."""

from __future__ import annotations

import json
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsWriter:
    """``write(step, {"train/loss": 0.3, ...})`` on every rank; only an enabled writer (rank 0)
    touches the disk. One JSON object per line makes runs easy to compare and plot."""

    def __init__(
        self, output_dir: str | Path, *, enabled: bool, tensorboard: bool, jsonl: bool
    ) -> None:
        self._tb = None
        self._jsonl = None
        if not enabled:
            return
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(output_dir / TENSORBOARD_DIR))
        if jsonl:
            # Open for the whole run, one line per write; close() closes it.
            self._jsonl = open(output_dir / METRICS_FILE, "a", buffering=1)  # noqa: SIM115

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, global_step=step)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
