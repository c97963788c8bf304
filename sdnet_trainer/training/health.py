"""Run health: non-finite losses and gradients, hung ranks, and a per-rank heartbeat.

Three independent pieces the Trainer wires into its loop (``cfg.health``):

* Non-finite values. The Trainer detects them from the loss and the total gradient norm it
  computes anyway, and the ranks agree in the step's one all-reduce (``Trainer._agree``); on
  abort, ``nonfinite_tensor_names`` and ``NonFiniteError`` say which step, rank and tensors.
* Hang watchdog. ``Watchdog`` ends the process (``EXIT_HANG``) with every thread's stack in a
  per-rank log file when no progress is reported for ``hang_timeout_s``, so torchrun sees a
  failure instead of waiting for the collective timeout. ``PhaseTracker`` remembers the phase
  (and so the collective) each rank last entered, for the watchdog's header line.
* ``Heartbeat``: a rate-limited per-rank log line, to spot stragglers.

Wiring, roughly::

    phase = PhaseTracker()
    watchdog = Watchdog(cfg.health.hang_timeout_s, rank=env.rank,
                        log_file=hang_log_path(output_dir, env.rank), describe=phase.describe)
    with watchdog:
        for step in ...:
            phase.enter("forward+backward (DDP all-reduce)", step=step)
            ...
            if not torch.isfinite(loss):
                raise NonFiniteError(step, rank=env.rank, names=nonfinite_tensor_names(
                    ((n, p.grad) for n, p in model.named_parameters()), loss=loss))
            watchdog.beat()
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

import torch

from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.config.schema import Config
from sdnet_trainer.observability.logs import HEARTBEAT_LOGGER

logger = logging.getLogger(__name__)

# Process exit codes, distinct from a Python traceback (1) and a ConfigError (2).
EXIT_NONFINITE = 3
EXIT_HANG = 4

_STDERR_FD = 2
NONFINITE = ("abort", "skip")  # health.nonfinite


def validate_health(cfg: Config) -> None:
    """``health.*``, checked before launch (sdnet_trainer.preflight)."""
    check_choice("health.nonfinite", cfg.health.nonfinite, NONFINITE)
    check_positive("health.hang_timeout_s", cfg.health.hang_timeout_s, allow_none=True)
    check_positive("health.heartbeat_s", cfg.health.heartbeat_s, allow_none=True)


# ---------------------------------------------------------------------- non-finite values


def nonfinite_tensor_names(
    named_grads: Iterable[tuple[str, torch.Tensor | None]],
    *,
    loss: torch.Tensor | None = None,
    limit: int = 10,
) -> list[str]:
    """Names of the tensors holding a NaN/Inf, ``"loss"`` first, at most ``limit`` of them.
    Syncs once per tensor: meant for the abort message, not for every step."""
    names: list[str] = []
    if loss is not None and not _all_finite(loss):
        names.append("loss")
    for name, grad in named_grads:
        if len(names) >= limit:
            break
        if grad is not None and not _all_finite(grad):
            names.append(name)
    return names[:limit]


def _all_finite(tensor: torch.Tensor) -> bool:
    values = tensor.detach()
    if values.is_sparse:
        values = values.coalesce().values()  # isfinite has no sparse kernel
    return bool(values.isfinite().all())


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or gradient under ``health.nonfinite=abort``; ends the run with
    ``exit_code`` on every rank (the ranks agree on the step in the Trainer's per-step
    all-reduce)."""

    exit_code = EXIT_NONFINITE

    def __init__(self, step: int, *, rank: int, names: Iterable[str]) -> None:
        self.step = step
        self.rank = rank
        self.names = list(names)
        # With DDP the gradients are shared, so an empty list means another rank's loss.
        found = ", ".join(self.names) or "none on this rank (another rank's loss)"
        super().__init__(
            f"non-finite loss or gradients at step {step} on rank {rank}: {found} "
            f"(health.nonfinite=abort; health.nonfinite=skip drops such steps instead)"
        )


# ---------------------------------------------------------------------- hangs


