"""sdnet_trainer.training.health across two real ranks (gloo on CPU).

One launch of tests/distributed/_health_worker.py, its two ranks forked ready-imported
(tests/forked.py: the launcher is not the subject here; torchrun's failure summary is read in
tests/e2e/test_cli.py): the ranks hang (rank 0 in an all_reduce, rank 1 asleep in its "forward")
until the watchdog ends them, far sooner than the process group's 300 s timeout would. Each
rank's own exit status is read from its process. (Agreement on non-finite values across ranks is
tested through the Trainer in tests/distributed/test_faults.py.)
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed._health_worker import HANG_TIMEOUT_S, PG_TIMEOUT_S
from tests.forked import ForkedLaunch, waited

WORKER = Path(__file__).with_name("_health_worker.py")
# From the watchdogs' start to the launch's end: the timeout, then the launcher noticing (it looks
# every 0.1 s, as torchrun's agent does), SIGTERMing rank 1 a second later and reaping it.
EXIT_SLACK_S = 8.0


@dataclass
class HealthRun:
    returncode: int  # the launch's: the first failed rank's own
    # Each rank's exit status from its process (minus a signal's number: killed by it).
    codes: dict[int, int | None]
    output: str
    out_dir: Path
    seconds_after_armed: float  # from the first watchdog's start to the launch's end
    wall_s: float


@pytest.fixture(scope="module")
def health_run(tmp_path_factory) -> HealthRun:
    out_dir = tmp_path_factory.mktemp("health")
    log = out_dir / "launch.log"
    started = time.monotonic()
    launch = ForkedLaunch([str(out_dir)], cwd=out_dir, log=log, nproc=2, script=WORKER)
    returncode = waited(launch, 120, log)
    ended = time.monotonic()
    output = log.read_text(errors="replace")
    codes = {rank: proc.exitcode for rank, proc in enumerate(launch.ranks)}
    # CLOCK_MONOTONIC is system-wide on Linux, so the workers' stamps compare with ours.
    armed = [float(t) for t in re.findall(r"rank \d armed at ([\d.]+)", output)]
    assert len(armed) == 2, output
    return HealthRun(returncode, codes, output, out_dir, ended - min(armed), ended - started)


def test_watchdog_ends_every_rank_of_a_hung_group(health_run):
    output = health_run.output
    assert health_run.returncode != 0, output
    # Rank 0's watchdog fired (exit 4); the launcher then SIGTERMed rank 1. Both failed.
    codes = health_run.codes
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
    # Rank 1's stacks, dumped on the launcher's SIGTERM (or by its own watchdog, had that come
    # first).
    rank1 = (health_run.out_dir / "hang_rank1.log").read_text()
    assert "in straggle_in_forward" in rank1, rank1
