"""Step timing (step time and phases, on the GPU's timeline under CUDA) and memory per log
window."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

# The phases a training step is split into, in the order the loop passes their boundaries.
PHASES = ("data_wait", "fwd_bwd", "optimizer")
# Steps a PhaseClock keeps unread before it folds them into sums (a loop whose log points are
# far apart, or that never reads, must not grow a list of events without end).
_MAX_PENDING_STEPS = 1024

Stamp = TypeVar("Stamp")


class Timeline(Protocol[Stamp]):
    """Where a :class:`PhaseClock` takes its timestamps (stamps)."""

    # True where a stamp is reached when the device gets to it, possibly long after the host
    # took it: the device's seconds, not the host's, are then what the steps cost.
    asynchronous: bool

    def stamp(self) -> Stamp:
        """A timestamp here (on a device: reached once the work queued before it is done)."""
        ...

    def offsets(self, stamps: list[Stamp]) -> list[float]:
        """Seconds from the first stamp to each one, once all are reached (the host waits for
        them); the stamps are not used again."""
        ...


class HostTimeline:
    """Host wall time: CPU operations are done when they return."""

    asynchronous = False

    def stamp(self) -> float:
        return time.perf_counter()

    def offsets(self, stamps: list[float]) -> list[float]:
        return [stamp - stamps[0] for stamp in stamps]


class CudaTimeline:
    """The GPU's timeline: CUDA events recorded on the current stream."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._spare: list[torch.cuda.Event] = []  # events already read, reused

    def stamp(self) -> torch.cuda.Event:
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def offsets(self, stamps: list[torch.cuda.Event]) -> list[float]:
        # Waiting for the last one would do where all were recorded on one stream.
        for event in stamps:
            event.synchronize()
        self._spare.extend(stamps)
        return [stamps[0].elapsed_time(event) / 1e3 for event in stamps]  # milliseconds


def timeline_for(device: torch.device | None) -> Timeline[Any]:
    """CUDA events on a GPU, host wall time elsewhere."""
    if device is not None and device.type == "cuda":
        return CudaTimeline(device)
    return HostTimeline()


@dataclass(frozen=True)
class ClockWindow:
    """What a :class:`PhaseClock` measured between two reads."""

    steps: int  # steps started in the window
    # Their total time on the clock's timeline, each step from its start to its last boundary.
    seconds: float
    phases: dict[str, float]  # mean seconds per step of each phase marked in the window


class PhaseClock:
    """Where a step's time goes: data wait, forward/backward, optimizer.

    The loop calls :meth:`start` when a step begins and ``mark(name)`` at the end of each phase:
    the time since the previous boundary counts for ``name`` (a phase may recur, e.g. data wait
    and forward/backward once per micro-batch). :meth:`read_window` gives the window's steps,
    their total time (each step from its start to its last boundary) and the mean per step of
    each phase, and starts a new window; :meth:`read` only the phases.

    The boundaries are stamps on a :class:`Timeline` chosen from the device (or given, as tests
    do). On the CPU they are host times. On CUDA the host only queues work, so host times put
    everything the GPU has not finished into whichever phase happens to wait for it (the
    optimizer step's agreement). There each boundary records a CUDA event on the current stream
    instead, and a phase is the GPU-timeline interval between its events: forward/backward is
    the time the GPU spent on (or starved while the host launched) forward and backward, data
    wait the time it waited for the batch to be loaded and copied. Events are only read in
    :meth:`read_window`, one synchronisation per log window rather than per step (and once per
    1,024 steps where nothing reads them sooner, so the unread events stay bounded).
    """

    def __init__(
        self, device: torch.device | None = None, *, timeline: Timeline[Any] | None = None
    ) -> None:
        self.device = device
        self.timeline = timeline if timeline is not None else timeline_for(device)
        # One list per step in the window: (phase name or None for the start, stamp).
        self._steps: list[list[tuple[str | None, Any]]] = []
        self._folded: dict[str, float] = {}  # sums of steps read before the window's end
        self._folded_steps = 0
        self._folded_seconds = 0.0

    @property
    def cuda(self) -> bool:
        """Whether the boundaries are CUDA events."""
        return isinstance(self.timeline, CudaTimeline)

    def start(self) -> None:
        """A step begins."""
        if len(self._steps) >= _MAX_PENDING_STEPS:
            self._fold()
        self._steps.append([(None, self.timeline.stamp())])

    def mark(self, name: str) -> None:
        """Phase ``name`` ends here (it began at the previous boundary of this step)."""
        if not self._steps:
            raise RuntimeError("PhaseClock.mark before start(): call start() as a step begins")
        self._steps[-1].append((name, self.timeline.stamp()))

    @property
    def steps(self) -> int:
        """Steps started in the current window."""
        return self._folded_steps + len(self._steps)

    def read(self) -> dict[str, float]:
        """Mean seconds per step of each phase over the window (every name marked in it); starts
        a new window. On a device this waits for the window's last stamp."""
        return self.read_window().phases

    def read_window(self) -> ClockWindow:
        """The window's steps, their total seconds and mean phases; starts a new window. On a
        device this waits for the window's last stamp."""
        self._fold()
        count, seconds, totals = self._folded_steps, self._folded_seconds, self._folded
        self._folded, self._folded_steps, self._folded_seconds = {}, 0, 0.0
        phases = {name: total / count for name, total in totals.items()} if count else {}
        return ClockWindow(steps=count, seconds=seconds, phases=phases)

    def _fold(self) -> None:
        """Add the pending steps to the window's sums."""
        steps, self._steps = self._steps, []
        totals = self._folded
        self._folded_steps += len(steps)
        for boundaries in steps:
            offsets = self.timeline.offsets([stamp for _, stamp in boundaries])
            for (name, _), begin, end in zip(boundaries[1:], offsets, offsets[1:]):
                assert name is not None
                totals[name] = totals.get(name, 0.0) + end - begin
            # A step ends at its last boundary: a fault-tolerant step discarded before its
            # optimizer phase ends where it was discarded.
            self._folded_seconds += offsets[-1]


