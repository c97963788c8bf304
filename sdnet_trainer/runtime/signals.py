"""Stop signals while training, and workers that die with their launcher.

Stopping: SIGTERM and SIGINT
----------------------------
SIGTERM (a scheduler's notice before preemption) and SIGINT (Ctrl-C) are handled alike. Inside
``StopSignals`` (the Trainer's loop) either one only sets a flag. The ranks agree on the flag at
the end of the step (one small all-reduce that also carries the non-finite verdict), save a
checkpoint (``checkpoint.save_on_exit``), wait for each other, and exit together: every rank logs
one line, ``SIGINT: stopped at step N after saving a checkpoint``, and exits with 128 + the
signal's number (130 for SIGINT, 143 for SIGTERM), the shell's convention for "ended by that
signal". A rank that received nothing itself (the signal reached another rank only) says so and
exits with 143. Outside the loop (setup, the final save) SIGINT raises KeyboardInterrupt, which
the CLI turns into one line and exit code 130; SIGTERM keeps its default action there.

One stop often arrives twice:

* torchrun's agent, on SIGINT or SIGTERM, forwards the signal it received to every worker
  (``os.killpg``), waits for them up to its shutdown timeout (30 s by default; torchrun's
  ``--shutdown-timeout`` or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), then SIGKILLs what is left: the
  stop's checkpoint must be written within that time. torchrun (torch 2.14) starts each worker
  in a session of its own, so a terminal's Ctrl-C reaches the agent only and each worker gets one
  SIGINT; with launchers that leave the workers in the terminal's process group (a shell
  pipeline, other torch versions) a worker gets the terminal's SIGINT and then the launcher's
  SIGINT or SIGTERM.
* Slurm signals every process of a job step, the agent included, which forwards its own copy.

Hence the rule for a second signal: a stop signal of either kind that arrives within
``REPEAT_AFTER_S`` (3 s) of the first is the same stop delivered twice, and is ignored. One that
arrives later means the first was not enough (a rank stuck before the step's agreement, a save
that takes too long, a user who wants out now): the process ends at once, without a checkpoint,
with exit code 128 + that signal. A watcher thread reads the signals from
``signal.set_wakeup_fd``, so this works while the main thread is blocked in a collective, where
Python-level handlers cannot run. Processes forked inside (a data loader's workers, which share
the worker's process group and so get torchrun's signal too) keep ignoring stop signals: the
loop ends them when it leaves.

Exit codes, measured with 2 ranks under ``torchrun --standalone`` (torch 2.14, gloo):

| event | each worker | torchrun itself |
| --- | --- | --- |
| SIGINT to the agent (Ctrl-C), or to its process group | 130 | 1 (its SignalException traceback) |
| SIGTERM to the agent | 143 | 1 (its SignalException traceback) |
| SIGINT / SIGTERM to one worker only | 130 / 143 there, 143 on the others | 1 (ChildFailedError) |
| a second SIGINT to the agent, over 3 s later | 143 at once: the agent SIGTERMs them | 1 |
| a second stop signal to a worker, over 3 s later | 128 + that signal, at once | 1 |
| SIGKILL to the agent | killed by SIGKILL (parent-death signal) | -9 (the shell's 137) |

Without torchrun (``python -m sdnet_trainer``) the process's own code is the exit status: 130
after SIGINT, 143 after SIGTERM. When only some workers were signalled, torchrun stops the others
as soon as the first one exits, so a rank still tearing down may read as ended by SIGTERM; the
checkpoint is committed before any rank leaves (``StopSignals.exit`` waits for all of them).

Workers that die with their launcher
------------------------------------
A worker whose torchrun agent is SIGKILLed is re-parented (to PID 1 or a subreaper) and would go
on training unsupervised, writing checkpoints. ``die_with_launcher`` asks Linux to SIGKILL the
worker when its parent dies (``prctl(PR_SET_PDEATHSIG)``), so no checkpoint is committed after the
agent is lost. The parent may die between the fork and that call: the parent recorded when this
module was imported must still be the parent right after it, else the process ends at once. The
kernel sends the death signal when the parent *thread* that forked the worker exits; torchrun
forks from its main thread. Other systems: nothing is done.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Union

logger = logging.getLogger(__name__)

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: the shell's convention for "ended by SIGINT"
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: the shell's convention for "ended by SIGTERM"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_AFTER_S = 3.0  # a stop signal within this time of the first is the same stop again

_Handler = Union[Callable[[int, Union[FrameType, None]], Any], int, signal.Handlers, None]


class StopSignals:
    """Context manager: while inside, SIGTERM and SIGINT only set ``received``; the previous
    handlers come back on exit. A stop signal more than ``repeat_after_s`` after the first ends
    the process at once (see the module's docstring). Only the main thread can handle signals:
    entered from another thread, it does nothing."""

    def __init__(self, *, repeat_after_s: float = REPEAT_AFTER_S) -> None:
        self.repeat_after_s = repeat_after_s
        self.signum: int | None = None  # the first stop signal this process received
        self._previous: dict[int, _Handler] = {}
        self._previous_wakeup_fd = -1
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self._watcher: threading.Thread | None = None

    @property
    def received(self) -> bool:
        """Whether this process received a stop signal."""
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Main thread, between two bytecodes. The watcher thread sees the same signal through the
        # wakeup socket and decides about repeats; here only the first one is recorded, so that
        # the step's agreement reads it without waiting for the watcher.
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            logger.debug("stop signals are handled only when the loop runs in the main thread")
            return self
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # set_wakeup_fd needs a non-blocking descriptor
        self._sockets = (reader, writer)
        self._watcher = threading.Thread(
            target=self._watch, args=(reader,), name="stop-signals", daemon=True
        )
        self._watcher.start()
        self._previous_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        global _active
        _active = self
        return self

    def __exit__(self, *exc: object) -> None:
        if self._sockets is None:
            return
        global _active
        _active = None
        for signum, handler in self._previous.items():
            # None: a handler installed from C, which Python cannot reinstall; the default then.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        reader, writer = self._sockets
        self._sockets = None
        writer.close()  # the watcher's recv returns b"": it ends
        if self._watcher is not None:
            self._watcher.join(timeout=5.0)
            self._watcher = None
        reader.close()

    def _watch(self, reader: socket.socket) -> None:
        """Every signal with a Python handler writes its number to the wakeup socket from C, at
        once, whatever the main thread is doing."""
        first_at: float | None = None
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            self._forward(data)
            now = time.monotonic()
            for signum in data:
                if signum not in STOP_SIGNALS:
                    continue
                if first_at is None:
                    first_at = now
                    if self.signum is None:
                        self.signum = signum
                elif now - first_at >= self.repeat_after_s:
                    self._end_now(signum, after_s=now - first_at)

    def _forward(self, data: bytes) -> None:
        """Keep a wakeup descriptor that was set before (an event loop's) informed."""
        if self._previous_wakeup_fd >= 0:
            try:
                os.write(self._previous_wakeup_fd, data)
            except OSError:
                pass

    def _end_now(self, signum: int, *, after_s: float) -> None:
        name = signal.Signals(signum).name
        logger.warning(
            "%s %.1f s after the first stop signal: ending at once, without a checkpoint",
            name,
            after_s,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(128 + signum)

    def exit(self, step: int, *, saved: bool) -> None:
        """Leave the run after the ranks agreed on a stop signal (received here or on another
        rank): one line, wait for the other ranks (so none leaves before rank 0 committed the
        checkpoint: torchrun stops the rest as soon as one worker exits non-zero), then
        ``SystemExit`` with 128 + the signal."""
        done = " after saving a checkpoint" if saved else ""
        if self.signum is not None:
            name = signal.Signals(self.signum).name
            logger.warning("%s: stopped at step %d%s", name, step, done)
            code = 128 + self.signum
        else:
            logger.warning("stop signal on another rank: stopped at step %d%s", step, done)
            code = EXIT_TERMINATED
        _wait_for_other_ranks()
        raise SystemExit(code)


_active: StopSignals | None = None  # the instance whose handlers are installed


def _detach_forked_child() -> None:
    """In a process forked inside ``StopSignals`` (a data loader's worker): keep ignoring stop
    signals (the parent decides when its workers end), but leave the parent's watcher alone, which
    would otherwise count this process's signals as its own."""
    stop = _active
    if stop is None or stop._sockets is None:
        return
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread
        pass
    for sock in stop._sockets:
        sock.close()
    stop._sockets = None
    stop._watcher = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_detach_forked_child)


def _wait_for_other_ranks() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------- dying with the launcher

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PARENT_AT_IMPORT = os.getppid()
_bound_to: int | None = None


def launched_by_torchrun() -> bool:
    """torchrun's agent (torch.distributed.elastic) sets these for every worker it starts."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "TORCHELASTIC_RESTART_COUNT" in os.environ


def die_with_launcher() -> bool:
    """Under torchrun on Linux: have the kernel SIGKILL this process when its parent (the agent)
    dies; end at once if the parent is already gone. True if the death signal is set. Safe to call
    more than once."""
    global _bound_to
    if _bound_to is not None:
        return True
    if not sys.platform.startswith("linux") or not launched_by_torchrun():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        logger.debug("prctl is not available: workers will not die with their launcher")
        return False
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    if prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        logger.debug("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
        return False
    parent = os.getppid()
    if parent != _PARENT_AT_IMPORT or (parent == 1 and not _pid1_is_python()):
        # The launcher died before the death signal was set: behave as if it had come.
        os.write(2, f"the launcher (pid {_PARENT_AT_IMPORT}) is gone: exiting\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
    _bound_to = parent
    return True


def _pid1_is_python() -> bool:
    """Parent 1 is the launcher itself when torchrun is a container's first process; otherwise
    (init, tini, systemd) the worker was re-parented before it could record its launcher."""
    try:
        with open("/proc/1/cmdline", "rb") as file:
            command = file.read()
    except OSError:
        return True  # cannot tell: do not end a worker that may be fine
    return b"python" in command or b"torch" in command
