"""sdnet_trainer.training.health across two real ranks under torchrun (gloo on CPU).

One launch of tests/distributed/_health_worker.py: the ranks hang (rank 0 in an all_reduce,
rank 1 asleep in its "forward") until the watchdog ends them, far sooner than the process
group's 300 s timeout would. (Agreement on non-finite values across ranks is tested through the
Trainer in tests/distributed/test_faults.py.)
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed._health_worker import HANG_TIMEOUT_S, PG_TIMEOUT_S
from tests.support import Launch, run_cli

WORKER = Path(__file__).with_name("_health_worker.py")
# From the watchdogs' start to torchrun's exit (imports not counted): the timeout, then torchrun
# noticing, SIGTERMing rank 1 and shutting down (about 2 s on a small machine).
EXIT_SLACK_S = 8.0


@dataclass
class HealthRun:
    launch: Launch
    out_dir: Path
    seconds_after_armed: float  # from the first watchdog's start to torchrun's exit
    wall_s: float


@pytest.fixture(scope="module")
def health_run(tmp_path_factory) -> HealthRun:
    out_dir = tmp_path_factory.mktemp("health")
    started = time.monotonic()
    launch = run_cli([str(out_dir)], cwd=out_dir, nproc=2, script=WORKER, timeout=120, fork=False)
    ended = time.monotonic()
    # CLOCK_MONOTONIC is system-wide on Linux, so the workers' stamps compare with ours.
    armed = [float(t) for t in re.findall(r"rank \d armed at ([\d.]+)", launch.output)]
    assert len(armed) == 2, launch.output
    return HealthRun(launch, out_dir, ended - min(armed), ended - started)


def _exit_codes(output: str) -> dict[int, int]:
    """Per-rank exit codes from torchrun's failure summary."""
    blocks = re.findall(
        r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", output
    )
    return {int(rank): int(code) for rank, code in blocks}


def test_watchdog_ends_every_rank_of_a_hung_group(health_run):
    output = health_run.launch.output
    assert health_run.launch.returncode != 0, output
    # Rank 0's watchdog fired (exit 4); torchrun then SIGTERMed rank 1. Both failed.
    codes = _exit_codes(output)
    assert codes.get(0) == 4, output
    assert codes.get(1) not in (None, 0), output
    assert health_run.seconds_after_armed < HANG_TIMEOUT_S + EXIT_SLACK_S, output
    assert health_run.wall_s < PG_TIMEOUT_S / 5, output

    rank0 = (health_run.out_dir / "hang_rank0.log").read_text()
    assert re.search(
        r"watchdog: rank 0 made no progress for [\d.]+ s .*"
        r"in 'all_reduce of the gradients' of step 3",
        rank0,
    ), rank0
    assert re.search(r"line \d+ in all_reduce\n", rank0), rank0  # the main thread's stack
    # Rank 1's stacks, dumped on torchrun's SIGTERM (or by its own watchdog had that come first).
    rank1 = (health_run.out_dir / "hang_rank1.log").read_text()
    assert "in straggle_in_forward" in rank1, rank1
