"""Python logging for a run: rank 0 talks, the other ranks only warn.

Rank 0 logs to the console and to ``train.log`` in the run directory; every other rank logs
warnings and errors to the console, prefixed with its rank, so a failure on rank 3 is still seen,
and its heartbeat line (INFO, at the run's level).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.config.schema import Config

# The heartbeat's own logger (training/health.py), let through on every rank.
HEARTBEAT_LOGGER = "sdnet_trainer.training.health.heartbeat"

_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] %(message)s"
LOG_FILE = "train.log"
PROGRESS = ("auto", "on", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def validate_logging(cfg: Config) -> None:
    """``logging.*``, checked before launch."""
    check_positive("logging.log_every_n_steps", cfg.logging.log_every_n_steps)
    check_choice("logging.progress_bar", cfg.logging.progress_bar, PROGRESS)
    check_choice("logging.level", cfg.logging.level.upper(), LOG_LEVELS)


def setup_logging(output_dir: str | Path | None, *, rank: int, level: str = "INFO") -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    fmt = _FORMAT if rank == 0 else f"[rank{rank}]{_FORMAT}"
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(fmt))
    root.addHandler(console)
    if rank == 0 and output_dir is not None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(Path(output_dir) / LOG_FILE)
        file.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(file)
    root.setLevel(level.upper() if rank == 0 else logging.WARNING)
    # The heartbeat (training/health.py) is an INFO line every rank writes: the other ranks show
    # it too, at the run's level; rank 0 follows its root.
    logging.getLogger(HEARTBEAT_LOGGER).setLevel(logging.NOTSET if rank == 0 else level.upper())
