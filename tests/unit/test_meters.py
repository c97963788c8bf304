"""Per-window step phases (PhaseClock) and memory figures (MemoryWindow), and what MetricsHook
logs from them."""

from __future__ import annotations

import mmap
import resource
from pathlib import Path
from unittest import mock

import pytest
import torch

from sdnet_trainer.config.observability import LoggingConfig
from sdnet_trainer.observability import MetricsWriter, StepMeter, meters
from sdnet_trainer.observability import figures as figures_module
from sdnet_trainer.observability.figures import RunFigures
from sdnet_trainer.observability.meters import MemoryWindow, PhaseClock, resident_memory_mb
from sdnet_trainer.training.hooks import MetricsHook
from sdnet_trainer.training.state import RunState, StepResult
from tests.support import read_jsonl

MB = 2**20


class FakeClock:
    """perf_counter returning the times it is given, in order."""

    def __init__(self, times: list[float]) -> None:
        self.times = [float(t) for t in times]

    def __call__(self) -> float:
        return self.times.pop(0)


def test_phase_clock_adds_recurring_phases_and_averages_over_steps(monkeypatch):
    # Step 1, two micro-batches: data 0-1 and 3-4, forward/backward 1-3 and 4-7, optimizer 7-8.
    # Step 2: data 10-10.5, forward/backward 10.5-12, optimizer 12-14.
    clock = FakeClock([0, 1, 3, 4, 7, 8, 10, 10.5, 12, 14])
    monkeypatch.setattr(meters.time, "perf_counter", clock)
    phases = PhaseClock(torch.device("cpu"))
    phases.start()
    for name in ("data_wait", "fwd_bwd", "data_wait", "fwd_bwd", "optimizer"):
        phases.mark(name)
    phases.start()
    for name in ("data_wait", "fwd_bwd", "optimizer"):
        phases.mark(name)
    assert phases.steps == 2
    assert phases.read() == {"data_wait": 1.25, "fwd_bwd": 3.25, "optimizer": 1.5}
    # The window was consumed: the next read starts empty.
    assert phases.steps == 0 and phases.read() == {}
    with pytest.raises(RuntimeError, match="start"):
        PhaseClock().mark("data_wait")


def test_phase_clock_folds_long_windows_into_sums(monkeypatch):
    # Nothing read for many steps: pending steps are folded, the mean still covers all of them.
    monkeypatch.setattr(meters, "_MAX_PENDING_STEPS", 2)
    monkeypatch.setattr(meters.time, "perf_counter", FakeClock(range(100)))
    phases = PhaseClock()
    for _ in range(5):
        phases.start()
        phases.mark("data_wait")
        phases.mark("fwd_bwd")
    assert len(phases._steps) == 1 and phases.steps == 5
    assert phases.read() == {"data_wait": 1.0, "fwd_bwd": 1.0}
    assert phases.steps == 0


def test_step_meter_takes_the_phases_from_its_clock(monkeypatch):
    meter = StepMeter(torch.device("cpu"))
    # Nothing marked: the phases are zero, the step time and throughput still count.
    meter.step_done(samples=8, seconds=2.0)
    window = meter.flush()
    assert (window["data_wait_s"], window["fwd_bwd_s"], window["optimizer_s"]) == (0, 0, 0)
    assert window["samples_per_s"] == 4.0 and window["step_s"] == 2.0
    monkeypatch.setattr(meters.time, "perf_counter", FakeClock([0, 2, 5, 6, 10, 11, 13, 14]))
    for _ in range(2):
        meter.clock.start()
        for name in ("data_wait", "fwd_bwd", "optimizer"):
            meter.clock.mark(name)
        meter.step_done(samples=8, seconds=6.0)
    window = meter.flush()  # per step: data (2 + 1) / 2, forward/backward (3 + 2) / 2, ...
    assert (window["data_wait_s"], window["fwd_bwd_s"], window["optimizer_s"]) == (1.5, 2.5, 1)
    assert meter.total_steps == 3 and meter.total_samples == 24


