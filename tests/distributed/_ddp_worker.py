"""Trains several DDP configurations in one process group, for tests/distributed/test_ddp.py.

    torchrun --standalone --nproc_per_node=2 tests/distributed/_ddp_worker.py OUT CASES_JSON

CASES_JSON maps a case name to its config overrides, as on the command line. Each case trains in
``OUT/<name>/`` with the Trainer its ``trainer._target_`` names, as the CLI would: a
RecordingTrainer (tests/support.py) writes ``final.pt`` there itself, every Trainer its
``metrics.jsonl``; rank 0 also saves fit's metrics as ``OUT/<name>.pt``. One launch serves every
case: starting a process group costs more than training these tiny models.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sdnet_trainer import Trainer
from sdnet_trainer.config import Config
from sdnet_trainer.distributed.env import DistEnv
from sdnet_trainer.lazy import freeze_imports
from sdnet_trainer.training.classes import resolve_trainer_class
from tests.distributed._layout_worker import run_cases


class _FitMetrics:
    """What run_cases keeps of a case: fit's metrics (the Trainer's own files hold the rest)."""

    def record(self, metrics: dict[str, float]) -> dict[str, float]:
        return metrics


def case_trainer(cfg: Config, *, output_dir: Path, env: DistEnv) -> Trainer:
    """The Trainer class the case's config names, with ``record`` for run_cases."""
    cls = resolve_trainer_class(cfg.trainer._target_)
    recorded = type(cls.__name__, (_FitMetrics, cls), {})
    return recorded(cfg, output_dir=output_dir, env=env)


def main(out: Path, cases: dict[str, list[str]]) -> None:
    run_cases(out, cases, case_trainer)  # type: ignore[arg-type]  # a factory, called as a class


if __name__ == "__main__":
    freeze_imports()  # as the CLI does in its processes
    main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))
