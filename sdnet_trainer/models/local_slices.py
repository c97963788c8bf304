"""The global indices a rank's block of a tensor holds, per dimension: what initialising a
sharded parameter value by value needs (``models/init_values.py``: each element's value is a
function of its index in the whole tensor; the dry run counts the same way).

For a DTensor (tensor parallel, FSDP, expert parallel's experts sharded by expert and FSDP's
shards of those) the indices along each dimension are cut by the tensor's own placements, by
torch's own cutting of an index range and without communication; so strided shards (FSDP over
another dimension's shards) come out right.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard


def local_runs(target: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per dimension, the runs of global indices this rank's block of ``target`` holds: the
    whole range of a plain tensor, a DTensor's cut by its own placements."""
    if not isinstance(target, DTensor):
        return [[(0, size)] for size in target.shape]
    return [_runs(_held_indices(target, dim)) for dim in range(target.dim())]


def _held_indices(target: DTensor, dim: int) -> list[int]:
    """The global indices along ``dim`` of this rank's shard: the index range ``0..size`` cut by
    the placements that shard ``dim`` (the others replicate it), by torch's own cutting and
    without communication; so FSDP's strided shards over expert or tensor parallel's shards on
    the same dimension read right."""
    placements = [_cut_first_dim(p, dim, target.dim()) for p in target.placements]
    if all(isinstance(p, Replicate) for p in placements):
        return list(range(target.shape[dim]))
    indices = torch.arange(target.shape[dim])
    cut = distribute_tensor(indices, target.device_mesh, placements, src_data_rank=None)
    return cut.to_local().tolist()


def _cut_first_dim(placement: Placement, dim: int, ndim: int) -> Placement:
    """``placement`` as it applies to dimension ``dim`` alone, moved to a 1-D tensor's first."""
    # _StridedShard first: before torch 2.14 it subclasses Shard.
    if isinstance(placement, _StridedShard) and placement.dim % ndim == dim:
        return _StridedShard(0, split_factor=placement.split_factor)
    if isinstance(placement, Shard) and placement.dim % ndim == dim:
        return Shard(0)
    return Replicate()


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Consecutive indices as (start, stop) ranges."""
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs


__all__ = ["local_runs"]
