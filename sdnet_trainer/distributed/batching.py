"""How one optimizer step's samples split over ranks, accumulation steps and micro-batches.

:func:`batch_layout` is the one place the batch rules live; :func:`validate_batch` checks the
``loop.*`` batch keys and ``elastic.batch_policy`` before launch.
"""

from __future__ import annotations

from dataclasses import dataclass

from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.config.schema import Config
from sdnet_trainer.distributed.mesh import ParallelDims, parallel_dims
from sdnet_trainer.errors import ConfigError

BATCH_POLICIES = ("keep_global", "keep_per_rank")


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's samples split: global = world size x accumulation x micro-batch."""

    global_batch_size: int
    grad_accum_steps: int
    micro_batch_size: int

    def describe(self, dp: int) -> str:
        return (
            f"global batch {self.global_batch_size} = {dp} data-parallel ranks x "
            f"{self.grad_accum_steps} accumulation x {self.micro_batch_size} micro-batch"
        )


def batch_layout(cfg: Config, world_size: int) -> BatchLayout:
    """The batch split for ``world_size`` ranks; the batch rules live here alone.

    Without ``loop.micro_batch_size`` the micro-batch is derived from the global batch. With it,
    ``elastic.batch_policy`` says what survives a change of world size: ``keep_global`` re-derives
    the accumulation, ``keep_per_rank`` keeps accumulation and micro-batch (the global batch
    follows).
    """
    loop = cfg.loop
    micro = loop.micro_batch_size
    dims = parallel_dims(cfg.parallel, world_size)
    ranks = _dp_phrase(dims, world_size)
    world_size = dims.dp  # tensor-parallel peers and pipeline stages share their samples
    if micro is None:
        split = world_size * loop.grad_accum_steps
        if loop.global_batch_size % split:
            raise ConfigError(
                f"loop.global_batch_size={loop.global_batch_size} is not divisible by {ranks} "
                f"x loop.grad_accum_steps ({loop.grad_accum_steps}) = {split}; "
                f"choose a global batch that is a multiple of {split}"
            )
        return BatchLayout(
            loop.global_batch_size, loop.grad_accum_steps, loop.global_batch_size // split
        )
    if cfg.elastic.enabled and cfg.elastic.batch_policy == "keep_per_rank":
        return BatchLayout(world_size * loop.grad_accum_steps * micro, loop.grad_accum_steps, micro)
    per_step = world_size * micro
    if loop.global_batch_size % per_step:
        raise ConfigError(
            f"loop.global_batch_size={loop.global_batch_size} is not divisible by {ranks} "
            f"x loop.micro_batch_size ({micro}) = {per_step}, so no whole number of accumulation "
            f"steps keeps it; change one of them or use elastic.batch_policy=keep_per_rank"
        )
    accum = loop.global_batch_size // per_step
    if not cfg.elastic.enabled and accum != loop.grad_accum_steps:
        raise ConfigError(
            f"loop.micro_batch_size={micro} with {ranks} needs loop.grad_accum_steps="
            f"{accum} for loop.global_batch_size={loop.global_batch_size}, "
            f"not {loop.grad_accum_steps} (with elastic.enabled=true the accumulation is derived)"
        )
    return BatchLayout(loop.global_batch_size, accum, micro)


def _dp_phrase(dims: ParallelDims, world_size: int) -> str:
    if dims.dp == world_size:
        return f"world size ({world_size})"
    return (
        f"data-parallel size ({dims.dp} = world size {world_size} / (parallel.tp {dims.tp} x "
        f"parallel.cp {dims.cp} x parallel.pp {dims.pp}))"
    )


def validate_batch(cfg: Config, world_size: int) -> None:
    """``loop.global_batch_size``, ``loop.grad_accum_steps``, ``loop.micro_batch_size`` and
    ``elastic.batch_policy``, and that they split over ``world_size`` ranks."""
    loop = cfg.loop
    check_positive("loop.global_batch_size", loop.global_batch_size)
    check_positive("loop.grad_accum_steps", loop.grad_accum_steps)
    check_positive("loop.micro_batch_size", loop.micro_batch_size, allow_none=True)
    check_choice("elastic.batch_policy", cfg.elastic.batch_policy, BATCH_POLICIES)
    if (
        cfg.elastic.batch_policy == "keep_per_rank"
        and cfg.elastic.enabled
        and loop.micro_batch_size is None
    ):
        raise ConfigError(
            "elastic.batch_policy=keep_per_rank needs loop.micro_batch_size (the per-rank "
            "batch to keep when the world size changes)"
        )
    batch_layout(cfg, world_size)


__all__ = ["BATCH_POLICIES", "BatchLayout", "batch_layout", "validate_batch"]
