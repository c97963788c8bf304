"""Stop signals while training: SIGTERM (a scheduler's notice before preemption) sets a flag.

The ranks agree on the flag at the end of the step (one small all-reduce that also carries the
non-finite verdict), save a checkpoint and exit together with ``EXIT_TERMINATED``.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

EXIT_TERMINATED = 128 + signal.SIGTERM  # the shell's convention for "ended by SIGTERM"


class StopSignals:
    """Context manager: while inside, SIGTERM only sets ``received``; the previous handler comes
    back on exit. A second SIGTERM means the first was not acted upon (a rank stuck before the
    step's agreement), so it terminates the process at once, the default way."""

    def __init__(self) -> None:
        self.received = False
        self._previous: Callable[[int, FrameType | None], Any] | int | signal.Handlers | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        self.received = True

    def __enter__(self) -> StopSignals:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def exit(self, step: int, *, saved: bool) -> None:
        """Leave the run after the ranks agreed on a stop signal (received here or on another
        rank)."""
        logger.warning(
            "SIGTERM: stopped at step %d%s", step, " after saving a checkpoint" if saved else ""
        )
        raise SystemExit(EXIT_TERMINATED)
