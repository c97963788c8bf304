"""Sets up the real Trainer on ``model.weights=hf:PATH`` configs, one after another in one process
group, and reports what each rank read of the folder and the weights the model then holds.

    torchrun --standalone --nproc_per_node=N tests/distributed/_hf_load_worker.py OUT CASES

``CASES``: a JSON file, {case: [override, ...]}. Every block a rank reads goes through DCP's
Hugging Face reader's ``_process_read_request`` (the stock reader's, which the project's reader
keeps): each is recorded as (tensor, offsets, lengths). Rank 0 writes ``OUT/<case>.pt``: per rank,
its reads and the model's tensors it holds whole (a DTensor's gathered with ``full_tensor``;
under pipeline parallelism only its stage's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor

from sdnet_trainer import Trainer
from sdnet_trainer.config import compose
from sdnet_trainer.config.schema import DistConfig
from sdnet_trainer.distributed import distributed_session
from sdnet_trainer.distributed.ops import all_gather_objects
from sdnet_trainer.lazy import freeze_imports
from sdnet_trainer.preflight import validate

READS: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
_STOCK = HuggingFaceStorageReader._process_read_request


def _recorded(self, f, req, planner) -> None:  # type: ignore[no-untyped-def]
    READS.append((req.storage_index.fqn, tuple(req.storage_offsets), tuple(req.lengths)))
    _STOCK(self, f, req, planner)


def main(out: Path, cases: dict[str, list[str]]) -> None:
    HuggingFaceStorageReader._process_read_request = _recorded  # type: ignore[method-assign]
    with distributed_session(DistConfig(device="cpu")) as env:
        for case, overrides in cases.items():
            cfg = compose(overrides)
            validate(cfg, world_size=env.world_size)
            READS.clear()
            trainer = Trainer(cfg, output_dir=out / case, env=env)
            try:
                trainer.setup()
                held = {}
                for name, value in trainer.model.state_dict().items():
                    whole = value.full_tensor() if isinstance(value, DTensor) else value
                    if not whole.is_meta:
                        held[name] = whole.detach().cpu().clone()
                ranks = all_gather_objects({"reads": list(READS), "tensors": held})
            finally:
                trainer.close()
            if env.is_main:
                torch.save(ranks, out / f"{case}.pt")


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
