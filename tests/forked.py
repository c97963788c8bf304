"""Launches without an interpreter's start-up: ``python -m sdnet_trainer`` (or another of the
project's commands, or a script) and N-process worlds of it, forked from a server that has
imported torch and the project once.

A launch through ``torchrun -m sdnet_trainer`` starts three interpreters that each import torch
and the project: about 20 CPU-seconds before the first step on the 2-core test machines, more
than most tests' training. The tests whose subject is not the launcher (a layout, a resume, a
fault inside the training loop) start their processes here instead: Python's forkserver, with
``tests.support`` and the CLI preloaded, forks each rank already imported. Each rank gets the
variables a scheduler that starts processes without torchrun sets (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and SDNET_RUN_ID, which the project
derives from ``srun``'s and submitit's job ids), runs the command's ``__main__`` as the
interpreter would, and exits with its code. What torchrun's agent does for a failed world, this
does too: when one rank exits non-zero, the others get SIGTERM, then SIGKILL 30 s later.

What a fork shares that fresh interpreters would not: the seed of ``str`` hashes (every rank,
and every launch of a pytest worker, has the server's); and a rank leaves without the
interpreter's finalization. The tests of the launcher itself (signals to torchrun's agent, its
death, its restarts, the rendezvous of several agents, its failure summary), of the command line
as a user types it, and the CUDA tests start the real command: ``run_cli(..., fork=False)`` in
tests/support.py; the bitwise resumes after a signal to torchrun or a killed rank restarted by
it run their stopped leg there.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import io
import itertools
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from pathlib import Path

from tests.support import Launch, cli_env, free_port

# As torchrun's agent: it looks at its workers every MONITOR_S; after a failure it sends the
# others SIGTERM, and SIGKILL TERMINATE_GRACE_S later. A forked rank leaves without the
# interpreter's finalization, a fraction of a second sooner than under torchrun: its peers get
# FAILED_GRACE_S before the SIGTERM, so that ranks failing together each finish saying why.
MONITOR_S = 0.1
FAILED_GRACE_S = 1.0
TERMINATE_GRACE_S = 30.0

# The variables torchrun's agent sets for its workers, left out of a rank's environment (a shell
# inside a torchrun job has them): a rank started here is not torchrun's worker, and must not bind
# its life to a parent it lacks.
_TORCHRUN = ("TORCHELASTIC_", "GROUP_", "ROLE_")

_SERVER = multiprocessing.get_context("forkserver")
# Imported once in the fork server (per pytest process): torch, the project and its CLI (Hydra),
# and the recording Trainers the tests name as trainer._target_; then what a training rank imports
# on its way anyway, a second or two each: torch._dynamo (torch's optimizers import it when the
# first is built), torchvision (image data, ResNets) and transformers (Hugging Face folders).
# The test of what the CLI leaves out starts a fresh interpreter (test_lazy_imports, fork=False).
# A module that is not installed is left out (the fork server skips an ImportError).
_SERVER.set_forkserver_preload(
    ["tests.support", "sdnet_trainer.cli", "torch._dynamo", "torchvision", "transformers"]
)

_WORLDS = itertools.count()  # numbers this process's N-process launches for their run ids

# Launches still running: killed when this process exits (an interrupted pytest), before
# multiprocessing's own exit handler would wait for them to finish.
_LIVE: weakref.WeakSet[ForkedLaunch] = weakref.WeakSet()


@atexit.register
def _kill_live() -> None:
    for launch in list(_LIVE):
        launch.kill()


def _interpreter_exit_code(ended: SystemExit) -> int:
    """The interpreter's rule: None is 0, an int itself, anything else is printed and is 1."""
    if ended.code is None:
        return 0
    if isinstance(ended.code, int):
        return ended.code & 0xFF
    print(ended.code, file=sys.stderr)
    return 1


