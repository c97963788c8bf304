"""The run's figures at a log point: each rank's readings gathered in one collective and reduced
by name, and the fixed facts (``RunFigures``) that turn them into throughput and MFU.

What a log point writes does not grow with the world size: a per-rank reading becomes its sum or
maximum over the ranks plus its spread (``rank_spread``: min, median, max and the slowest rank's
index), never one key per rank. The full per-rank table is written only on request
(``logging.per_rank_metrics``); each rank's own readings still reach its own sinks (the Prometheus
exporter's per-rank gauges) through ``MetricsWriter.write(..., this_rank=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sdnet_trainer.distributed import all_gather_floats
from sdnet_trainer.observability.flops import mfu


@dataclass(frozen=True)
class RunFigures:
    """Fixed facts of a run that turn the loop's measurements into metrics: the schedule's length,
    the epoch's size, whether this rank's loss counts (``metric_weight`` 1: last pipeline stage,
    first tensor-parallel peer; else 0), and what turns samples/s into tokens/s, model TFLOPs/s
    and MFU (None: not known)."""

    total_steps: int
    samples_per_epoch: int
    metric_weight: float
    world_size: int
    tokens_per_sample: int | None = None
    flops_per_sample: float | None = None
    peak_tflops: float | None = None  # per device

    def throughput(self, samples_per_s: float) -> dict[str, float]:
        out = {}
        if self.tokens_per_sample:
            out["perf/tokens_per_s"] = samples_per_s * self.tokens_per_sample
        if self.flops_per_sample:
            flops_per_s = samples_per_s * self.flops_per_sample
            out["perf/tflops_per_s"] = flops_per_s / 1e12
            if self.peak_tflops:
                out["perf/mfu"] = mfu(flops_per_s, self.peak_tflops, self.world_size)
        return out


def gather_named(values: dict[str, float], *, device: torch.device) -> dict[str, torch.Tensor]:
    """Every rank's ``values`` in one all-gather: name -> the column of the ranks' values (on the
    host, row r from rank r). Every rank passes the same names in the same order."""
    names = list(values)
    table = all_gather_floats([values[name] for name in names], device=device)
    return dict(zip(names, table.unbind(dim=1), strict=True))


def rank_spread(key: str, column: torch.Tensor) -> dict[str, float]:
    """``key``'s spread over the ranks: ``{key}_min``, ``{key}_median``, ``{key}_max``."""
    return {
        f"{key}_min": column.min().item(),
        f"{key}_median": column.median().item(),
        f"{key}_max": column.max().item(),
    }


def per_rank(key: str, column: torch.Tensor) -> dict[str, float]:
    """The full table: ``{key}_rank{R}`` for every rank R (``logging.per_rank_metrics``)."""
    return {f"{key}_rank{rank}": value for rank, value in enumerate(column.tolist())}


__all__ = ["RunFigures", "gather_named", "per_rank", "rank_spread"]
