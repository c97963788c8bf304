"""One Trainer set-up, timed: scripts/bench/bench_start.py's run.

    python scripts/bench/_start_worker.py OUT KEY=VALUE...

Prints one JSON line: ``setup_s`` (``Trainer.setup()``'s wall time: what a run does before its
first step), ``init_s`` (the model initialisation's part of it, ``materialize`` in
``sdnet_trainer.training.trainer``) and ``package`` (where the project was imported from).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import sdnet_trainer
import sdnet_trainer.training.trainer as trainer_module
from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.distributed import DistEnv


def main(out: Path, keys: list[str]) -> None:
    init_s = 0.0
    materialize = trainer_module.materialize

    def timed(*args: Any, **kwargs: Any) -> None:
        nonlocal init_s
        started = time.perf_counter()
        materialize(*args, **kwargs)
        init_s += time.perf_counter() - started

    trainer_module.materialize = timed
    trainer = Trainer(compose(keys), output_dir=out, env=DistEnv())
    started = time.perf_counter()
    try:
        trainer.setup()
        setup_s = time.perf_counter() - started
    finally:
        trainer.close()
    package = str(Path(sdnet_trainer.__file__).parent)
    print(json.dumps({"setup_s": setup_s, "init_s": init_s, "package": package}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
