"""OmegaConf resolvers that keep every rank of one launch writing to the same run directory.

Each torchrun worker composes the config on its own, so anything time-based in a path must come
from something all ranks share rather than from each process's own clock.
"""

from __future__ import annotations

import os
import time
from datetime import datetime

from omegaconf import OmegaConf

_STAMP_FORMAT = "%Y-%m-%d_%H-%M-%S"


def _process_start_time(pid: int) -> float | None:
    """Wall-clock start time of ``pid`` from /proc (Linux); None where that is not readable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # Field 22 (1-based) is the start time in clock ticks after boot; the command name in
            # field 2 may contain spaces, so split after its closing parenthesis.
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


def run_id() -> str:
    """The id of this launch, identical on every rank and across torchrun restarts.

    1. ``SDNET_RUN_ID`` when set (e.g. a SLURM job id).
    2. On several nodes, torchrun's ``--rdzv-id``: the only value all nodes share.
    3. Under torchrun on one node, the start time of the torchrun agent (every local rank's
       parent, which outlives worker restarts), so restarted workers find the same directory.
    4. Otherwise, the time now.
    """
    if os.environ.get("SDNET_RUN_ID"):
        return os.environ["SDNET_RUN_ID"]
    rdzv_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if rdzv_id and rdzv_id != "none" and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        return rdzv_id
    started = _process_start_time(os.getppid()) if rdzv_id is not None else None
    return datetime.fromtimestamp(started if started is not None else time.time()).strftime(
        _STAMP_FORMAT
    )


def rank0_only(value: str) -> str | None:
    """``value`` on global rank 0, None elsewhere (Hydra skips writing .hydra/ on a None subdir)."""
    return value if os.environ.get("RANK", "0") == "0" else None


def register_resolvers() -> None:
    # use_cache: the id must not change between the run dir and the run.id field of one process.
    if not OmegaConf.has_resolver("sdnet.run_id"):
        OmegaConf.register_new_resolver("sdnet.run_id", run_id, use_cache=True)
    if not OmegaConf.has_resolver("sdnet.rank0_only"):
        OmegaConf.register_new_resolver("sdnet.rank0_only", rank0_only)
