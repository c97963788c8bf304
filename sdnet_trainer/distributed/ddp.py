"""Data-parallel wrapping: SyncBatchNorm conversion, then DistributedDataParallel."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdnet_trainer.config.schema import ParallelConfig
from sdnet_trainer.distributed.env import DistEnv

logger = logging.getLogger(__name__)


def wrap_data_parallel(
    model: nn.Module,
    cfg: ParallelConfig,
    env: DistEnv,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Return ``model`` wrapped for ``env``; a single process without a group gets it unchanged.

    The model must already be on ``env.device``. ``process_group``: the data-parallel ranks when
    they are not the whole world (pipeline stages, tensor-parallel peers); None for all ranks.
    """
    if not env.distributed:
        return model
    if cfg.sync_batchnorm:
        # Before DDP: DDP must see the final module tree to build its buckets.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = cfg.ddp
    return DistributedDataParallel(
        model,
        process_group=process_group,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        bucket_cap_mb=ddp.bucket_cap_mb,  # None: torch's default (25 MiB)
        static_graph=ddp.static_graph,
        gradient_as_bucket_view=ddp.gradient_as_bucket_view,
        find_unused_parameters=ddp.find_unused_parameters,
        **_buffer_sync_kwargs(ddp.broadcast_buffers),
    )


def _buffer_sync_kwargs(broadcast_buffers: bool) -> dict[str, Any]:
    """``parallel.ddp.broadcast_buffers``: re-broadcast rank 0's buffers (BatchNorm running
    statistics) before every forward. Newer torch names this ``forward_sync_buffers`` and
    deprecates the old keyword; both sync buffers once at construction when it is False."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": broadcast_buffers}
    return {"broadcast_buffers": broadcast_buffers}


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper (used for eval and for state dicts)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_ddp(model: nn.Module) -> bool:
    return isinstance(model, DistributedDataParallel)


__all__ = ["is_ddp", "unwrap", "wrap_data_parallel"]
