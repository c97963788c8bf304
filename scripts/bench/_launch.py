"""Running one launch (torchrun and its workers) from a benchmark script.

The launch gets its own session, so a timeout kills torchrun and every worker it started, and
one thread per process (the benchmarks run several processes on a few cores).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class LaunchError(RuntimeError):
    pass


class LaunchTimeout(LaunchError):
    """The launch was still running when its time ran out: cut short, not failed (what it
    finished before may still be in its output)."""


def torchrun(nproc: int, *args: str) -> list[str]:
    """The command line of a single-node torchrun with ``nproc`` workers (free port)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *args,
    ]


def run_launch(cmd: list[str], log_path: Path, timeout: float) -> None:
    """Run ``cmd`` to completion from the repository root, output to ``log_path``; raise
    LaunchError with the log's tail on a non-zero exit or a timeout."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except BaseException as exc:
            # The timeout, or an interruption (SIGINT from scripts/ci/gpu_check.sh, Ctrl-C): the
            # launch's own session would keep the GPU busy after the driver is gone.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise LaunchTimeout(
                    f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n(see {log_path})"
                ) from None
            raise
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise LaunchError(f"exit code {rc}: {' '.join(cmd)}\n" + "\n".join(tail))


def machine_cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has used so far (Linux /proc/stat), or None."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system [idle iowait] irq softirq steal: everything but idle time.
    return (sum(ticks[:3]) + sum(ticks[5:8])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this driver plus its finished launches (torchrun and its workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed_launch(cmd: list[str], log_path: Path, timeout: float) -> tuple[float, float | None]:
    """``run_launch``, timed.

    Returns (seconds, other_cores): the launch's wall time and how many cores other processes on
    the machine used meanwhile, on average (None where /proc/stat is unavailable). torchrun starts
    its own worker processes, so the launch gets its own process group and a timeout kills that
    whole group, not just torchrun.
    """
    machine_before, own_before = machine_cpu_seconds(), own_cpu_seconds()
    started = time.perf_counter()
    run_launch(cmd, log_path, timeout)
    seconds = time.perf_counter() - started
    machine_after = machine_cpu_seconds()
    other = None
    if machine_before is not None and machine_after is not None:
        # Everything the machine computed minus what this launch (and the driver) computed.
        foreign = (machine_after - machine_before) - (own_cpu_seconds() - own_before)
        other = max(foreign, 0.0) / seconds
    return seconds, other


def load_line(before: tuple[float, float, float], after: tuple[float, float, float]) -> str:
    """The machine's load averages around a measurement (``os.getloadavg()`` before and after),
    as the benchmarks print them: a busy machine makes a run's figures unreliable."""
    return (
        f"machine load average (1, 5, 15 min): before {before[0]:.2f} {before[1]:.2f} "
        f"{before[2]:.2f}, after {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}, "
        f"on {os.cpu_count()} CPUs"
    )
