"""sdnet_trainer.training.health in one process: non-finite flags, the hang watchdog, the heartbeat.

The watchdog ends its process, so each watchdog scenario runs in a child forked from this one
(no fresh interpreter: importing torch and the package costs seconds per child on a small
machine). The children run side by side, and each test asserts on one child's outcome.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from sdnet_trainer.observability.logs import HEARTBEAT_LOGGER, setup_logging
from sdnet_trainer.training.health import (
    EXIT_HANG,
    EXIT_NONFINITE,
    Heartbeat,
    NonFiniteError,
    PhaseTracker,
    Watchdog,
    hang_log_path,
    nonfinite_tensor_names,
)

NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------- non-finite values


def test_names_put_the_loss_first_then_gradients_in_order():
    named = [
        ("a", torch.ones(2)),
        ("b", torch.tensor([INF])),
        ("c", None),
        ("d", torch.tensor([NAN, 1.0])),
    ]
    assert nonfinite_tensor_names(named, loss=torch.tensor(NAN)) == ["loss", "b", "d"]
    assert nonfinite_tensor_names(named, loss=torch.tensor(1.0)) == ["b", "d"]
    assert nonfinite_tensor_names(named) == ["b", "d"]


def test_names_stop_at_the_limit():
    named = [(f"layer{i}.weight", torch.tensor([NAN])) for i in range(20)]
    assert nonfinite_tensor_names(iter(named), limit=3) == [
        "layer0.weight",
        "layer1.weight",
        "layer2.weight",
    ]
    assert nonfinite_tensor_names(named, loss=torch.tensor(INF), limit=2) == [
        "loss",
        "layer0.weight",
    ]


def test_names_read_sparse_gradients():
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, INF], (4,), check_invariants=True)
    assert nonfinite_tensor_names([("embedding.weight", sparse)]) == ["embedding.weight"]


def test_nonfinite_error_names_step_rank_and_tensors():
    err = NonFiniteError(12, rank=3, names=["loss", "fc.weight"])
    message = str(err)
    assert "step 12" in message and "rank 3" in message and "loss, fc.weight" in message
    assert err.exit_code == EXIT_NONFINITE == 3 and isinstance(err, RuntimeError)
    # Another rank's loss: nothing local to name, but the message still says what happened.
    assert "another rank" in str(NonFiniteError(5, rank=0, names=[]))


# ---------------------------------------------------------------------- phases


def test_phase_tracker_describes_the_last_phase_and_keeps_the_step(monkeypatch):
    phase = PhaseTracker()
    assert phase.describe() == "no phase entered yet"
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    phase.enter("forward", step=12)
    phase.enter("backward+DDP all-reduce")
    now[0] = 131.25
    assert phase.describe() == "in 'backward+DDP all-reduce' of step 12 for 31.2 s"
    phase.enter("checkpoint", step=13)
    assert phase.describe() == "in 'checkpoint' of step 13 for 0.0 s"


# ---------------------------------------------------------------------- the watchdog, in children


def _sleeping_without_progress() -> None:
    time.sleep(30)


def _child_hangs(log: Path) -> None:
    phase = PhaseTracker()
    Watchdog(1.0, rank=5, log_file=log, describe=phase.describe).start()
    phase.enter("child phase", step=12)
    _sleeping_without_progress()


def _child_beats(log: Path) -> None:
    # A small backstop margin: a beat() that failed to re-arm faulthandler would end this child.
    with Watchdog(1.0, rank=0, log_file=log, backstop_margin_s=0.5) as watchdog:
        for _ in range(15):  # 3 s, three times the timeout
            time.sleep(0.2)
            watchdog.beat()


def _child_stops(log: Path) -> None:
    watchdog = Watchdog(1.0, rank=0, log_file=log, backstop_margin_s=0.5)
    watchdog.start()
    watchdog.stop()
    watchdog.stop()
    time.sleep(3)  # past both the thread's deadline (1 s) and the backstop's (1.5 s)


def _stuck_holding_the_gil() -> None:
    # Catastrophic backtracking: minutes inside one C call that never releases the GIL.
    re.match(r"(a+)+$", "a" * 40 + "b")


def _child_holds_the_gil(log: Path) -> None:
    Watchdog(1.0, rank=0, log_file=log, backstop_margin_s=1.0).start()
    _stuck_holding_the_gil()


def _terminated_while_waiting() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)


def _child_gets_sigterm(log: Path) -> None:
    Watchdog(60.0, rank=2, log_file=log).start()
    _terminated_while_waiting()


def _child_sigterm_after_stop(log: Path) -> None:
    # The Trainer's order: its stop-signal handler is installed, the watchdog starts, the handler
    # is restored to the default when the loop ends, and only then does the watchdog stop.
    signal.signal(signal.SIGTERM, lambda *_: None)
    watchdog = Watchdog(60.0, rank=0, log_file=log)
    watchdog.start()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    watchdog.stop()
    _terminated_while_waiting()


CHILDREN = {
    "hangs": _child_hangs,
    "sigterm_after_stop": _child_sigterm_after_stop,
    "beats": _child_beats,
    "stops": _child_stops,
    "holds_the_gil": _child_holds_the_gil,
    "gets_sigterm": _child_gets_sigterm,
}
CHILD_TIMEOUT_S = 20.0


@dataclass
class Outcome:
    exitcode: int | None
    seconds: float  # from start to exit
    log: str


@pytest.fixture(scope="module")
def children(tmp_path_factory) -> dict[str, Outcome]:
    """Run every watchdog scenario in its own forked child, all at once."""
    root = tmp_path_factory.mktemp("watchdog")
    fork = multiprocessing.get_context("fork")
    started = time.monotonic()
    procs = {
        name: fork.Process(target=fn, args=(root / f"{name}.log",)) for name, fn in CHILDREN.items()
    }
    for proc in procs.values():
        proc.start()
    exited: dict[str, float] = {}
    while len(exited) < len(procs) and time.monotonic() - started < CHILD_TIMEOUT_S:
        for name, proc in procs.items():
            if name not in exited and proc.exitcode is not None:
                exited[name] = time.monotonic() - started
        time.sleep(0.02)
    for proc in procs.values():
        if proc.exitcode is None:
            proc.kill()
        proc.join()
    return {
        name: Outcome(proc.exitcode, exited.get(name, math.inf), _read(root / f"{name}.log"))
        for name, proc in procs.items()
    }


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.full  # seconds: out of the quick tier
def test_watchdog_ends_a_process_that_makes_no_progress(children):
    hung = children["hangs"]
    assert hung.exitcode == EXIT_HANG == 4, hung
    assert 1.0 <= hung.seconds < 3.0, hung
    header = re.search(r"watchdog: rank 5 made no progress for ([\d.]+) s.*", hung.log)
    assert header, hung.log
    assert float(header.group(1)) >= 1.0
    assert "in 'child phase' of step 12" in header.group(0)
    # Every thread's stack, the stuck main thread's included.
    assert "_sleeping_without_progress" in hung.log and "_watch" in hung.log


def test_watchdog_stays_quiet_while_beats_come(children):
    beating = children["beats"]
    assert beating.exitcode == 0, beating
    assert beating.seconds >= 3.0
    assert "made no progress" not in beating.log and "Timeout" not in beating.log


def test_stopped_watchdog_leaves_nothing_armed(children):
    stopped = children["stops"]
    assert stopped.exitcode == 0, stopped
    assert stopped.seconds >= 3.0
    assert "Current thread" not in stopped.log


def test_backstop_ends_a_process_stuck_holding_the_gil(children):
    stuck = children["holds_the_gil"]
    # faulthandler's own timer (timeout + margin = 2 s) fired, not the Python thread (code 4).
    assert stuck.exitcode == 1, stuck
    assert stuck.seconds < 5.0
    assert "Timeout (0:00:02)!" in stuck.log and "_stuck_holding_the_gil" in stuck.log


def test_sigterm_dumps_the_stacks_then_terminates(children):
    terminated = children["gets_sigterm"]
    assert terminated.exitcode == -signal.SIGTERM, terminated
    assert "_terminated_while_waiting" in terminated.log


def test_sigterm_after_the_watchdog_stopped_takes_the_default_action(children):
    # Without re-syncing Python's handler after faulthandler.unregister, this SIGTERM would be
    # ignored ("Signal 15 ignored due to race condition") and the child killed at the timeout.
    after_stop = children["sigterm_after_stop"]
    assert after_stop.exitcode == -signal.SIGTERM, after_stop
    assert after_stop.seconds < 10.0


def test_watchdog_in_process_start_stop_is_idempotent(tmp_path):
    log = hang_log_path(tmp_path / "run", 1)
    watchdog = Watchdog(30.0, rank=1, log_file=log)
    watchdog.stop()  # before start: nothing to do
    with watchdog:
        assert watchdog.running and watchdog.check_every_s == 1.0
        watchdog.beat()
    assert not watchdog.running
    watchdog.stop()
    assert (
        log.name == "hang_rank1.log" and "watchdog armed on rank 1: timeout 30 s" in log.read_text()
    )
    assert Watchdog(0.5, rank=0, log_file=None).check_every_s == 0.05
    with pytest.raises(ValueError):
        Watchdog(0, rank=0, log_file=None)


# ---------------------------------------------------------------------- heartbeat


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_heartbeat_logs_at_most_once_per_interval(caplog):
    clock = _Clock()
    heartbeat = Heartbeat(10.0, rank=3, clock=clock)
    caplog.set_level(logging.INFO, logger=HEARTBEAT_LOGGER)
    logged = []
    for step, now in enumerate([1005.0, 1010.0, 1012.0, 1019.9, 1020.0, 1020.1, 1100.0], start=1):
        clock.now = now
        logged.append(heartbeat.maybe_log(step, step_s=0.1234, data_wait_s=0.0051))
    # Due 10 s after creation, then 10 s after each line.
    assert logged == [False, True, False, False, True, False, True]
    records = [r for r in caplog.records if r.name == HEARTBEAT_LOGGER]
    assert [r.levelno for r in records] == [logging.INFO] * 3  # a heartbeat is no warning
    assert [r.getMessage() for r in records] == [
        f"heartbeat rank 3 step {step} step_time 0.123s data_wait 0.005s" for step in (2, 5, 7)
    ]


def test_heartbeat_rejects_a_non_positive_interval():
    with pytest.raises(ValueError):
        Heartbeat(0, rank=0)


@pytest.mark.parametrize("rank", [0, 3])
def test_every_rank_shows_its_heartbeat_at_info_and_no_other_info(rank, tmp_path, capsys):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    for handler in saved[0]:  # pytest's own, put back below (setup_logging closes what it finds)
        root.removeHandler(handler)
    # As in a fresh process: levels an earlier test in this worker set on the package's loggers
    # would otherwise decide for the root's.
    ordinary = ("sdnet_trainer", "sdnet_trainer.training", "sdnet_trainer.training.hooks")
    levels = {name: logging.getLogger(name).level for name in ordinary}
    for name in ordinary:
        logging.getLogger(name).setLevel(logging.NOTSET)
    try:
        setup_logging(tmp_path if rank == 0 else None, rank=rank, level="INFO")
        clock = _Clock()
        heartbeat = Heartbeat(1.0, rank=rank, clock=clock)
        clock.now += 2.0
        assert heartbeat.maybe_log(4, step_s=0.5, data_wait_s=0.25)
        logging.getLogger("sdnet_trainer.training.hooks").info("an ordinary INFO line")
        console = capsys.readouterr().err
        assert f"[INFO] heartbeat rank {rank} step 4" in console
        assert ("an ordinary INFO line" in console) == (rank == 0)  # the others only warn
        assert "WARNING" not in console
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
        logging.getLogger(HEARTBEAT_LOGGER).setLevel(logging.NOTSET)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