def _rank_main(
    target: str,
    args: list[str],
    env: dict[str, str],
    cwd: str,
    log: str,
    err_log: str | None = None,
    warnings_as_errors: bool = False,
):
    """In the forked rank: what ``python -m TARGET ARGS`` (or ``python TARGET.py ARGS``) would
    do, in a session of its own (a kill of its group reaches its DataLoader workers), output to
    ``log`` (stderr to ``err_log`` where given); ``warnings_as_errors``: as ``python -W error``
    for what runs after the fork (runpy's own warnings and the command's imports and run)."""
    os.setsid()
    # The start method of a new interpreter (the fork server's children inherit its own): the
    # DataLoader's workers are forked from the rank, as they would be.
    multiprocessing.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    out = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    if err_log is not None:
        os.close(out)
        out = os.open(err_log, os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 2)
    os.close(out)
    # PYTHONUNBUFFERED, as cli_env sets for a launched interpreter: lines reach the log in order.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
    )
    # A rank that dies of a fatal signal (SIGSEGV, SIGABRT) leaves its Python stacks in the log,
    # where the test's failure shows them, instead of only an exit code of -11.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if warnings_as_errors:
        warnings.simplefilter("error")
    try:
        if target.endswith(".py"):
            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = ["-m", *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as ended:
        code = _interpreter_exit_code(ended)
    except BaseException:
        traceback.print_exc()
        code = 1
    # The interpreter's own shutdown: join the threads that are not daemons (an asynchronous
    # checkpoint's writer), then the atexit functions; then leave without the fork server's.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    os._exit(code)


class ForkedLaunch:
    """A started launch: ``python -m sdnet_trainer ARGS`` (nproc None) or an ``nproc``-process
    world of it, each rank forked ready-imported in a session of its own, output appended to
    ``log`` (stderr to ``err_log`` where given); ``module`` (another of the project's commands,
    ``sdnet_trainer.data.shards``) or ``script`` (a .py file) replaces ``-m sdnet_trainer``. Its
    exit code is the first failed rank's own (torchrun would say 1), 0 when every rank
    succeeded."""

    def __init__(
        self,
        args: list[str],
        *,
        cwd: Path,
        log: Path,
        nproc: int | None = None,
        script: Path | None = None,
        module: str = "sdnet_trainer",
        env: dict[str, str] | None = None,
        err_log: Path | None = None,
        warnings_as_errors: bool = False,
    ) -> None:
        target = str(script) if script else module
        self.what = " ".join([target, *args])
        self.returncode: int | None = None
        self._failed_at: float | None = None
        self._code = 0
        self._terminated = False
        base = {
            k: v for k, v in {**cli_env(), **(env or {})}.items() if not k.startswith(_TORCHRUN)
        }
        ranks: list[dict[str, str]] = [{}]
        if nproc is not None:
            port = str(free_port())
            # What srun's job id gives every task (sdnet_trainer.distributed.launchers): one run
            # id for the world, which each rank would otherwise take from its own clock.
            base.setdefault("SDNET_RUN_ID", f"forked-{os.getpid()}-{next(_WORLDS)}")
            ranks = [
                {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(nproc),
                    "LOCAL_WORLD_SIZE": str(nproc),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                }
                for rank in range(nproc)
            ]
        Path(log).touch()
        if err_log is not None:
            Path(err_log).touch()
        self.ranks: list = []
        _LIVE.add(self)
        try:
            for rank_env in ranks:
                proc = _SERVER.Process(
                    target=_rank_main,
                    args=(target, args, {**base, **rank_env}, str(cwd), str(log)),
                    kwargs={
                        "err_log": None if err_log is None else str(err_log),
                        "warnings_as_errors": warnings_as_errors,
                    },
                )
                proc.start()
                self.ranks.append(proc)
        except BaseException:
            self.kill()
            raise

    def poll(self) -> int | None:
        """One look, as torchrun's agent takes every MONITOR_S: after the first failure the other
        ranks get SIGTERM (FAILED_GRACE_S later), then SIGKILL. The exit code once all ended."""
        if self.returncode is not None:
            return self.returncode
        codes = [proc.exitcode for proc in self.ranks]
        now = time.monotonic()
        if self._failed_at is None:
            failed = [code for code in codes if code not in (None, 0)]
            if failed:
                self._failed_at, self._code = now, failed[0]
        elif now > self._failed_at + FAILED_GRACE_S + TERMINATE_GRACE_S:
            self._signal(signal.SIGKILL)
        elif now > self._failed_at + FAILED_GRACE_S and not self._terminated:
            self._signal(signal.SIGTERM)  # once: a repeated stop signal ends a rank at once
            self._terminated = True
        if any(code is None for code in codes):
            return None
        _LIVE.discard(self)
        self.returncode = self._code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; subprocess.TimeoutExpired after ``timeout`` seconds (the ranks run on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.what, timeout or 0)
            time.sleep(MONITOR_S)
        return code

    def kill(self) -> None:
        """SIGKILL every rank's session (the rank and its DataLoader workers); wait for them."""
        self._signal(signal.SIGKILL)
        for proc in self.ranks:
            proc.join(timeout=TERMINATE_GRACE_S)
        _LIVE.discard(self)

    def _signal(self, signum: int) -> None:
        for proc in self.ranks:
            if proc.exitcode is None:
                try:
                    os.killpg(proc.pid, signum)  # its session: the rank and its loader workers
                except ProcessLookupError:  # forked, but not yet in a session of its own
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signum)


