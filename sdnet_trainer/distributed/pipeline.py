"""Pipeline parallelism with ``torch.distributed.pipelining``, for any model with pipeline units.

Splitting (:func:`split_model`): the model's pipeline units (module names in execution order, see
:mod:`sdnet_trainer.models.parallel_spec`) are cut at ``parallel.pipeline.split_points`` into
``pp x stages_per_rank`` stages. Each rank keeps its stages' units in the model and sets every
other unit to ``None``, so the pruned model still names its parameters with the original FQNs:
checkpoints written under any pipeline layout load into any other, and into a model without one.
A stage is a thin module that runs its units in order over the same parameter objects.

Stages go to ranks in loop order (rank r holds r, r + pp, ...) or, for the V-shaped zero-bubble
schedules, r and 2 pp - 1 - r. Training uses torch's schedules; evaluation runs the whole batch
forward through the stages in order with point-to-point sends (every schedule, V-shaped included).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from sdnet_trainer.compat import local_stage_handoff, pipeline_keeps_buffers
from sdnet_trainer.config.schema import Config, PipelineConfig
from sdnet_trainer.distributed.batching import batch_layout
from sdnet_trainer.distributed.mesh import parallel_dims
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.parallel_spec import Unit, block_unit_indices, pipeline_units

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

logger = logging.getLogger(__name__)

PIPELINE_SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
# Schedules that place two stages per rank in a V (rank r: stages r and 2 pp - 1 - r).
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# Schedules that run a stage's backward in two passes (input gradients, then weight gradients).
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def single_stage_schedule(name: str) -> bool:
    # torch's pipelining is imported where a pipeline is checked or built (parallel.pp > 1): it
    # imports torch._dynamo, which other runs never need (sdnet_trainer/lazy.py).
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    return issubclass(get_schedule_class(name), PipelineScheduleSingle)


def check_schedule(cfg: PipelineConfig, pp: int) -> None:
    """The schedule/stage rules torch enforces, checked before launch with the config's names."""
    if cfg.schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(
            f"parallel.pipeline.schedule={cfg.schedule!r} is not one of "
            f"{', '.join(PIPELINE_SCHEDULES)}"
        )
    per_rank = cfg.stages_per_rank
    if per_rank < 1:
        raise ConfigError(f"parallel.pipeline.stages_per_rank={per_rank} must be >= 1")
    if single_stage_schedule(cfg.schedule) and per_rank != 1:
        raise ConfigError(
            f"parallel.pipeline.schedule={cfg.schedule} runs one stage per rank; set "
            f"parallel.pipeline.stages_per_rank=1 (not {per_rank}) or use Interleaved1F1B"
        )
    if not single_stage_schedule(cfg.schedule) and per_rank < 2:
        raise ConfigError(
            f"parallel.pipeline.schedule={cfg.schedule} needs several stages per rank; set "
            f"parallel.pipeline.stages_per_rank=2 or more (it is {per_rank})"
        )
    if cfg.schedule in V_SCHEDULES and per_rank != 2:
        raise ConfigError(
            f"parallel.pipeline.schedule={cfg.schedule} places exactly 2 stages per rank; "
            f"set parallel.pipeline.stages_per_rank=2 (not {per_rank})"
        )
    if cfg.schedule in V_SCHEDULES and not local_stage_handoff():
        raise ConfigError(
            f"parallel.pipeline.schedule={cfg.schedule} needs torch>=2.12 (the two stages of a "
            f"rank pass tensors to each other locally); torch {torch.__version__} sends them to "
            f"the rank itself, which fails at the first step: use Interleaved1F1B or "
            f"InterleavedZeroBubble, or a newer torch"
        )
    if cfg.microbatches < 1:
        raise ConfigError(f"parallel.pipeline.microbatches={cfg.microbatches} must be >= 1")
    num_stages = pp * per_rank
    if cfg.split_points and len(cfg.split_points) != num_stages - 1:
        raise ConfigError(
            f"parallel.pipeline.split_points has {len(cfg.split_points)} names, but parallel.pp "
            f"({pp}) x stages_per_rank ({per_rank}) = {num_stages} stages need {num_stages - 1}"
        )


