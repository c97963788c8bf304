"""What the dry run counts for a mixture of experts (``plan/dry_run.py``): the bytes of a rank's
expert weights and of their optimizer state, and expert parallel's all-to-alls."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from sdnet_trainer.config import Config
from sdnet_trainer.distributed.mesh import ParallelDims
from sdnet_trainer.models.moe import GroupedExperts, moe_sizes
from sdnet_trainer.observability.memory import local_bytes


def expert_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of expert weights and of their optimizer state (their local shards:
    under ``parallel.ep`` its ``num_experts / ep`` experts, sharded by FSDP over the
    ``dp_shard / ep`` ranks that hold the same ones)."""
    params = [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]
    state = [
        v
        for p in params
        for v in optimizer.state.get(p, {}).values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return {"params": local_bytes(params), "optim": local_bytes(state)}


def expert_parallel_collectives(
    cfg: Config,
    dims: ParallelDims,
    stage: int,
    *,
    micro_steps: int,
    micro_batch: int,
    width: int,
    recomputed: Callable[[int, object], bool],
) -> list[tuple[str, str, int, int]]:
    """Expert parallel's collectives per optimizer step, as (kind, mesh dimension, count, bytes
    each): per MoE layer of this rank's pipeline stage and micro-step, the rows the rank routes
    (``micro_batch x seq_len x top_k`` of the model's width, ``width`` bytes each) sent to their
    experts' ranks and back in forward, again where activation checkpointing recomputes the block
    (``recomputed(block, op)``), and their gradients both ways in backward; and before each
    dispatch the exchange of the per-expert counts (int64)."""
    if dims.ep == 1:  # a model without experts has refused parallel.ep > 1
        return []
    moe = moe_sizes(cfg.model)
    dim, n_layers = int(moe["dim"]), int(moe["n_layers"])
    per_stage = math.ceil(n_layers / dims.pp)
    layers = [b for b in range(stage * per_stage, (stage + 1) * per_stage) if b < n_layers]
    all_to_all = torch.ops._c10d_functional.all_to_all_single
    forwards = sum(1 + recomputed(b, all_to_all) for b in layers)
    rows = micro_batch * cfg.data.seq_len * int(moe["top_k"])
    return [
        (
            "all_to_all (EP dispatch, combine)",
            "ep",
            2 * (forwards + len(layers)) * micro_steps,
            rows * dim * width,
        ),
        ("all_to_all (EP counts)", "ep", forwards * micro_steps, int(moe["num_experts"]) * 8),
    ]


__all__ = ["expert_bytes", "expert_parallel_collectives"]
