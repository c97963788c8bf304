"""Worker for tests/distributed/test_health_procs.py, launched by torchrun with two ranks.

    _health_worker.py OUT_DIR

Two scenarios in one launch (a launch costs seconds of imports): first each rank writes what
``agree_nonfinite`` returned to OUT_DIR/agree_rank{R}.json, then rank 0 blocks in an all_reduce
that rank 1 never joins. The process group's timeout is 300 s, so only the watchdog (2 s) can
end the run.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from sdnet_trainer.health import PhaseTracker, Watchdog, agree_nonfinite, hang_log_path, nonfinite_flag

HANG_TIMEOUT_S = 2.0
PG_TIMEOUT_S = 300.0


def agree(out_dir: Path, rank: int) -> None:
    grads = [torch.ones(3), None, torch.zeros(2, 2)]
    # Only rank 1's loss is NaN; the gradients are finite everywhere.
    nan_loss = torch.tensor(float("nan") if rank == 1 else 0.5)
    local = nonfinite_flag(nan_loss, grads)
    result = {"local": local.item(), "nan_on_rank1": agree_nonfinite(local),
              "clean": agree_nonfinite(nonfinite_flag(torch.tensor(0.5), grads))}
    (out_dir / f"agree_rank{rank}.json").write_text(json.dumps(result))


def straggle_in_forward(seconds: float) -> None:
    time.sleep(seconds)


def hang(out_dir: Path, rank: int) -> None:
    phase = PhaseTracker()
    dist.barrier()
    watchdog = Watchdog(HANG_TIMEOUT_S, rank=rank, log_file=hang_log_path(out_dir, rank),
                        describe=phase.describe)
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
        agree(out_dir, dist.get_rank())
        hang(out_dir, dist.get_rank())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