def validate_pipeline(cfg: Config, world_size: int) -> None:
    """``parallel.pipeline.*`` against the schedule, the stage count and the batch split, checked
    before launch; nothing to check without pipeline stages (``parallel.pp=1``)."""
    dims = parallel_dims(cfg.parallel, world_size)
    if dims.pp == 1:
        return
    pipe = cfg.parallel.pipeline
    check_schedule(pipe, dims.pp)
    if pipe.schedule in SPLIT_BACKWARD_SCHEDULES and (
        cfg.parallel.activation_checkpointing == "selective"
    ):
        raise ConfigError(
            f"parallel.activation_checkpointing=selective with parallel.pipeline.schedule="
            f"{pipe.schedule}: the schedule runs each stage's backward in two passes (input, "
            f"then weight gradients), and torch's selective checkpointing allows one backward "
            f"through what it saved; use parallel.activation_checkpointing=full, or a schedule "
            f"without split backward (GPipe, 1F1B, Interleaved1F1B, LoopedBFS)"
        )
    if cfg.loop.grad_accum_steps != 1:
        raise ConfigError(
            f"loop.grad_accum_steps={cfg.loop.grad_accum_steps} with parallel.pp={dims.pp}: the "
            f"pipeline accumulates over its micro-batches; set loop.grad_accum_steps=1 and "
            f"parallel.pipeline.microbatches instead"
        )
    micro = batch_layout(cfg, world_size).micro_batch_size
    if micro % pipe.microbatches:
        raise ConfigError(
            f"the batch per data-parallel rank ({micro} = loop.global_batch_size "
            f"{cfg.loop.global_batch_size} / {dims.dp} data-parallel ranks) is not divisible by "
            f"parallel.pipeline.microbatches={pipe.microbatches}"
        )


def stage_ids(cfg: PipelineConfig, pp_rank: int, pp: int) -> list[int]:
    """The stages ``pp_rank`` holds, in execution order."""
    if cfg.schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(cfg.stages_per_rank)]


def stage_owner(stage: int, cfg: PipelineConfig, pp: int) -> int:
    """The pipeline rank holding ``stage``."""
    if cfg.schedule in V_SCHEDULES:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