def run_forked(
    args: list[str],
    *,
    cwd: Path,
    nproc: int | None = None,
    script: Path | None = None,
    module: str = "sdnet_trainer",
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> Launch:
    """run_cli's launch, forked ready-imported (``ForkedLaunch``): the exit code is the first
    failed rank's own, the output every rank's, interleaved. The whole world is killed on
    timeout. ``module``: ``python -m MODULE``, another of the project's commands."""
    fd, name = tempfile.mkstemp(prefix="forked-", suffix=".log")
    os.close(fd)
    log = Path(name)
    try:
        launch = ForkedLaunch(
            args, cwd=cwd, log=log, nproc=nproc, script=script, module=module, env=env
        )
        return Launch(waited(launch, timeout, log), log.read_text(errors="replace"))
    finally:
        log.unlink(missing_ok=True)


def run_module_apart(
    module: str,
    args: list[str],
    *,
    cwd: Path,
    timeout: float = 120,
    warnings_as_errors: bool = False,
) -> subprocess.CompletedProcess:
    """``python [-W error] -m MODULE ARGS`` forked ready-imported, one process, with stdout and
    stderr apart, as ``subprocess.run(..., capture_output=True, text=True)`` returns them: for the
    tests of a command's own output (its report, its help, nothing on stderr) rather than of the
    interpreter's start-up. ``warnings_as_errors``: any warning raised after the fork (runpy's,
    the command's imports and run) is an error, as under ``-W error``."""
    logs = []
    for name in ("out", "err"):
        fd, path = tempfile.mkstemp(prefix=f"forked-{name}-", suffix=".log")
        os.close(fd)
        logs.append(Path(path))
    out, err = logs
    try:
        launch = ForkedLaunch(
            args,
            cwd=cwd,
            log=out,
            module=module,
            err_log=err,
            warnings_as_errors=warnings_as_errors,
        )
        code = waited(launch, timeout, out, err)
        return subprocess.CompletedProcess(
            ["-m", module, *args],
            code,
            out.read_text(errors="replace"),
            err.read_text(errors="replace"),
        )
    finally:
        for log in logs:
            log.unlink(missing_ok=True)


def waited(launch: ForkedLaunch, timeout: float, *logs: Path) -> int:
    """The launch's exit code; killed, and an AssertionError with its ``logs``, after ``timeout``
    seconds (killed on any other exception too, an interrupted test's)."""
    try:
        return launch.wait(timeout)
    except BaseException as exc:
        launch.kill()
        if isinstance(exc, subprocess.TimeoutExpired):
            output = "".join(log.read_text(errors="replace") for log in logs)
            raise AssertionError(f"timed out after {timeout} s: {launch.what}\n{output}") from None
        raise
