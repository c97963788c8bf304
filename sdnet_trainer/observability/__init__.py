"""Rank-aware logging, the metrics writer and its trackers (TensorBoard, JSONL, CSV, MLflow, W&B)
and sinks (the Prometheus exporter), progress bar and step meters."""

from sdnet_trainer.observability.logs import setup_logging
from sdnet_trainer.observability.meters import StepMeter, peak_memory_mb
from sdnet_trainer.observability.progress import ProgressBar
from sdnet_trainer.observability.writers import MetricsWriter

__all__ = ["MetricsWriter", "ProgressBar", "StepMeter", "peak_memory_mb", "setup_logging"]
