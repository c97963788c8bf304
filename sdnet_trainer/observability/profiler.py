"""torch.profiler over a window of training steps, from ``profile.*``.

Profiling every step would slow the run and write gigabytes, so the profiler follows torch's
step schedule: skip ``wait`` steps (start-up noise), run ``warmup`` steps profiled but discarded
(the profiler's own start-up cost), record ``active`` steps, ``repeat`` times. On CUDA the first
steps autotune cuDNN's convolutions (``cudnn.benchmark``), compile, and build cuBLAS handles and
NCCL communicators: at least ``CUDA_STEPS_BEFORE_ACTIVE`` steps run before the first recorded
one, untraced where ``wait`` and ``warmup`` are shorter. Each rank writes its own
Chrome/TensorBoard trace (stragglers show up as one rank's slower trace); rank 0 alone builds and
logs a table of the operators that took the most time. On CUDA, ``memory_snapshot`` also records the
allocator's history over the first active window, for https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from sdnet_trainer.config.schema import ProfileConfig

logger = logging.getLogger(__name__)

# Allocation events kept by the CUDA memory history (a ring buffer): enough for a few steps of a
# large model, about 100 MB of host memory at most.
MEMORY_HISTORY_ENTRIES = 100_000

# CUDA: steps before the first recorded one. Step 1 autotunes cuDNN for every convolution shape,
# compiles, and allocates the optimizer state; step 2 is the first steady one, the profiler's
# warm-up by default.
CUDA_STEPS_BEFORE_ACTIVE = 2


def untraced_steps(cfg: ProfileConfig, device_type: str) -> int:
    """Steps skipped before the schedule's ``wait`` (torch's ``skip_first``): on CUDA what
    ``wait + warmup`` lacks of ``CUDA_STEPS_BEFORE_ACTIVE``; none on the CPU."""
    if device_type != "cuda":
        return 0
    return max(0, CUDA_STEPS_BEFORE_ACTIVE - cfg.wait - cfg.warmup)


class StepProfiler:
    """Context manager around the training loop; call ``step()`` once per optimizer step.

    A no-op when ``cfg.enabled`` is False. Traces go to ``output_dir/profile`` (one file per rank
    and active window, ``rank{R}.<time>.pt.trace.json``; open them in TensorBoard's profiler
    plugin or https://ui.perfetto.dev).
    """

    def __init__(
        self, cfg: ProfileConfig, *, output_dir: Path, rank: int, device: torch.device
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.device = device
        self.trace_dir = Path(output_dir) / "profile"
        self._profiler: profile | None = None
        self._steps = 0
        self._recording_memory = False
        self._table: str | None = None
        self._skip_first = untraced_steps(cfg, device.type)

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    def __enter__(self) -> StepProfiler:
        if not self.enabled:
            return self
        cfg = self.cfg
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(
            activities=activities,
            schedule=schedule(
                wait=cfg.wait,
                warmup=cfg.warmup,
                active=cfg.active,
                repeat=cfg.repeat,
                skip_first=self._skip_first,
            ),
            on_trace_ready=tensorboard_trace_handler(
                str(self.trace_dir), worker_name=f"rank{self.rank}"
            ),
            record_shapes=cfg.record_shapes,
            profile_memory=cfg.profile_memory,
            with_stack=cfg.with_stack,
        )
        self._profiler.__enter__()
        if cfg.memory_snapshot and self.device.type != "cuda":
            logger.info(
                "profile.memory_snapshot skipped: the CUDA allocator's history needs a CUDA device "
                "(this run is on %s)",
                self.device,
            )
        self._maybe_record_memory()
        before = self._skip_first + cfg.wait + cfg.warmup
        logger.info(
            "profiling steps %d-%d%s; traces in %s%s",
            before + 1,
            before + cfg.active,
            f" (x{cfg.repeat})" if cfg.repeat != 1 else "",
            self.trace_dir,
            f" (the first {self._skip_first} step(s) untraced: cuDNN autotuning and start-up)"
            if self._skip_first
            else "",
        )
        return self

    def step(self) -> None:
        """Mark the end of one optimizer step (advances the profiler's schedule)."""
        if self._profiler is None:
            return
        self._profiler.step()
        self._steps += 1
        self._maybe_record_memory()

    def __exit__(self, *exc) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        # Stopping inside an active window still writes that window's trace.
        profiler.__exit__(*exc)
        self._stop_memory_history()
        # Aggregating the events costs seconds for a large trace; only rank 0 logs the table.
        self._table = self._make_table(profiler) if self.rank == 0 else None
        if self._table is not None:
            logger.info(
                "top %d operators by self %s time (rank 0, last active window):\n%s",
                self.cfg.top_k,
                "CUDA" if self.device.type == "cuda" else "CPU",
                self._table,
            )

    def summary_table(self) -> str | None:
        """The operator table of the last recorded window (rank 0); None on other ranks, when
        disabled, or when nothing was recorded (the run ended before an active step)."""
        return self._table

    def _make_table(self, profiler: profile) -> str | None:
        try:
            averages = profiler.key_averages()
        except (AssertionError, RuntimeError):  # no window was recorded
            return None
        if len(averages) == 0:
            return None
        cuda = self.device.type == "cuda"
        # torch >= 2.4 names device time "device"; "cuda" remains as an alias in the tables.
        sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
        return averages.table(sort_by=sort_by, row_limit=self.cfg.top_k)

    # ------------------------------------------------------------------ CUDA memory history

    def _maybe_record_memory(self) -> None:
        """Record the allocator's history over the first active window: start when it begins,
        dump and stop when it ends."""
        cfg = self.cfg
        if not (cfg.memory_snapshot and self.device.type == "cuda"):
            return
        first_active = self._skip_first + cfg.wait + cfg.warmup
        if self._steps == first_active and not self._recording_memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self._recording_memory = True
        elif self._steps >= first_active + cfg.active:
            self._stop_memory_history()

    def _stop_memory_history(self) -> None:
        if not self._recording_memory:
            return
        self._recording_memory = False
        path = self.trace_dir / f"memory_rank{self.rank}.pickle"
        try:
            torch.cuda.memory._dump_snapshot(str(path))
            logger.info(
                "CUDA memory snapshot of rank %d: %s (drag it onto https://pytorch.org/memory_viz)",
                self.rank,
                path,
            )
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)


__all__ = ["StepProfiler"]