def test_cpu_memory_window_is_the_lifetime_peak_and_leaves_rusage_alone():
    memory = MemoryWindow(torch.device("cpu"))
    assert memory.keys() == ("peak_memory_mb", "reserved_memory_mb")
    before = memory.read()
    size = 96 * MB
    block = mmap.mmap(-1, size)  # anonymous pages, returned to the kernel on close
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
    holding = memory.read()
    block.close()
    released = memory.read()
    assert holding["reserved_memory_mb"] >= before["reserved_memory_mb"] + 90
    assert holding["peak_memory_mb"] >= holding["reserved_memory_mb"]
    # The resident size falls again; the CPU peak is a lifetime figure and reading it does not
    # reset the kernel's high-water mark, which getrusage (scripts/bench/bench_memory.py) reports.
    assert released["reserved_memory_mb"] <= holding["reserved_memory_mb"] - 90
    # (Counters read moments apart differ by a page or so: 2 MB of slack, not 90.)
    assert released["peak_memory_mb"] >= holding["peak_memory_mb"] - 2
    rusage_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    assert rusage_mb >= holding["reserved_memory_mb"] - 2
    assert resident_memory_mb() == pytest.approx(released["reserved_memory_mb"], abs=16)


class FakeCudaMemory:
    """torch.cuda's memory statistics for one device: allocations move the peaks, as the
    caching allocator does, and reset_peak_memory_stats sets the peaks to the current values."""

    def __init__(self) -> None:
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.retries = 0
        self.resets = 0

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes  # reserved stays cached

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak_allocated)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(
            cuda, "memory_stats", lambda device=None: {"num_alloc_retries": self.retries}
        )
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self.reset)

    def reset(self, device=None) -> None:
        self.resets += 1
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


def test_cuda_memory_window_resets_the_peak_after_each_read(monkeypatch):
    fake = FakeCudaMemory()
    fake.install(monkeypatch)
    fake.retries = 4  # before the run: not this run's windows
    memory = MemoryWindow(torch.device("cuda", 0))
    assert memory.keys() == ("peak_memory_mb", "reserved_memory_mb", "alloc_retries")
    fake.allocate(100 * MB)
    fake.allocate(400 * MB)
    fake.free(400 * MB)
    fake.retries += 2
    first = memory.read()
    assert first == {"peak_memory_mb": 500, "reserved_memory_mb": 500, "alloc_retries": 2}
    assert fake.resets == 1
    fake.allocate(50 * MB)
    second = memory.read()
    # A lifetime maximum would still say 500 MB allocated; the window's peak is 150.
    assert second == {"peak_memory_mb": 150, "reserved_memory_mb": 500, "alloc_retries": 0}


class _Sink:
    """What a rank's own sinks (the Prometheus exporter) receive."""

    def __init__(self) -> None:
        self.written: list[dict[str, float]] = []

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.written.append(metrics)

    def close(self) -> None:
        pass


def _log_one_step(
    directory: Path,
    device: torch.device,
    meter: StepMeter,
    *,
    rank: int = 0,
    per_rank_metrics: bool = False,
    sink: _Sink | None = None,
) -> dict:
    writer = MetricsWriter(
        directory,
        LoggingConfig(trackers=["jsonl"]),
        enabled=True,
        run_name="test",
        config={},
        sinks=[sink] if sink is not None else [],
    )
    figures = RunFigures(total_steps=2, samples_per_epoch=8, metric_weight=1.0, world_size=1)
    hook = MetricsHook(
        LoggingConfig(
            log_every_n_steps=1, progress_bar="off", flops=False, per_rank_metrics=per_rank_metrics
        ),
        figures,
        writer=writer,
        meter=meter,
        device=device,
        lr=lambda: 0.1,
        comm_bytes=None,
        loss_scale=None,
        rank=rank,
        bad_samples=lambda: 3,
    )
    result = StepResult(
        loss=torch.tensor(0.5),
        grad_norm=torch.tensor(1.0),
        data_wait_s=0.0,
        seconds=0.1,
        nonfinite=False,
        stop_requested=False,
        save_due=False,
    )
    hook.before_train(RunState())
    # A step of 1 s: data 0.25 s, forward/backward 0.5 s, optimizer 0.25 s.
    with mock.patch.object(meters.time, "perf_counter", FakeClock([0, 0.25, 0.75, 1.0])):
        meter.clock.start()
        for name in ("data_wait", "fwd_bwd", "optimizer"):
            meter.clock.mark(name)
    meter.step_done(samples=8, seconds=1.0)
    hook.after_step(RunState(step=1), result)
    hook.close()
    writer.close()
    return read_jsonl(directory / "metrics.jsonl")[0]


