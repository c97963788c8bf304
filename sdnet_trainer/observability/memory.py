"""Bytes of training state one rank holds: parameters, gradients and optimizer state.

Counted from each tensor's local shard (``DTensor.to_local``), so the figures show what sharding
saves: FSDP shards all three, ZeRO-1 only the optimizer state. Gradients are counted at their
parameter's local size, the memory they occupy between backward and ``zero_grad``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` on this rank: a DTensor's local shard, a plain tensor whole."""
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = [p for p in model.parameters()]
    # ZeRO-1 exposes every parameter in param_groups but keeps state only for its own partition.
    local_optimizer = (
        optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    )
    state = [
        v
        for s in local_optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]  # not the scalar step counters
    return {
        "params": local_bytes(params),
        "grads": local_bytes(p for p in params if p.requires_grad),
        "optim": local_bytes(state),
    }


def step_on_meta(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step over zero gradients, so the optimizer's state exists (on meta): what
    the dry run and the Trainer's check before allocating count."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO-1 wraps the local optimizer
    for group in [*optimizer.param_groups, *inner.param_groups]:
        # Fused and foreach kernels take no meta tensors; the state they make is the same.
        for key in ("fused", "foreach"):
            if group.get(key):
                group[key] = False
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()


__all__ = ["local_bytes", "step_on_meta", "training_state_bytes"]