class StageModule(nn.Module):
    """A contiguous run of pipeline units, called one after the other on a single tensor."""

    def __init__(self, units: list[Unit], modules: list[nn.Module]) -> None:
        super().__init__()
        self.unit_names = [u.name for u in units]
        self.flatten = [u.flatten for u in units]
        self.units = nn.ModuleList(modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for flatten, unit in zip(self.flatten, self.units):
            x = unit(x.flatten(1) if flatten else x)
        return x


def _stage_bounds(
    model: nn.Module, units: list[Unit], split_points: list[str], num_stages: int, model_name: str
) -> list[int]:
    """Index of the first unit of each stage (stage 0 starts at 0)."""
    if split_points:
        starts = []
        for point in split_points:
            match = next(
                (
                    i
                    for i, u in enumerate(units)
                    if u.name == point or u.name.startswith(point + ".")
                ),
                None,
            )
            if match is None:
                names = sorted({u.name.split(".")[0] for u in units})
                raise ConfigError(
                    f"parallel.pipeline.split_points: {point!r} is not a pipeline unit of "
                    f"model.name={model_name!r} (its units start with: {', '.join(names)})"
                )
            starts.append(match)
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ConfigError(
                f"parallel.pipeline.split_points={list(split_points)} must name distinct "
                f"modules in forward order, after the first one ({units[0].name!r})"
            )
        return [0] + starts
    # Default: an even number of blocks per stage (all units when the model has no blocks).
    blocks = block_unit_indices(model, units) or list(range(len(units)))
    if len(blocks) < num_stages:
        raise ConfigError(
            f"model.name={model_name!r} has {len(blocks)} blocks, fewer than the {num_stages} "
            f"pipeline stages (parallel.pp x parallel.pipeline.stages_per_rank)"
        )
    return [0] + [blocks[len(blocks) * s // num_stages] for s in range(1, num_stages)]


def split_model(
    model: nn.Module, cfg: PipelineConfig, *, model_name: str, pp_rank: int, pp: int
) -> tuple[list[int], list[StageModule], int]:
    """Prune ``model`` to this rank's stages (in place); returns (stage ids, stage modules, stage
    count)."""
    units = pipeline_units(model, model_name)
    num_stages = pp * cfg.stages_per_rank
    if len(units) < num_stages:
        raise ConfigError(
            f"model.name={model_name!r} has {len(units)} pipeline units, fewer than the "
            f"{num_stages} stages (parallel.pp x parallel.pipeline.stages_per_rank)"
        )
    _check_units_cover(model, units, model_name)
    bounds = _stage_bounds(model, units, list(cfg.split_points), num_stages, model_name) + [
        len(units)
    ]
    mine = stage_ids(cfg, pp_rank, pp)
    kept: set[str] = set()
    modules = []
    for stage in mine:
        stage_units = units[bounds[stage] : bounds[stage + 1]]
        kept.update(u.name for u in stage_units)
        modules.append(StageModule(stage_units, [model.get_submodule(u.name) for u in stage_units]))
    for unit in units:
        if unit.name not in kept:
            parent, _, leaf = unit.name.rpartition(".")
            model.get_submodule(parent)._modules[leaf] = None
    logger.info(
        "pipeline: %d stages, this rank holds %s: %s",
        num_stages,
        mine,
        "; ".join(f"{m.unit_names[0]} .. {m.unit_names[-1]}" for m in modules),
    )
    return mine, modules, num_stages


def _check_units_cover(model: nn.Module, units: list[Unit], model_name: str) -> None:
    """Every parameter and buffer must live in some unit, or pruning would keep it on every
    stage."""
    prefixes = tuple(u.name + "." for u in units)
    stray = [
        n
        for n, _ in [*model.named_parameters(), *model.named_buffers()]
        if not n.startswith(prefixes)
    ]
    if stray:
        raise ConfigError(
            f"model.name={model_name!r}: {stray[0]} (and {len(stray) - 1} more) belong to no "
            f"pipeline unit, so the model cannot be split into stages"
        )


@dataclass
class Pipeline:
    """This rank's stages and the schedule that drives them."""

    schedule: Any
    stages: list[PipelineStage]
    modules: list[nn.Module]  # what each stage runs (wrapped for data parallelism, if any)
    stage_ids: list[int]
    num_stages: int
    cfg: PipelineConfig
    group: dist.ProcessGroup

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward over ``microbatches`` micro-batches; the sum of their losses on
        the rank holding the last stage, zero elsewhere. The loss function weighs each pipeline
        micro-batch (the Trainer's: by its share of the step's counted targets, the step's
        reduction contract in ``distributed/reduction.py``), so the gradients are those of that
        sum: torch's ``scale_grads`` (dividing by the micro-batch count, a mean of means) is
        off."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        self.schedule.step(*args, target=targets if self.has_last else None, losses=losses)
        return torch.stack(losses).sum() if losses else torch.zeros((), device=inputs.device)

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The whole batch through every stage in order; the output on the last stage's rank."""
        pp = dist.get_world_size(self.group)
        ranks = dist.get_process_group_ranks(self.group)
        local = dict(zip(self.stage_ids, self.modules))
        x: torch.Tensor | None = inputs
        for stage in range(self.num_stages):
            if stage not in local:
                continue
            if stage > 0 and stage - 1 not in local:
                owner = ranks[stage_owner(stage - 1, self.cfg, pp)]
                x = _recv_tensor(owner, group=self.group, device=inputs.device)
            x = local[stage](x)
            if stage + 1 < self.num_stages and stage + 1 not in local:
                _send_tensor(x, ranks[stage_owner(stage + 1, self.cfg, pp)], group=self.group)
        return x if self.has_last else None


def build_pipeline(
    modules: list[nn.Module],
    ids: list[int],
    num_stages: int,
    cfg: PipelineConfig,
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Pipeline:
    from torch.distributed.pipelining import PipelineStage  # as in single_stage_schedule
    from torch.distributed.pipelining.schedules import get_schedule_class

    warn_if_shape_inference_updates_buffers(modules)
    stages = [
        PipelineStage(module, stage, num_stages, device, group=group)
        for module, stage in zip(modules, ids)
    ]
    cls = get_schedule_class(cfg.schedule)
    # The loss function weighs each micro-batch itself (Pipeline.train_step).
    staged = stages[0] if single_stage_schedule(cfg.schedule) else stages
    schedule = cls(staged, n_microbatches=cfg.microbatches, loss_fn=loss_fn, scale_grads=False)
    return Pipeline(schedule, stages, modules, ids, num_stages, cfg, group)


def warn_if_shape_inference_updates_buffers(modules: list[nn.Module]) -> bool:
    """Warn (and return True) where this torch's pipeline stages will update the stages' buffers
    once more than a single process would (``compat.pipeline_keeps_buffers``): BatchNorm's running
    statistics, hence evaluation, then differ slightly from one process's; the weights do not."""
    if pipeline_keeps_buffers() or not any(True for m in modules for _ in m.buffers()):
        return False
    logger.warning(
        "torch %s: the pipeline stages infer their shapes with one training-mode forward before "
        "the first micro-batch, which updates buffers such as BatchNorm's running statistics "
        "once more than a single process does (torch 2.14 restores them); evaluation may differ "
        "slightly from a single process",
        torch.__version__,
    )
    return True


# Activations cross stages with a small header first (rank, dtype, shape), so evaluation needs no
# shapes known in advance. Sends and receives go over the stage group (``dst``/``src`` are global
# ranks): on the world group NCCL would build a separate two-rank communicator for every pair of
# stages, on top of the stage group's that training already uses.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
_HEADER = 8


def _send_tensor(x: torch.Tensor, dst: int, *, group: dist.ProcessGroup) -> None:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = x.dim(), _DTYPES.index(x.dtype)
    header[2 : 2 + x.dim()] = torch.tensor(x.shape)
    dist.send(header.to(x.device), dst, group=group)
    dist.send(x.contiguous(), dst, group=group)


def _recv_tensor(src: int, *, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
    x = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(x, src, group=group)
    return x


__all__ = [
    "PIPELINE_SCHEDULES",
    "Pipeline",
    "StageModule",
    "build_pipeline",
    "check_schedule",
    "split_model",
    "stage_ids",
    "stage_owner",
    "validate_pipeline",
]