def hang_log_path(output_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank``'s watchdog writes its stack dumps."""
    return Path(output_dir) / f"hang_rank{rank}.log"


class PhaseTracker:
    """The phase (and step) this rank last entered, e.g. ``"backward+DDP all-reduce"``.

    ``enter`` is one tuple assignment, atomic under the GIL, so the watchdog thread can read it
    without a lock and the training loop pays almost nothing.
    """

    def __init__(self) -> None:
        self._state: tuple[str, int | None, float] | None = None

    def enter(self, name: str, *, step: int | None = None) -> None:
        """Enter phase ``name``; ``step`` None keeps the step of the previous phase."""
        previous = self._state
        if step is None and previous is not None:
            step = previous[1]
        self._state = (name, step, time.monotonic())

    def describe(self) -> str:
        state = self._state
        if state is None:
            return "no phase entered yet"
        name, step, since = state
        of_step = "" if step is None else f" of step {step}"
        return f"in {name!r}{of_step} for {time.monotonic() - since:.1f} s"


class Watchdog:
    """End this process with ``EXIT_HANG`` if ``beat()`` is not called for ``timeout_s``.

    On expiry a daemon thread writes a header line (rank, seconds since the last beat,
    ``describe()``) and the stacks of all threads to stderr and to ``log_file`` (appended), then
    calls ``os._exit``: torchrun sees a failed worker and stops or restarts the group, instead
    of every rank waiting out the process group's timeout.

    Two faulthandler hooks cover what the thread cannot:

    * a backstop timer at ``timeout_s + backstop_margin_s`` that dumps the stacks and exits (code
      1) from C, for a stuck call that holds the GIL so the Python thread never runs;
    * with ``dump_on_sigterm``, a stack dump on SIGTERM (then the default action): when one
      rank's watchdog fires, torchrun SIGTERMs the others, which still leave their stacks.

    Both are process-wide faulthandler settings: one Watchdog per process.
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        rank: int,
        log_file: Path | None = None,
        describe: Callable[[], str] | None = None,
        backstop_margin_s: float = 5.0,
        dump_on_sigterm: bool = True,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the watchdog timeout must be positive, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.log_file = Path(log_file) if log_file is not None else None
        self.describe = describe
        self.backstop_margin_s = backstop_margin_s
        self.dump_on_sigterm = dump_on_sigterm and hasattr(faulthandler, "register")
        self.check_every_s = min(1.0, self.timeout_s / 10)
        self._last_beat = time.monotonic()
        self._armed_at = 0.0
        self._file: IO[bytes] | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._open_log_file()
        self._stopping.clear()
        self._last_beat = time.monotonic()
        self._arm_backstop()
        if self.dump_on_sigterm:
            faulthandler.register(
                signal.SIGTERM, file=self._dump_fd(), all_threads=True, chain=True
            )
        self._thread = threading.Thread(
            target=self._watch, name=f"watchdog-rank{self.rank}", daemon=True
        )
        self._thread.start()

    def beat(self) -> None:
        """Progress was made: restart the countdown."""
        now = time.monotonic()
        self._last_beat = now
        # Re-arming faulthandler starts a C thread (~40 us); at most once per check interval is
        # enough while the margin exceeds two intervals, and keeps beat() free in tight loops.
        if self._thread is not None and now - self._armed_at >= self.check_every_s:
            self._arm_backstop()

    def stop(self) -> None:
        """Disarm everything; safe to call twice, or without start()."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stopping.set()
        faulthandler.cancel_dump_traceback_later()
        if self.dump_on_sigterm:
            faulthandler.unregister(signal.SIGTERM)
            _resync_python_handler(signal.SIGTERM)
        if thread is not threading.current_thread():
            thread.join(timeout=self.check_every_s + 1.0)
        if self._file is not None:
            self._file.close()
            self._file = None

    # -------------------------------------------------------------- internals

    def _open_log_file(self) -> None:
        if self.log_file is None:
            return
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        # Kept open: faulthandler writes to a file descriptor, from C, at the worst moment.
        self._file = open(self.log_file, "ab", buffering=0)  # noqa: SIM115  closed in stop()
        self._file.write(
            f"{_timestamp()} watchdog armed on rank {self.rank}: timeout "
            f"{self.timeout_s:g} s\n".encode()
        )

    def _dump_fd(self) -> int:
        """The descriptor faulthandler's own hooks write to: the log file, else stderr."""
        return self._file.fileno() if self._file is not None else _STDERR_FD

    def _arm_backstop(self) -> None:
        self._armed_at = time.monotonic()
        faulthandler.dump_traceback_later(
            self.timeout_s + self.backstop_margin_s, exit=True, file=self._dump_fd()
        )

    def _watch(self) -> None:
        while not self._stopping.wait(self.check_every_s):
            idle_s = time.monotonic() - self._last_beat
            # Re-check: stop() may have come just after the wait above timed out.
            if idle_s > self.timeout_s and not self._stopping.is_set():
                self._fire(idle_s)

    def _fire(self, idle_s: float) -> None:
        header = (
            f"{_timestamp()} watchdog: rank {self.rank} made no progress for {idle_s:.1f} s "
            f"(timeout {self.timeout_s:g} s); {self._describe_safely()}; dumping all "
            f"threads' stacks and exiting with code {EXIT_HANG}\n"
        ).encode()
        for fd in (_STDERR_FD, *self._log_fds()):
            # Raw descriptor writes: no logging or stream lock that a stuck thread might hold.
            _write_quietly(fd, header)
            try:
                faulthandler.dump_traceback(fd, all_threads=True)
            except (OSError, ValueError):
                pass
        os._exit(EXIT_HANG)

    def _log_fds(self) -> list[int]:
        try:
            return [self._file.fileno()] if self._file is not None else []
        except ValueError:  # closed by a concurrent stop()
            return []

    def _describe_safely(self) -> str:
        if self.describe is None:
            return "no phase information"
        try:
            return self.describe()
        except Exception as err:  # the process is about to end; report, do not raise
            return f"describe() failed: {err!r}"


def _resync_python_handler(signum: int) -> None:
    """Make the C-level handler of ``signum`` match Python's again after faulthandler's.

    ``faulthandler.unregister`` restores the handler that was installed when ``register`` ran.
    When Python code changed the handler in between (the Trainer's stop signals end before the
    watchdog stops, restoring the default), that restored C handler is stale: Python's trampoline
    with SIG_DFL in Python's table, so a later SIGTERM would be ignored ("Signal 15 ignored due
    to race condition") instead of ending the process. Re-installing Python's current handler
    fixes the pair; only the main thread may set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signum)
    if current is not None:  # None: installed from C, not Python's to restore
        signal.signal(signum, current)


def _write_quietly(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:
        pass


def _timestamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


# ---------------------------------------------------------------------- heartbeat

heartbeat_logger = logging.getLogger(HEARTBEAT_LOGGER)


class Heartbeat:
    """One log line per rank at most every ``every_s`` seconds, with the step and its timings.

    Logged at INFO (a heartbeat is not a warning) on a logger of its own, ``HEARTBEAT_LOGGER``,
    which :func:`~sdnet_trainer.observability.logs.setup_logging` lets through at the run's level
    on every rank (the others otherwise show only warnings): a line from every rank is the point,
    a straggler shows as a slow step time or a long data wait next to its peers'. A stall is the
    watchdog's to report. No collective, so it never adds a sync.
    """

    def __init__(
        self, every_s: float, *, rank: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if every_s <= 0:
            raise ValueError(f"the heartbeat interval must be positive, got {every_s}")
        self.every_s = float(every_s)
        self.rank = rank
        self._clock = clock
        self._next_at = clock() + self.every_s

    def maybe_log(self, step: int, *, step_s: float, data_wait_s: float) -> bool:
        """Log if ``every_s`` has passed since the last line (or since creation); returns
        whether it logged."""
        now = self._clock()
        if now < self._next_at:
            return False
        self._next_at = now + self.every_s
        heartbeat_logger.info(
            "heartbeat rank %d step %d step_time %.3fs data_wait %.3fs",
            self.rank,
            step,
            step_s,
            data_wait_s,
        )
        return True
