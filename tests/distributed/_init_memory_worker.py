"""Sets up the real Trainer for a large model and reports each rank's peak memory.

    torchrun --standalone --nproc_per_node=N tests/distributed/_init_memory_worker.py OUT ARGS...

Rank 0 writes ``OUT/memory.json``: the model's parameter count and fp32 bytes, and every rank's
peak resident set size (``ru_maxrss``, the whole process's lifetime: imports, process group,
building, parallelizing and initialising the model, data and optimizer setup) and the bytes of
parameters it holds after setup.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.config.schema import DistConfig
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.distributed.ops import all_gather_objects
from sdnet_trainer.lazy import freeze_imports
from sdnet_trainer.preflight import validate


def _local_bytes(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def main(out: Path, overrides: list[str]) -> None:
    with distributed_session(DistConfig()) as env:
        cfg = compose(overrides)
        validate(cfg, world_size=env.world_size)
        trainer = Trainer(cfg, output_dir=out, env=env)
        try:
            trainer.setup()
            mine = {
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "param_bytes": _local_bytes(trainer.model),
                "finite": all(
                    bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all())
                    for p in trainer.model.parameters()
                ),
            }
            ranks = all_gather_objects(mine)
        finally:
            trainer.close()
        if env.is_main:
            record = {
                "num_parameters": trainer.num_parameters,
                "full_fp32_bytes": trainer.num_parameters * 4,
                "ranks": ranks,
            }
            (out / "memory.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main(Path(sys.argv[1]), sys.argv[2:])
