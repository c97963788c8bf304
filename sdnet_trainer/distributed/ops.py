"""Collectives that also work in a single process without a process group."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place and return it (unchanged without a process group)."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_floats(values: list[float], *, device: torch.device) -> torch.Tensor:
    """Gather a few floats from every rank: a [world_size, len(values)] tensor on the CPU."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    if not is_distributed():
        return local.unsqueeze(0).cpu()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return torch.stack(gathered).cpu()


def all_gather_objects(obj: T) -> list[T]:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` without a process group."""
    if not is_distributed():
        return [obj]
    # None placeholders until all_gather_object puts each rank's object in its slot.
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
