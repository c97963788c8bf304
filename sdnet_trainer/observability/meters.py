"""Step timing (wall time, data wait) and peak memory."""

from __future__ import annotations

import resource
import sys

import torch


class StepMeter:
    """Training time and samples of this rank, per log window and for the whole run.

    Only time inside training steps counts (batch fetching included), so evaluation, logging and
    checkpointing between steps do not dilute the throughput figures.
    """

    def __init__(self) -> None:
        self.total_seconds = 0.0
        # Samples per rank: a fraction where ranks share samples (tensor and pipeline peers).
        self.total_samples: float = 0
        self.total_steps = 0
        self._reset_window()

    def _reset_window(self) -> None:
        self._seconds = 0.0
        self._data_wait = 0.0
        self._compute = 0.0
        self._optimizer = 0.0
        self._steps = 0
        self._samples: float = 0

    def step_done(
        self,
        *,
        samples: float,
        seconds: float,
        data_wait: float = 0.0,
        compute: float = 0.0,
        optimizer: float = 0.0,
    ) -> None:
        """One step: its samples, wall time, and the host time spent waiting for data, in forward
        and backward, and in the optimizer part (agreement, clipping, optimizer and schedule). On
        CUDA the step's one host synchronisation (the agreement all-reduce) falls in the optimizer
        part, so queued GPU work lands there."""
        self._steps += 1
        self._samples += samples
        self._seconds += seconds
        self._data_wait += data_wait
        self._compute += compute
        self._optimizer += optimizer
        self.total_steps += 1
        self.total_samples += samples
        self.total_seconds += seconds

    def flush(self) -> dict[str, float]:
        """Mean step time, mean data wait per step and samples/s of the window; starts a new one."""
        steps = max(self._steps, 1)
        out = {
            "step_s": self._seconds / steps,
            "data_wait_s": self._data_wait / steps,
            "fwd_bwd_s": self._compute / steps,
            "optimizer_s": self._optimizer / steps,
            "samples_per_s": self._samples / self._seconds if self._seconds > 0 else 0.0,
        }
        self._reset_window()
        return out


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated CUDA memory, or this process's peak resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in kilobytes on Linux, bytes on macOS.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
