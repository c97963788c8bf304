"""Step timing (wall time and the step's phases) and memory per log window."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch

# The phases a training step is split into, in the order the loop passes their boundaries.
PHASES = ("data_wait", "fwd_bwd", "optimizer")
# Steps a PhaseClock keeps unread before it folds them into sums (a loop whose log points are
# far apart, or that never reads, must not grow a list of events without end).
_MAX_PENDING_STEPS = 1024


class PhaseClock:
    """Where a step's time goes: data wait, forward/backward, optimizer.

    The loop calls :meth:`start` when a step begins and ``mark(name)`` at the end of each phase:
    the time since the previous boundary counts for ``name`` (a phase may recur, e.g. data wait
    and forward/backward once per micro-batch). :meth:`read` gives the mean per step of the
    steps since the last read, and starts a new window.

    On the CPU the boundaries are host times. On CUDA the host only queues work, so host times
    put everything the GPU has not finished into whichever phase happens to wait for it (the
    optimizer step's agreement). There each boundary records a CUDA event on the current stream
    instead, and a phase is the GPU-timeline interval between its events: forward/backward is
    the time the GPU spent on (or starved while the host launched) forward and backward, data
    wait the time it waited for the batch to be loaded and copied. Events are only read in
    :meth:`read`, one synchronisation per log window rather than per step (and once per
    1,024 steps where nothing reads them sooner, so the unread events stay bounded).
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.device = device
        # One list per step in the window: (phase name or None for the start, timestamp).
        self._steps: list[list[tuple[str | None, object]]] = []
        self._spare: list[torch.cuda.Event] = []  # events already read, reused
        self._folded: dict[str, float] = {}  # sums of steps read before the window's end
        self._folded_steps = 0

    def _stamp(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> None:
        """A step begins."""
        if len(self._steps) >= _MAX_PENDING_STEPS:
            self._fold()
        self._steps.append([(None, self._stamp())])

    def mark(self, name: str) -> None:
        """Phase ``name`` ends here (it began at the previous boundary of this step)."""
        if not self._steps:
            raise RuntimeError("PhaseClock.mark before start(): call start() as a step begins")
        self._steps[-1].append((name, self._stamp()))

    @property
    def steps(self) -> int:
        """Steps started in the current window."""
        return self._folded_steps + len(self._steps)

    def read(self) -> dict[str, float]:
        """Mean seconds per step of each phase over the window (every name marked in it); starts
        a new window. On CUDA this waits for the window's last event."""
        count = self.steps
        self._fold()
        totals, self._folded, self._folded_steps = self._folded, {}, 0
        return {name: total / count for name, total in totals.items()} if count else {}

    def _fold(self) -> None:
        """Add the pending steps' phases to the window's sums."""
        steps, self._steps = self._steps, []
        if not steps:
            return
        totals = self._folded
        self._folded_steps += len(steps)
        if self.cuda:
            # Waiting for the last one would do where all were recorded on one stream.
            for boundaries in steps:
                for _, event in boundaries:
                    event.synchronize()  # type: ignore[attr-defined]
        for boundaries in steps:
            for (_, begin), (name, end) in zip(boundaries, boundaries[1:]):
                assert name is not None
                totals[name] = totals.get(name, 0.0) + self._seconds(begin, end)
            if self.cuda:
                self._spare.extend(stamp for _, stamp in boundaries)  # type: ignore[misc]

    def _seconds(self, begin: object, end: object) -> float:
        if self.cuda:
            assert isinstance(begin, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
            return begin.elapsed_time(end) / 1e3  # milliseconds
        assert isinstance(begin, float) and isinstance(end, float)
        return end - begin


class StepMeter:
    """Training time and samples of this rank, per log window and for the whole run.

    Only time inside training steps counts (batch fetching included), so evaluation, logging and
    checkpointing between steps do not dilute the throughput figures. The split of a step into
    phases comes from :attr:`clock` (a :class:`PhaseClock` on ``device``), where the loop marks
    them.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.clock = PhaseClock(device)
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
        """One step: its samples and wall time (its phases were marked on :attr:`clock`)."""
        self._steps += 1
        self._samples += samples
        self._seconds += seconds
        self.total_steps += 1
        self.total_samples += samples
        self.total_seconds += seconds

    def flush(self) -> dict[str, float]:
        """Mean step time, mean phase times per step and samples/s of the window; starts a new
        one."""
        steps = max(self._steps, 1)
        phases = {**dict.fromkeys(PHASES, 0.0), **self.clock.read()}
        out = {
            "step_s": self._seconds / steps,
            "data_wait_s": phases["data_wait"],
            "fwd_bwd_s": phases["fwd_bwd"],
            "optimizer_s": phases["optimizer"],
            "samples_per_s": self._samples / self._seconds if self._seconds > 0 else 0.0,
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
    ``getrusage`` reports to everything else in the process (``scripts/bench_memory.py`` reads
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
