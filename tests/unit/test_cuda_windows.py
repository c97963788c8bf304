"""The sync-check window of tests/cuda/test_verdict_cuda.py, run on the CPU: a window that arms
``torch.cuda.set_sync_debug_mode("error")`` over a point that synchronises with the GPU fails
here, instead of spending a GPU run on a test mistake.

The CUDA test's own Trainer and window run the CUDA test's own run on the CPU, with
``set_sync_debug_mode`` recording the mode instead of calling CUDA. The points that read the GPU
back on a GPU (the metrics hook's log point, evaluation, checkpoint saves) record the mode in force
when they run: none may run under "error". The window must also arm every other step past the
warm-up, so that the check covers what it claims to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from sdnet_trainer import Trainer, compose
from sdnet_trainer.training.checkpointer import Checkpointer
from sdnet_trainer.training.hooks import MetricsHook
from tests.cuda.test_verdict_cuda import (
    RUN,
    SYNC_CHECK_RUN,
    WARM_UP_STEPS,
    NoSyncOnNonLogSteps,
)
from tests.support import CPU

# torch.cuda.set_sync_debug_mode's arguments (a level or its name), by the level's name.
LEVELS = ("default", "warn", "error")
MODES: dict[int | str, str] = {**dict(enumerate(LEVELS)), **{name: name for name in LEVELS}}
# Where a step reads the GPU back on a GPU: (owner, method).
SYNCHRONISING_POINTS = [
    (MetricsHook, "_log"),
    (Trainer, "evaluate"),
    (Checkpointer, "save"),
]


@dataclass
class SyncDebugRecord:
    """The sync-debug mode in force, the mode each step's hooks ran under, and the
    synchronising points that ran under "error"."""

    mode: str = "default"
    steps: dict[int, str] = field(default_factory=dict)
    logged: set[int] = field(default_factory=set)
    violations: list[str] = field(default_factory=list)

    def set_mode(self, debug_mode: int | str) -> None:
        self.mode = MODES[debug_mode]

    def point(self, name: str, step: int) -> None:
        if self.mode == "error":
            self.violations.append(f"{name} at step {step}")


def _record_steps(monkeypatch, record: SyncDebugRecord) -> None:
    """The mode each step's hooks ran under (read as the metrics hook starts), and its log
    points."""
    after_step, log = MetricsHook.after_step, MetricsHook._log

    def recorded_after_step(self, state, result):
        record.steps[state.step] = record.mode
        return after_step(self, state, result)

    def recorded_log(self, state, result):
        record.logged.add(state.step)
        return log(self, state, result)

    monkeypatch.setattr(MetricsHook, "after_step", recorded_after_step)
    monkeypatch.setattr(MetricsHook, "_log", recorded_log)


def _watch(monkeypatch, record: SyncDebugRecord, trainer: Trainer) -> None:
    """Each synchronising point notes whether it ran under "error"."""
    for owner, name in SYNCHRONISING_POINTS:
        method = getattr(owner, name)

        def watched(*args, _method=method, _name=f"{owner.__name__}.{name}", **kwargs):
            record.point(_name, trainer.state.step)
            return _method(*args, **kwargs)

        monkeypatch.setattr(owner, name, watched)


def test_the_sync_check_window_arms_exactly_the_steps_that_do_not_synchronise(
    tmp_path, monkeypatch
):
    record = SyncDebugRecord()
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", record.set_mode)
    _record_steps(monkeypatch, record)
    trainer = NoSyncOnNonLogSteps(compose([*RUN, *CPU, *SYNC_CHECK_RUN]), output_dir=tmp_path)
    _watch(monkeypatch, record, trainer)
    trainer.fit()

    steps = trainer.state.step
    assert sorted(record.steps) == list(range(1, steps + 1)), record.steps
    assert not record.violations, (
        f"{', '.join(record.violations)} ran under set_sync_debug_mode('error'): on a GPU "
        f"the read-back there raises"
    )
    armed = {step for step, mode in record.steps.items() if mode == "error"}
    quiet = {step for step in record.steps if step > WARM_UP_STEPS} - record.logged
    assert armed == quiet and armed, f"armed {sorted(armed)}; steps without a log point {quiet}"
    assert record.mode == "default"  # disarmed after the last step


@pytest.mark.parametrize(
    ("debug_mode", "expected"), [(0, "default"), ("default", "default"), (2, "error")]
)
def test_the_recorder_reads_torchs_names_and_numbers(debug_mode, expected):
    record = SyncDebugRecord()
    record.set_mode(debug_mode)
    record.point("a point", 1)
    assert record.mode == expected
    assert record.violations == ([] if expected == "default" else ["a point at step 1"])
