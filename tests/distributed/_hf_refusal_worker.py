"""Sets up the real Trainer on configs that must be refused, one after another in one process
group, and reports what each rank said and its peak memory.

    torchrun --standalone --nproc_per_node=N tests/distributed/_hf_refusal_worker.py OUT CASES
    python tests/distributed/_hf_refusal_worker.py OUT CASES        # one process

``CASES``: a JSON file, {case: [override, ...]}. Each case is validated as a launch validates it,
then set up; a ConfigError is its refusal. Rank 0 writes ``OUT/refusals.json``: per rank, each
case's message (null where the case was not refused) and the process's peak resident memory
(``ru_maxrss``: its whole life, every case included).
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.config.schema import DistConfig
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.distributed.ops import all_gather_objects
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.lazy import freeze_imports
from sdnet_trainer.preflight import validate


def main(out: Path, cases: dict[str, list[str]]) -> None:
    with distributed_session(DistConfig(device="cpu")) as env:
        said: dict[str, str | None] = {}
        for case, overrides in cases.items():
            cfg = compose(overrides)
            try:
                validate(cfg, world_size=env.world_size)
                trainer = Trainer(cfg, output_dir=out / case, env=env)
                trainer.setup()
            except ConfigError as err:
                said[case] = str(err)
            else:
                said[case] = None
                trainer.close()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        ranks = all_gather_objects({"rank": env.rank, "said": said, "peak_rss_bytes": peak})
        if env.is_main:
            (out / "refusals.json").write_text(json.dumps(ranks, indent=1))


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
