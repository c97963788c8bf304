"""Step time and throughput on a device that runs behind the host (issue #31, item 5).

On CUDA the host only queues work and runs up to a step ahead of the GPU (the step's verdict is
read a step late); the log point's host reads drain the queue outside any step. A simulated
device, in pure Python on a host clock advanced by hand, shows that the StepMeter reports the
device's step time where host wall times miss about one step of GPU work per log window.
"""

from __future__ import annotations

import pytest
import torch

from sdnet_trainer.observability.meters import StepMeter

# One step's work on the simulated device: the batch's copy, forward/backward, the optimizer.
COPY_S, FWD_BWD_S, OPTIMIZER_S = 0.001, 0.007, 0.002
DEVICE_STEP_S = COPY_S + FWD_BWD_S + OPTIMIZER_S  # 10 ms
# The host's part: fetching the batch, and launching each piece of work.
FETCH_S, LAUNCH_S = 0.0002, 0.00001
SAMPLES = 32


class SimulatedDevice:
    """A device that runs the work the host launches in order, on the host's clock (``now``,
    advanced by hand): each piece starts when it is launched or when the device is free, the
    later of the two."""

    def __init__(self) -> None:
        self.now = 0.0  # the host's clock
        self.busy_until = 0.0  # when the device finishes what is queued

    def host_work(self, seconds: float) -> None:
        self.now += seconds

    def launch(self, seconds: float) -> None:
        self.busy_until = max(self.now, self.busy_until) + seconds
        self.now += LAUNCH_S

    def reached(self) -> float:
        """When the device reaches a marker queued now (after the work queued before it)."""
        return max(self.now, self.busy_until)

    def wait_until(self, seconds: float) -> None:
        """The host blocks until the device's time ``seconds``."""
        self.now = max(self.now, seconds)

    def drain(self) -> None:
        self.wait_until(self.busy_until)


class SimulatedDeviceTimeline:
    """The simulated device's timeline, as CUDA events give it: each stamp is the time the
    device reaches it, and reading them waits for the last one."""

    asynchronous = True

    def __init__(self, device: SimulatedDevice) -> None:
        self.device = device

    def stamp(self) -> float:
        return self.device.reached()

    def offsets(self, stamps: list[float]) -> list[float]:
        self.device.wait_until(max(stamps))
        return [stamp - stamps[0] for stamp in stamps]


class SimulatedHostTimeline:
    """Host wall times in the same simulation: what the meter reported before the fix."""

    asynchronous = False

    def __init__(self, device: SimulatedDevice) -> None:
        self.device = device

    def stamp(self) -> float:
        return self.device.now

    def offsets(self, stamps: list[float]) -> list[float]:
        return [stamp - stamps[0] for stamp in stamps]


def _train(meter: StepMeter, device: SimulatedDevice, *, log_every: int, steps: int) -> list[dict]:
    """Steps driven as ``Trainer.train_step`` drives the meter, with the MetricsHook's log point
    every ``log_every`` steps; the windows it logged."""
    windows = []
    clock = meter.clock
    previous_done = 0.0  # when the device finished the previous step
    for step in range(1, steps + 1):
        started = device.now
        clock.start()
        device.host_work(FETCH_S)
        device.launch(COPY_S)
        clock.mark("data_wait")
        device.launch(FWD_BWD_S)
        clock.mark("fwd_bwd")
        device.launch(OPTIMIZER_S)
        done = device.busy_until
        device.wait_until(previous_done)  # the deferred verdict: the previous step's agreement
        previous_done = done
        clock.mark("optimizer")
        meter.step_done(samples=SAMPLES, seconds=device.now - started)
        if step % log_every == 0:
            windows.append(meter.flush())
            device.drain()  # the hook's .item() and all_gather, outside any step
    return windows


@pytest.mark.parametrize("log_every", [2, 10])
def test_step_time_is_the_devices_when_the_device_lags_the_host(log_every):
    device = SimulatedDevice()
    meter = StepMeter(timeline=SimulatedDeviceTimeline(device))
    windows = _train(meter, device, log_every=log_every, steps=5 * log_every)
    for window in windows:
        assert window["step_s"] == pytest.approx(DEVICE_STEP_S, rel=0.02)
        assert window["samples_per_s"] == pytest.approx(SAMPLES / DEVICE_STEP_S, rel=0.02)
        # The phases split the same device time.
        phases = window["data_wait_s"] + window["fwd_bwd_s"] + window["optimizer_s"]
        assert phases == pytest.approx(window["step_s"])
        assert window["fwd_bwd_s"] == pytest.approx(FWD_BWD_S, rel=0.02)
    # The run's summary counts the device's time of every window.
    assert meter.total_seconds == pytest.approx(sum(w["step_s"] * log_every for w in windows))
    assert meter.total_steps == 5 * log_every


@pytest.mark.parametrize(("log_every", "host_share"), [(2, 0.51), (10, 0.902)])
def test_host_times_of_the_same_steps_miss_a_step_per_window(log_every, host_share):
    # What the meter reported before: the window's first step finds the queue drained by the
    # log point, so it waits for no GPU work of its own; the window measures about
    # log_every - 1 steps of it (5.1 ms for a 10 ms step at a log period of 2).
    device = SimulatedDevice()
    meter = StepMeter(timeline=SimulatedHostTimeline(device))
    windows = _train(meter, device, log_every=log_every, steps=5 * log_every)
    for window in windows:
        assert window["step_s"] == pytest.approx(host_share * DEVICE_STEP_S, rel=0.01)
        assert window["samples_per_s"] == pytest.approx(
            SAMPLES / (host_share * DEVICE_STEP_S), rel=0.01
        )


def test_a_step_discarded_before_its_update_counts_until_it_was_discarded():
    # Fault tolerance: a step whose commit vote fails returns after forward/backward, without
    # the optimizer mark or step_done; its device time still counts, its samples do not.
    device = SimulatedDevice()
    meter = StepMeter(timeline=SimulatedDeviceTimeline(device))
    clock = meter.clock
    clock.start()
    device.launch(COPY_S)
    clock.mark("data_wait")
    device.launch(FWD_BWD_S)
    clock.mark("fwd_bwd")
    _train(meter, device, log_every=2, steps=1)  # one committed step in the same window
    window = meter.flush()
    discarded = COPY_S + FWD_BWD_S
    assert window["step_s"] == pytest.approx((discarded + DEVICE_STEP_S) / 2, rel=0.02)
    assert window["samples_per_s"] == pytest.approx(SAMPLES / (discarded + DEVICE_STEP_S), rel=0.02)
    assert window["optimizer_s"] == pytest.approx(OPTIMIZER_S / 2, rel=0.02)
    assert meter.total_seconds == pytest.approx(discarded + DEVICE_STEP_S, rel=0.02)
    assert meter.total_steps == 1
    assert clock.steps == 0 and meter.flush()["step_s"] == 0.0  # the next window starts empty


def test_the_device_picks_the_timeline():
    # No GPU needed: CUDA events are only created at the first stamp.
    assert not StepMeter(torch.device("cpu")).clock.timeline.asynchronous
    cuda = StepMeter(torch.device("cuda", 0)).clock
    assert cuda.cuda and cuda.timeline.asynchronous
