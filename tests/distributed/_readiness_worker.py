"""Worker for tests/distributed/test_readiness_procs.py, on two ranks (gloo).

    python -m torch.distributed.run --standalone --nproc_per_node=2 _readiness_worker.py OUT_DIR

One launch, two scenarios; each rank saves what the test checks to OUT_DIR/rank{R}.pt:

1. ``GradientComm.release``: after it, the wrapper no longer keeps the DDP model alive.
2. ``shorten_timeout``: the group starts with dist.timeout_s=1800; after shortening to 2 s a
   collective that rank 0 never joins fails on rank 1 within seconds, on the default group and on
   a group passed explicitly. Rank 0 waits for rank 1's result file, then leaves.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from sdnet_trainer.config.schema import CommConfig, DistConfig, PowerSGDConfig
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.distributed.comm import GradientComm
from sdnet_trainer.distributed.env import shorten_timeout
from sdnet_trainer.lazy import freeze_imports

SHORT_TIMEOUT_S = 2.0


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _release() -> dict[str, Any]:
    ddp = DistributedDataParallel(_mlp())
    comm = GradientComm(ddp, CommConfig(hook="powersgd", powersgd=PowerSGDConfig(rank=1)))
    alive = weakref.ref(ddp)
    del ddp
    gc.collect()
    kept_before = alive() is not None  # the wrapper holds the model
    comm.release()
    gc.collect()
    return {"kept_before_release": kept_before, "kept_after_release": alive() is not None}


def _timeouts(rank: int, out_dir: Path) -> dict[str, Any]:
    pair = dist.new_group([0, 1])
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    dist.barrier()
    shorten_timeout(SHORT_TIMEOUT_S, mesh=mesh, groups=[pair])
    done = out_dir / "timeouts_done"
    if rank == 0:  # joins nothing: rank 1's collectives can only time out
        deadline = time.monotonic() + 120
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return {}
    results: dict[str, Any] = {}
    for name, group in (("pair", pair), ("world", None)):
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            results[name] = ("completed", time.monotonic() - started)
        except Exception as err:  # gloo raises RuntimeError (DistBackendError) on a timeout
            results[name] = (f"{type(err).__name__}: {err}", time.monotonic() - started)
    return results


def main(out_dir: Path) -> None:
    # A timed-out gloo group cannot be torn down cleanly: leave without destroying it.
    with distributed_session(DistConfig(device="cpu", timeout_s=1800)) as env:
        results = {"release": _release()}
        dist.barrier()
        results["timeouts"] = _timeouts(env.rank, out_dir)
        torch.save(results, out_dir / f"rank{env.rank}.pt")
        if env.rank == 1:
            (out_dir / "timeouts_done").touch()
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main(Path(sys.argv[1]))
