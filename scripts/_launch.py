"""Running one launch (torchrun and its workers) from a benchmark script.

The launch gets its own session, so a timeout kills torchrun and every worker it started, and
one thread per process (the benchmarks run several processes on a few cores).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class LaunchError(RuntimeError):
    pass


def torchrun(nproc: int, *args: str) -> list[str]:
    """The command line of a single-node torchrun with ``nproc`` workers (free port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def run_launch(cmd: list[str], log_path: Path, timeout: float) -> None:
    """Run ``cmd`` to completion from the repository root, output to ``log_path``; raise
    LaunchError with the log's tail on a non-zero exit or a timeout."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise LaunchError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n(see {log_path})") from None
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise LaunchError(f"exit code {rc}: {' '.join(cmd)}\n" + "\n".join(tail))
