"""The tests' forked launches (tests/forked.py): ranks start ready-imported, with the variables of a
world; a failed rank ends the world with its own exit code, as torchrun's agent would end it; a
timeout kills every rank."""

from __future__ import annotations

import os
import time

import pytest

from tests.support import process_command, run_cli

# Each rank says what it was given and what it found imported, then rank 1 fails with 3 while
# rank 0 would sleep a minute.
WORKER = """
import os, sys, time
rank = int(os.environ["RANK"])
ready = all(name in sys.modules for name in ("torch", "sdnet_trainer.cli", "tests.support"))
print(f"rank {rank} of {os.environ['WORLD_SIZE']} pid {os.getpid()} ready-imported {ready}")
if rank == 1:
    sys.exit(3)
time.sleep(60)
"""


def _pids(output: str) -> list[int]:
    return [
        int(line.split(" pid ")[1].split()[0]) for line in output.splitlines() if " pid " in line
    ]


def test_a_failed_rank_ends_the_world_with_its_own_exit_code(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    started = time.monotonic()
    run = run_cli([], cwd=tmp_path, nproc=2, script=script, timeout=120)
    assert run.returncode == 3, run.output
    assert time.monotonic() - started < 30  # rank 0 was ended (SIGTERM), not left to sleep
    for rank in (0, 1):  # forked from the server that imported torch and the project
        assert f"rank {rank} of 2 pid" in run.output and "ready-imported True" in run.output
    pids = _pids(run.output)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert all(process_command(pid) is None for pid in pids)


def test_a_timeout_kills_every_rank(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.replace("sys.exit(3)", "time.sleep(60)"))
    with pytest.raises(AssertionError, match="timed out after 5 s") as failed:
        run_cli([], cwd=tmp_path, nproc=2, script=script, timeout=5)
    pids = _pids(str(failed.value))
    assert len(pids) == 2
    assert all(process_command(pid) is None for pid in pids)
