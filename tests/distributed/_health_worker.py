"""Worker for tests/distributed/test_health_procs.py, launched as two ranks (RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set).

    _health_worker.py OUT_DIR

Rank 0 blocks in an all_reduce that rank 1 never joins. The process group's timeout is 300 s, so
only the watchdog (2 s) can end the run.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from sdnet_trainer.lazy import freeze_imports
from sdnet_trainer.training.health import PhaseTracker, Watchdog, hang_log_path

HANG_TIMEOUT_S = 2.0
PG_TIMEOUT_S = 300.0


def straggle_in_forward(seconds: float) -> None:
    time.sleep(seconds)


def hang(out_dir: Path, rank: int) -> None:
    phase = PhaseTracker()
    dist.barrier()
    watchdog = Watchdog(
        HANG_TIMEOUT_S, rank=rank, log_file=hang_log_path(out_dir, rank), describe=phase.describe
    )
    watchdog.start()
    print(f"rank {rank} armed at {time.monotonic():.3f}", flush=True)
    if rank == 0:
        phase.enter("all_reduce of the gradients", step=3)
        dist.all_reduce(torch.ones(4))  # rank 1 never joins
    else:
        phase.enter("forward", step=3)
        # One last beat puts rank 1's deadline a second after rank 0's: rank 0's watchdog fires
        # first (had rank 1 died first, gloo would fail rank 0's all_reduce with an exception).
        time.sleep(1.0)
        watchdog.beat()
        straggle_in_forward(60)
    raise AssertionError("the watchdog should have ended this process")


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    try:
        hang(out_dir, dist.get_rank())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main()
