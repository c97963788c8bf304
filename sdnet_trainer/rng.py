"""Random-number state: seeding, capture for checkpoints, restore, and re-derivation.

Checkpoints store each rank's generator states as tensors (no pickled objects), so a run resumed
on the same world size continues every random stream exactly. A run resumed on another world size
cannot map old ranks to new ones; each rank then re-derives its streams from (seed, rank, step),
which is deterministic too.
"""

from __future__ import annotations

import math
import os
import random

import torch

_MIX = 1_000_003  # a prime; keeps (seed, rank, step) combinations apart


def seed_everything(seed: int, *, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace for deterministic matmuls; must be set before first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True


def derive_seed(seed: int, *, rank: int, step: int = 0) -> int:
    return ((seed * _MIX + rank) * _MIX + step) % (2**63)


def reseed(seed: int, *, rank: int, step: int) -> None:
    """Per-rank streams (dropout, augmentation) as a pure function of seed, rank and step."""
    value = derive_seed(seed, rank=rank, step=step)
    random.seed(value)
    torch.manual_seed(value)


def capture(device: torch.device) -> dict[str, torch.Tensor]:
    version, internal, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor(internal, dtype=torch.int64),
        "python_gauss": torch.tensor(math.nan if gauss is None else gauss, dtype=torch.float64),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    gauss = state["python_gauss"].item()
    random.setstate((3, tuple(state["python"].tolist()), None if math.isnan(gauss) else gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class RngState:
    """This rank's random streams as a checkpoint part (``state_dict`` / ``load_state_dict``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict[str, torch.Tensor]:
        return capture(self.device)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        restore(state, self.device)