def test_metrics_hook_logs_the_window_memory_and_phases_on_cpu(tmp_path):
    logged = _log_one_step(tmp_path, torch.device("cpu"), StepMeter())
    assert logged["perf/peak_memory_mb"] >= logged["perf/reserved_memory_mb"] > 10
    assert "perf/alloc_retries" not in logged
    assert (logged["perf/data_wait_s"], logged["perf/fwd_bwd_s"]) == (0.25, 0.5)
    assert logged["perf/optimizer_s"] == 0.25
    assert logged["data/skipped_samples"] == 3.0  # the column after the memory figures


def test_metrics_hook_logs_cuda_memory_columns(tmp_path, monkeypatch):
    # No GPU needed: the statistics are faked and the gather stays in one process on the CPU.
    fake = FakeCudaMemory()
    fake.install(monkeypatch)
    monkeypatch.setattr(
        "sdnet_trainer.observability.figures.all_gather_floats",
        lambda values, device: torch.tensor([values], dtype=torch.float64),
    )
    fake.allocate(300 * MB)  # during setup: before_train starts the first window after it
    fake.free(300 * MB)
    meter = StepMeter()  # a CPU clock: the fake covers memory only

    def run_step() -> None:
        fake.allocate(64 * MB)
        fake.retries += 1

    original = meter.step_done

    def step_done(**kwargs) -> None:
        run_step()
        original(**kwargs)

    meter.step_done = step_done  # type: ignore[method-assign]
    logged = _log_one_step(tmp_path, torch.device("cuda", 0), meter)
    assert logged["perf/peak_memory_mb"] == 64 and logged["perf/reserved_memory_mb"] == 300
    assert logged["perf/alloc_retries"] == 1.0 and logged["data/skipped_samples"] == 3.0


def _world(size: int, straggler: int):
    """all_gather_floats as ``size`` ranks would answer it: every rank reports this rank's
    values, but ``straggler``'s step takes 4 times as long at a quarter of the rate."""

    def gather(values: list[float], *, device: torch.device) -> torch.Tensor:
        table = torch.tensor([values] * size, dtype=torch.float64)
        table[straggler, 2] /= 4  # samples_per_s (after loss and weight)
        table[straggler, 3] *= 4  # step_s
        return table

    return gather


@pytest.mark.parametrize("per_rank_metrics", [False, True])
def test_a_log_point_of_1024_ranks_writes_a_bounded_number_of_keys(
    tmp_path, monkeypatch, per_rank_metrics
):
    """At 1,024 ranks a log point writes as many keys as at 1 (the ranks' spread and the slowest
    rank's index, no key per rank) unless the full table is asked for; each rank's sinks still
    receive that rank's own step time and samples/s."""
    keys = {}
    for size in (1, 1024):
        monkeypatch.setattr(figures_module, "all_gather_floats", _world(size, straggler=size - 1))
        sink = _Sink()
        logged = _log_one_step(
            tmp_path / f"{size}",
            torch.device("cpu"),
            StepMeter(),
            rank=size - 1,
            per_rank_metrics=per_rank_metrics,
            sink=sink,
        )
        keys[size] = set(logged)
        own = sink.written[0]
        assert own[f"perf/step_s_rank{size - 1}"] == pytest.approx(1.0)  # this rank's, unchanged
        assert own[f"perf/samples_per_s_rank{size - 1}"] == pytest.approx(8.0)
        assert not any(f"_rank{size - 1}" in key for key in logged) or per_rank_metrics
    assert logged["perf/slowest_rank"] == 1023
    assert logged["perf/step_s"] == logged["perf/rank_step_s_max"] == pytest.approx(4.0)
    assert logged["perf/rank_step_s_min"] == logged["perf/rank_step_s_median"] == pytest.approx(1.0)
    assert logged["perf/rank_samples_per_s_min"] == pytest.approx(2.0)
    assert logged["perf/samples_per_s"] == pytest.approx(1023 * 8.0 + 2.0)
    if per_rank_metrics:
        assert len(keys[1024] - keys[1]) == 2 * 1023  # every other rank's step_s and samples_per_s
        assert logged["perf/step_s_rank1023"] == pytest.approx(4.0)
    else:
        assert keys[1024] == keys[1] and len(keys[1024]) < 40