class StepMeter:
    """Training time and samples of this rank, per log window and for the whole run.

    Only time inside training steps counts (batch fetching included), so evaluation, logging and
    checkpointing between steps do not dilute the throughput figures. The split of a step into
    phases comes from :attr:`clock` (a :class:`PhaseClock` on ``device``), where the loop marks
    them.

    Where the clock's timeline is a device's (CUDA), a window's step time is the device's: the
    host runs up to a step ahead of the GPU (the step's verdict is read a step late) and the log
    point's host reads drain the queue outside any step, so host times would miss about one
    step of GPU work per window (half the time at a log period of 2). The steps' device time,
    each from its start to its last boundary, includes the GPU's waits for the host and data and
    excludes what runs between steps. The run's :attr:`total_seconds` takes the device's time of
    each window when it is read (the host's until then).
    """

    def __init__(
        self, device: torch.device | None = None, *, timeline: Timeline[Any] | None = None
    ) -> None:
        self.clock = PhaseClock(device, timeline=timeline)
        self.total_seconds = 0.0
        # Samples per rank: a fraction where ranks share samples (tensor and pipeline peers).
        self.total_samples: float = 0
        self.total_steps = 0
        self._reset_window()

    def _reset_window(self) -> None:
        self._seconds = 0.0
        self._steps = 0
        self._samples: float = 0

    def step_done(self, *, samples: float, seconds: float) -> None:
        """One step: its samples and host wall time (its phases were marked on :attr:`clock`)."""
        self._steps += 1
        self._samples += samples
        self._seconds += seconds
        self.total_steps += 1
        self.total_samples += samples
        self.total_seconds += seconds

    def flush(self) -> dict[str, float]:
        """Mean step time, mean phase times per step and samples/s of the window; starts a new
        one."""
        window = self.clock.read_window()
        steps, seconds = self._steps, self._seconds
        if self.clock.timeline.asynchronous:
            # Every step the clock started counts, a fault-tolerant step discarded before its
            # update included: its time was spent, and the phases average over the same steps.
            steps, seconds = window.steps, window.seconds
            self.total_seconds += seconds - self._seconds
        phases = {**dict.fromkeys(PHASES, 0.0), **window.phases}
        out = {
            "step_s": seconds / max(steps, 1),
            "data_wait_s": phases["data_wait"],
            "fwd_bwd_s": phases["fwd_bwd"],
            "optimizer_s": phases["optimizer"],
            "samples_per_s": self._samples / seconds if seconds > 0 else 0.0,
        }
        self._reset_window()
        return out


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated CUDA memory since the last reset of the peak statistics (each log window,
    see :class:`MemoryWindow`), or this process's lifetime peak resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in kilobytes on Linux, bytes on macOS.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


_STATUS = Path("/proc/self/status")


def resident_memory_mb() -> float | None:
    """This process's resident set size now (Linux), None where /proc is not there."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**10  # kB
    except OSError:
        return None
    return None


class MemoryWindow:
    """Memory figures of one log window; :meth:`read` ends the window.

    CUDA: ``peak_memory_mb`` and ``reserved_memory_mb`` are the peaks of the memory allocated to
    tensors and of the memory the caching allocator holds (what ``nvidia-smi`` shows,
    fragmentation included) within the window; the peaks are reset after each read.
    ``alloc_retries`` counts the window's cudaMalloc calls that failed and succeeded only after
    the allocator freed its cached blocks: each one synchronises the device, so a non-zero count
    means the run is close to running out of memory and slowed by it.

    CPU: ``peak_memory_mb`` stays the process's lifetime peak resident set size. The kernel's
    high-water mark can be reset (``/proc/self/clear_refs``), but that also resets what
    ``getrusage`` reports to everything else in the process (``scripts/bench/bench_memory.py`` reads
    it), so it is not touched; ``reserved_memory_mb`` is the resident set size at the read, which
    falls again when memory is returned.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._retries = self._alloc_retries() if self.cuda else 0

    def keys(self) -> tuple[str, ...]:
        """The names :meth:`read` returns, the same on every rank of a run (one device type)."""
        if self.cuda:
            return ("peak_memory_mb", "reserved_memory_mb", "alloc_retries")
        return ("peak_memory_mb", "reserved_memory_mb")

    def _alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def read(self) -> dict[str, float]:
        if not self.cuda:
            peak = peak_memory_mb(self.device)
            resident = resident_memory_mb()
            if resident is None:
                return {"peak_memory_mb": peak, "reserved_memory_mb": peak}
            # The two counters are read moments apart (and the kernel batches RSS updates per
            # CPU): keep the peak consistent with the resident size it must include.
            return {"peak_memory_mb": max(peak, resident), "reserved_memory_mb": resident}
        retries = self._alloc_retries()
        out = {
            "peak_memory_mb": torch.cuda.max_memory_allocated(self.device) / 2**20,
            "reserved_memory_mb": torch.cuda.max_memory_reserved(self.device) / 2**20,
            "alloc_retries": float(retries - self._retries),
        }
        self._retries = retries
        torch.cuda.reset_peak_memory_stats(self.device)
        return out
