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


def by_layout(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by (mesh, placements), plain tensors together: torch's foreach kernels
    (norms, clipping) take no DTensors of different meshes in one call."""
    groups: dict[_GroupKey, list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        key = (tensor.device_mesh, tensor.placements) if isinstance(tensor, DTensor) else None
        groups[key].append(tensor)
    return list(groups.values())


def replicate_partial_grads(params: Iterable[torch.Tensor]) -> None:
    """Reduce the gradients DTensor left as partial sums into their parameter's layout (a
    weight shared by tensor-parallel ranks that each see part of its inputs, such as a per-head
    norm's: each rank's gradient is a part of the sum). Left partial, the optimizer would build its
    state from them, which a checkpoint cannot hold; FSDP's reduction does the same for the
    gradients it owns."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            assert isinstance(param, DTensor)  # a DTensor gradient is a DTensor parameter's
            param.grad = grad.redistribute(placements=param.placements)


def global_grad_norm(
    grads: Iterable[torch.Tensor],
    *,
    pp_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The L2 norm over all ``grads`` of all ranks, as a plain scalar tensor (same on every
    rank)."""
    squares = []
    for members in by_layout(grads):
        norm = torch.nn.utils.get_total_norm(members)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


__all__ = ["by_layout", "global_grad_norm", "replicate_partial_grads"]
