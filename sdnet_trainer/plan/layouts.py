"""The planner's :class:`~sdnet_trainer.plan.estimate.Layout` of a config, or of the checkpoint a
resume would load (``parallel=auto`` keeps a resumed run's layout on the same world size)."""

from __future__ import annotations

from typing import Any

from sdnet_trainer.checkpoint import CheckpointError, read_checkpoint
from sdnet_trainer.checkpoint.files import Folder, folder_of, step_dirs
from sdnet_trainer.config import Config
from sdnet_trainer.distributed.batching import batch_layout
from sdnet_trainer.distributed.mesh import parallel_dims
from sdnet_trainer.distributed.parallelize import STRATEGIES
from sdnet_trainer.distributed.pipeline import PIPELINE_SCHEDULES
from sdnet_trainer.plan.estimate import Layout


def layout_of(cfg: Config, world_size: int) -> Layout:
    """The layout ``cfg`` names on ``world_size`` ranks (its degrees, checkpointing and batch
    split), as the planner describes its candidates: what its estimate of a launched config
    reads."""
    dims = parallel_dims(cfg.parallel, world_size)
    split = batch_layout(cfg, world_size)
    pipe = cfg.parallel.pipeline
    steps = pipe.microbatches if dims.pp > 1 else split.grad_accum_steps
    micro = split.micro_batch_size // steps if dims.pp > 1 else split.micro_batch_size
    return Layout(
        cfg.parallel.strategy,
        dims.dp_replicate,
        dims.dp_shard,
        dims.tp,
        dims.pp,
        checkpointing=cfg.parallel.activation_checkpointing != "none",
        micro_batch=micro,
        micro_steps=steps,
        schedule=pipe.schedule,
        stages_per_rank=pipe.stages_per_rank,
        ep=dims.ep,
        cp=dims.cp,
    )


def recorded_layout(
    cfg: Config, checkpoint_dir: Folder | None, world_size: int
) -> tuple[Layout, str] | None:
    """The layout of the checkpoint a resume would load, if it was written by ``world_size``
    ranks with explicit degrees (a ``parallel=auto`` run's; a resume on another world size plans
    again). The manifest is untrusted: a layout it cannot give whole is no layout, and the resume
    itself reports the checkpoint's faults."""
    resume = cfg.checkpoint.resume
    if resume == "none" or checkpoint_dir is None:
        return None
    if resume == "auto":
        paths = [p for _, p in sorted(step_dirs(checkpoint_dir), reverse=True)]
    else:
        paths = [folder_of(resume, dict(cfg.checkpoint.storage_options))]
    for path in paths:
        try:
            checkpoint = read_checkpoint(path)
        except (CheckpointError, RecursionError):  # RecursionError: a manifest nested too deep
            continue
        if checkpoint.world_size != world_size:
            return None
        layout = _recorded(checkpoint.meta, world_size)
        return (layout, f"checkpoint {path}") if layout is not None else None
    return None


def _recorded(meta: Any, world_size: int) -> Layout | None:
    try:
        config = meta["config"]
        parallel, pipeline = config["parallel"], config["parallel"]["pipeline"]
        replicate, shard, tp, pp = (parallel[k] for k in ("dp_replicate", "dp_shard", "tp", "pp"))
        # A checkpoint written before the planner chose them has neither.
        ep, cp = parallel.get("ep", 1), parallel.get("cp", 1)
        steps = pipeline["microbatches"] if pp > 1 else config["loop"]["grad_accum_steps"]
        numbers = [replicate, shard, tp, pp, ep, cp, steps, pipeline["stages_per_rank"]]
        numbers.append(meta["global_batch_size"])
        if not all(type(n) is int and n >= 1 for n in numbers):
            return None
        if replicate * shard * tp * pp * cp != world_size:
            return None
        strategy, schedule = parallel["strategy"], pipeline["schedule"]
        if strategy not in STRATEGIES or schedule not in PIPELINE_SCHEDULES:
            return None
        checkpointing = {"none": False, "full": True}.get(parallel["activation_checkpointing"])
        if checkpointing is None or parallel["activation_checkpointing_every"] != 1:
            return None
        return Layout(
            strategy,
            replicate,
            shard,
            tp,
            pp,
            checkpointing=checkpointing,
            micro_batch=max(meta["global_batch_size"] // (replicate * shard) // steps, 1),
            micro_steps=steps,
            schedule=schedule,
            stages_per_rank=pipeline["stages_per_rank"],
            ep=ep,
            cp=cp,
        )
    except (KeyError, TypeError, ValueError, ArithmeticError):
        return None


__all__ = ["layout_of", "recorded_layout"]
