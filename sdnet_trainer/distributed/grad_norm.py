"""The global gradient norm under every layout, equal to the norm a single process would compute.

Gradients are plain tensors (DDP: already all-reduced, so identical on every data-parallel rank)
or DTensors (FSDP shards, tensor-parallel shards, or both on a 2-D mesh). DTensor norms are
computed per (mesh, placements) group, because torch cannot stack norms of DTensors on different
meshes, and each group's ``full_tensor`` reduces over the ranks that hold its shards. Pipeline
stages hold disjoint parameters, so their squared norms add up over the pipeline group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TypeAlias

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

# Plain tensors group under None, DTensors under their (mesh, placements).
_GroupKey: TypeAlias = tuple[DeviceMesh, tuple[Placement, ...]] | None


def global_grad_norm(
    grads: Iterable[torch.Tensor],
    *,
    pp_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The L2 norm over all ``grads`` of all ranks, as a plain scalar tensor (same on every
    rank)."""
    groups: dict[_GroupKey, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups[key].append(grad)
    squares = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


__all__ = ["global_grad_norm"]
