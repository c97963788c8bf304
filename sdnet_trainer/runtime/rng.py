"""Random-number state: seeding, capture for checkpoints, restore, and re-derivation.

Checkpoints store each rank's generator states as tensors (no pickled objects), so a run resumed
on the same world size continues every random stream exactly. A run resumed on another world size
cannot map old ranks to new ones; each rank then re-derives its streams from (seed, rank, step),
which is deterministic too. A checkpoint written without CUDA streams (on the CPU) and resumed on a
GPU at the same world size restores what it holds and derives the CUDA stream the same way.
"""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

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


def restore(
    state: dict[str, torch.Tensor], device: torch.device, *, cuda_seed: int | None = None
) -> None:
    """Set the streams ``state`` holds. On CUDA a state without a CUDA stream (written on the
    CPU) seeds this device's generator with ``cuda_seed`` instead, which must then be given."""
    torch.set_rng_state(state["torch"])
    gauss = state["python_gauss"].item()
    random.setstate((3, tuple(state["python"].tolist()), None if math.isnan(gauss) else gauss))
    if device.type != "cuda":
        return
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    else:
        if cuda_seed is None:
            raise ValueError("a state without a CUDA stream needs cuda_seed to restore on CUDA")
        with torch.cuda.device(device):
            torch.cuda.manual_seed(cuda_seed)


class RngState:
    """This rank's random streams as a checkpoint part (``state_dict`` / ``load_state_dict``).

    ``seed``, ``rank`` and ``step`` (a callable: the restored step is known only once the run's
    counters are loaded, which the Checkpointer does before this part) derive the CUDA stream
    when the checkpoint has none: a CPU-written checkpoint resumed on a GPU."""

    def __init__(
        self,
        device: torch.device,
        *,
        seed: int = 0,
        rank: int = 0,
        step: Callable[[], int] = lambda: 0,
    ) -> None:
        self.device = device
        self.seed = seed
        self.rank = rank
        self.step = step

    def state_dict(self) -> dict[str, torch.Tensor]:
        return capture(self.device)

    def load_request(self, checkpoint: Any, key: str) -> dict[str, torch.Tensor]:
        """The entries to read from ``checkpoint`` (the Checkpointer asks before loading): this
        rank's streams, less those the checkpoint lacks. Only the CUDA stream may be absent (a
        CPU-written checkpoint); the CPU and Python streams are in every checkpoint."""
        state = self.state_dict()
        if "cuda" in state and not checkpoint.has_key(f"{key}.cuda"):
            del state["cuda"]
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        cuda_seed = None
        if self.device.type == "cuda" and "cuda" not in state:
            step = self.step()
            cuda_seed = derive_seed(self.seed, rank=self.rank, step=step)
            logger.info(
                "the checkpoint has no CUDA random stream (written without CUDA): CUDA stream "
                "of rank %d derived from (seed %d, rank %d, step %d)",
                self.rank,
                self.seed,
                self.rank,
                step,
            )
        restore(state, self.device, cuda_seed=cuda_seed)


# ---------------------------------------------------------------------- deterministic kernels

# Modules whose CUDA backward has no deterministic kernel: under use_deterministic_algorithms
# their first backward raises (torch's list, use_deterministic_algorithms). AdaptiveAvgPool2d to
# 1x1 (every ResNet's head) is computed as a mean, whose backward is deterministic: not listed.
_NONDETERMINISTIC_CUDA_BACKWARD: tuple[type[nn.Module], ...] = (
    nn.AvgPool3d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool2d,
    nn.FractionalMaxPool2d,
    nn.FractionalMaxPool3d,
    nn.MaxUnpool1d,
    nn.MaxUnpool2d,
    nn.MaxUnpool3d,
    nn.ReflectionPad1d,
    nn.ReflectionPad2d,
    nn.ReflectionPad3d,
)
_INTERPOLATING = ("linear", "bilinear", "bicubic", "trilinear")


def _mean_pool(module: nn.Module) -> bool:
    """AdaptiveAvgPool2d/3d to an output of ones: torch computes a mean instead of the pool."""
    if not isinstance(module, nn.AdaptiveAvgPool2d | nn.AdaptiveAvgPool3d):
        return False
    size = module.output_size
    sizes = size if isinstance(size, tuple) else (size,)
    return all(s == 1 for s in sizes)


def nondeterministic_modules(model: nn.Module) -> list[str]:
    """``name (Module)`` of each module of ``model`` whose CUDA backward has no deterministic
    kernel."""
    found = []
    for name, module in model.named_modules():
        blocked = isinstance(module, _NONDETERMINISTIC_CUDA_BACKWARD) and not _mean_pool(module)
        if isinstance(module, nn.Upsample) and module.mode in _INTERPOLATING:
            blocked = True
        if blocked:
            found.append(f"{name or '<model>'} ({module})")
    return found


def check_deterministic(model: nn.Module, device: torch.device, *, deterministic: bool) -> None:
    """``loop.deterministic=true`` on CUDA: refuse, before the first step, a model that has a
    module without a deterministic CUDA backward (its first backward would raise deep in
    autograd). A warn-only mode would keep training with nondeterministic kernels while the
    config promises bitwise repeatable runs, so this is an error. Functional calls (e.g.
    ``F.interpolate``) are not modules: torch itself still raises at their first backward."""
    if not (deterministic and device.type == "cuda"):
        return
    found = nondeterministic_modules(model)
    if found:
        listed = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
        raise ConfigError(
            "loop.deterministic=true, but these modules have no deterministic CUDA backward "
            f"(torch.use_deterministic_algorithms would raise at the first backward): {listed}. "
            "Set loop.deterministic=false, or train on the CPU (dist.device=cpu)"
        )
