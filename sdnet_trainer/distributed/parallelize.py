"""Turn a bare model into this rank's parallel model, in the order the techniques compose:

    float8 conversion -> pipeline split -> tensor parallel -> context parallel -> expert parallel
    -> channels_last -> activation checkpointing -> compile -> FSDP2 (fully_shard per block,
    the experts on their own mesh first, then the root) or DDP

Every step is torch's own (``torch.distributed.pipelining``, DTensor ``parallelize_module`` via the
model's plan, ``torch.utils.checkpoint``, ``Module.compile``, ``fully_shard``, DDP). Activation
checkpointing and compile act on blocks in place, so parameter names never change and checkpoints
stay interchangeable between layouts.

FSDP2 wraps whenever ``parallel.strategy=fsdp`` has data-parallel ranks to shard over, and also on
a one-rank world that has a process group (``torchrun --nproc_per_node=1``): the same meta build,
sharding, mixed precision and DTensor checkpoints as at scale, on a mesh of one. A plain process
(no process group, no mesh) runs the bare model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.nn.parallel import DistributedDataParallel

from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.config.schema import Config
from sdnet_trainer.distributed.activation_checkpointing import (
    apply_activation_checkpointing,
    validate_activation_checkpointing,
)
from sdnet_trainer.distributed.context_parallel import ContextParallel, attention_method
from sdnet_trainer.distributed.ddp import wrap_data_parallel
from sdnet_trainer.distributed.env import DistEnv, resolve_device
from sdnet_trainer.distributed.expert_parallel import (
    apply_expert_parallel,
)
from sdnet_trainer.distributed.float8 import convert_float8
from sdnet_trainer.distributed.mesh import (
    ParallelDims,
    dp_mesh,
    expert_dp_mesh,
    parallel_dims,
    replica_mesh,
)
from sdnet_trainer.distributed.pipeline import Pipeline, build_pipeline, split_model
from sdnet_trainer.distributed.reduction import StepReduction
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.parallel_spec import parallel_blocks, supports_tensor_parallel
from sdnet_trainer.runtime.precision import DTYPES, resolve_precision_dtype

logger = logging.getLogger(__name__)

STRATEGIES = ("ddp", "fsdp", "zero1")
FSDP_DTYPES = ("auto", *DTYPES)
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The compile.mode values under which inductor records CUDA graphs.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
# parallel.fsdp.grad_sync: reduce-scatter after every micro-step's backward, or after the last only.
FSDP_GRAD_SYNC = ("every_microstep", "last_microstep")


def validate_parallel(cfg: Config, world_size: int) -> None:
    """``parallel.*``: degrees against the world size, and the combinations torch does not
    support.

    The pipeline's own keys are checked by
    :func:`~sdnet_trainer.distributed.pipeline.validate_pipeline`, the model's fit to tensor
    parallelism by the model's validator.
    """
    parallel = cfg.parallel
    strategy = parallel.strategy
    check_choice("parallel.strategy", strategy, STRATEGIES)
    check_positive("parallel.ddp.bucket_cap_mb", parallel.ddp.bucket_cap_mb, allow_none=True)
    check_positive("parallel.memory_per_rank_gib", parallel.memory_per_rank_gib, allow_none=True)
    dims = parallel_dims(parallel, world_size)
    validate_activation_checkpointing(cfg)
    if strategy in ("ddp", "zero1") and dims.dp_shard > 1:
        raise ConfigError(
            f"parallel.strategy={strategy} replicates the model, so "
            f"parallel.dp_shard={dims.dp_shard} has no meaning; use parallel=fsdp to shard over "
            f"{dims.dp_shard} ranks"
        )
    if strategy == "zero1" and (dims.tp > 1 or dims.pp > 1):
        raise ConfigError(
            f"parallel.strategy=zero1 runs with plain data parallelism only "
            f"(parallel.tp={dims.tp}, parallel.pp={dims.pp}); use parallel=fsdp for sharding "
            f"with tensor or pipeline parallelism"
        )
    if strategy == "ddp" and dims.tp > 1 and dims.dp_replicate * dims.cp > 1:
        raise ConfigError(
            f"parallel.tp={dims.tp} with parallel.dp_replicate={dims.dp_replicate} x "
            f"parallel.cp={dims.cp} gradient replicas under parallel.strategy=ddp: DDP does not "
            f"take tensor-parallel (DTensor) parameters; use parallel=fsdp (FSDP x TP on a 2-D "
            f"mesh)"
        )
    layered = strategy != "ddp" or dims.tp > 1 or dims.pp > 1 or dims.cp > 1
    if layered and cfg.precision.dtype == "fp16":
        raise ConfigError(
            f"precision.dtype=fp16 with parallel.strategy={strategy}, parallel.tp={dims.tp}, "
            f"parallel.pp={dims.pp}, parallel.cp={dims.cp}: the fp16 GradScaler is supported with "
            f"plain DDP only; "
            f"use precision=bf16"
        )
    if parallel.sync_batchnorm and (strategy != "ddp" or dims.pp > 1):
        raise ConfigError(
            f"parallel.sync_batchnorm=true needs parallel.strategy=ddp without pipeline stages "
            f"(parallel.strategy={strategy}, parallel.pp={dims.pp})"
        )
    if parallel.fsdp.cpu_offload and resolve_device(cfg.dist, local_rank=0).type != "cuda":
        raise ConfigError(
            "parallel.fsdp.cpu_offload=true moves sharded state from GPU to CPU memory and "
            "needs CUDA devices; this run is on the CPU already, keep it false"
        )
    check_choice("parallel.fsdp.param_dtype", parallel.fsdp.param_dtype, FSDP_DTYPES)
    check_choice("parallel.fsdp.reduce_dtype", parallel.fsdp.reduce_dtype, FSDP_DTYPES[1:])
    check_choice("parallel.fsdp.grad_sync", parallel.fsdp.grad_sync, FSDP_GRAD_SYNC)
    tp_cfg = parallel.tensor_parallel
    if dims.tp == 1 and (tp_cfg.loss_parallel or tp_cfg.sequence_parallel):
        raise ConfigError(
            "parallel.tensor_parallel.loss_parallel / sequence_parallel need parallel.tp > 1"
        )


def validate_compile(cfg: Config, world_size: int) -> None:
    """``compile.mode``, checked before launch.

    ``reduce-overhead`` and ``max-autotune`` have inductor record CUDA graphs of the compiled
    blocks. A graph replays fixed memory addresses and kernels, while DDP's bucketed all-reduce
    and FSDP2's per-block all-gather / reduce-scatter run collectives on their own streams and
    buffers around those blocks; torch documents neither combination as supported and no test
    here has run one. So the pair is refused (``parallel.strategy=fsdp``, or more than one
    data-parallel rank under any strategy) rather than left to fail, or to give wrong gradients,
    on the first multi-GPU step; ``max-autotune-no-cudagraphs`` keeps the tuned kernels."""
    mode = cfg.compile.mode
    if mode not in COMPILE_MODES:
        raise ConfigError(
            f"compile.mode={mode!r} is not one of {', '.join(str(m) for m in COMPILE_MODES)}"
        )
    if not cfg.compile.enabled or mode not in CUDA_GRAPH_MODES:
        return
    dims = parallel_dims(cfg.parallel, world_size)
    strategy = cfg.parallel.strategy
    if strategy != "fsdp" and dims.dp == 1:
        return
    wrapper = "FSDP2" if strategy == "fsdp" else "DDP"
    raise ConfigError(
        f"compile.enabled=true with compile.mode={mode} records CUDA graphs, which this project "
        f"does not run under {wrapper} (parallel.strategy={strategy}, {dims.dp} data-parallel "
        f"rank(s) of world size {world_size}): use compile.mode=default or "
        f"max-autotune-no-cudagraphs, or a single process with parallel.strategy=ddp"
    )


class _TensorParallelModel(Protocol):
    """A model with a tensor-parallel plan (see ``supports_tensor_parallel``)."""

    def apply_tensor_parallel(
        self, tp_mesh: DeviceMesh, *, loss_parallel: bool, sequence_parallel: bool
    ) -> None: ...


@dataclass
class ParallelModel:
    """``model`` owns the parameters under their original names (optimizer, state dicts); the
    forward runs through ``model`` itself, or through ``pipeline`` (this rank's stages)."""

    model: nn.Module
    pipeline: Pipeline | None = None
    # Context parallel: shards each batch's sequences for this rank (None without it).
    context: ContextParallel | None = None


def parallelize(
    model: nn.Module,
    cfg: Config,
    env: DistEnv,
    mesh: DeviceMesh | None,
    dims: ParallelDims,
    *,
    reduction: StepReduction | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    materialize: Callable[[list[nn.Module]], None] | None = None,
) -> ParallelModel:
    """Apply the layout of ``cfg.parallel`` to ``model``; under pipeline parallelism the last
    stage computes ``loss_fn(outputs, targets)``. Every gradient reducer divides as
    ``reduction`` (the step's contract, by default the one of ``dims``) says.

    ``model`` is on ``env.device``, or on the meta device with ``materialize``: that is called
    with this rank's parts of the model once they are sharded (tensor parallel, FSDP) and
    before anything reads their values (DDP's broadcast, the pipeline's stages), so a rank only
    ever allocates its own share."""
    parallel = cfg.parallel
    reduction = reduction or StepReduction(dims, world_size=env.world_size)
    if cfg.precision.float8 is not None:
        convert_float8(model, cfg, fsdp=_uses_fsdp(parallel.strategy, dims) and mesh is not None)
    parts: list[nn.Module] = [model]
    stages = None
    if dims.pp > 1:
        assert mesh is not None  # more than one rank: the caller built the mesh
        stages = split_model(
            model,
            parallel.pipeline,
            model_name=cfg.model.name,
            pp_rank=mesh["pp"].get_local_rank(),
            pp=dims.pp,
        )
        parts = list(stages[1])
    if dims.tp > 1:
        if not supports_tensor_parallel(model):
            raise ConfigError(
                f"parallel.tp={dims.tp}: model.name={cfg.model.name!r} has no tensor-parallel "
                f"plan (the gpt and llama families have one); use parallel.tp=1"
            )
        assert mesh is not None  # more than one rank: the caller built the mesh
        # The check above found the method; nn.Module's attribute typing cannot express it.
        cast(_TensorParallelModel, model).apply_tensor_parallel(
            mesh["tp"],
            loss_parallel=parallel.tensor_parallel.loss_parallel,
            sequence_parallel=parallel.tensor_parallel.sequence_parallel,
        )
    context = None
    if dims.cp > 1:
        assert mesh is not None  # more than one rank: the caller built the mesh
        method = attention_method(parallel.cp_attention, env.device)
        context = ContextParallel(
            mesh["cp"], seq_len=cfg.data.seq_len, method=method, device=env.device
        )
        context.apply(model)
    experts = None
    if dims.ep > 1 or dims.tp > 1:
        assert mesh is not None  # more than one rank: the caller built the mesh
        if modules := apply_expert_parallel(model, mesh, dims):
            experts = _Experts(modules, expert_dp_mesh(mesh, dims))
    # FSDP2 all-gathers parameters into flat contiguous buffers and refuses channels_last ones.
    # The inputs alone carry the layout there: the loader hands over channels_last images, and
    # convolutions (cuDNN, oneDNN) follow a channels_last input with contiguous weights, so every
    # activation stays NHWC.
    fsdp_wrapped = _uses_fsdp(parallel.strategy, dims) and mesh is not None
    if parallel.strategy == "fsdp" and mesh is None:
        logger.warning(
            "parallel.strategy=fsdp in a single process without a process group: the model runs "
            "unwrapped; launch with torchrun --nproc_per_node=1 for FSDP2 on one rank"
        )
    if cfg.model.channels_last and not fsdp_wrapped:
        model.to(memory_format=torch.channels_last)
    blocks = [b for b in parallel_blocks(model) if b is not None]
    apply_activation_checkpointing(
        blocks,
        parallel.activation_checkpointing,
        every=parallel.activation_checkpointing_every,
        model_name=cfg.model.name,
    )
    if cfg.compile.enabled:
        kwargs = {
            "backend": cfg.compile.backend,
            "mode": cfg.compile.mode,
            "fullgraph": cfg.compile.fullgraph,
            "dynamic": cfg.compile.dynamic,
        }
        for block in blocks or [model]:
            block.compile(**kwargs)
    if fsdp_wrapped and parallel.strategy == "fsdp":
        assert mesh is not None  # more than one rank: the caller built the mesh
        _fully_shard(
            parts, blocks, cfg, dp_mesh(mesh, dims), env.device, reduction, experts=experts
        )
    elif dims.dp_replicate > 1 and dims.pp > 1:
        # DDP x PP: torch's pipeline stages drive FSDP2's gradient sync over micro-batches, while a
        # DDP-wrapped stage fails DDP's bucket rebuild (torch 2.14). FSDP2 on a (replicate, shard=1)
        # mesh is plain replication: gradients all-reduced once per step, parameters whole.
        assert mesh is not None  # more than one rank: the caller built the mesh
        _fully_shard(parts, [], cfg, mesh["dp_replicate", "dp_shard"], env.device, reduction)
    if materialize is not None:
        materialize(parts)
    replicas = dims.dp_replicate * dims.cp  # the ranks DDP averages gradients over
    if not fsdp_wrapped and replicas > 1:
        group = None
        if replicas < env.world_size:
            assert mesh is not None  # more than one rank: the caller built the mesh
            group = replica_mesh(mesh, dims).get_group()
        reduction.check_average("DDP", replicas)
        parts = [wrap_data_parallel(part, parallel, env, process_group=group) for part in parts]
    elif not fsdp_wrapped:
        reduction.check_average("a layout without a gradient reducer", 1)
    if stages is None:
        return ParallelModel(parts[0], context=context)
    assert mesh is not None and loss_fn is not None, "a pipeline needs its group and its loss"
    ids, _, num_stages = stages
    pipeline = build_pipeline(
        parts,
        ids,
        num_stages,
        parallel.pipeline,
        group=mesh["pp"].get_group(),
        device=env.device,
        loss_fn=loss_fn,
    )
    return ParallelModel(model, pipeline)


def _uses_fsdp(strategy: str, dims: ParallelDims) -> bool:
    """Whether :func:`parallelize` wraps the model with FSDP2 (given a mesh): sharding, FSDP2 on a
    one-rank world, or replication under pipeline parallelism (see the DDP x PP branch there)."""
    one_rank = dims.sizes == (1,) * len(dims.sizes)
    return (strategy == "fsdp" and (dims.batch_ranks > 1 or one_rank)) or (
        dims.dp_replicate > 1 and dims.pp > 1
    )


@dataclass(frozen=True)
class _Experts:
    """The expert modules of an expert-parallel model and the mesh FSDP shards them over."""

    modules: list[nn.Module]
    mesh: DeviceMesh


def _fully_shard(
    parts: list[nn.Module],
    blocks: list[nn.Module],
    cfg: Config,
    mesh: DeviceMesh,
    device: torch.device,
    reduction: StepReduction,
    *,
    experts: _Experts | None = None,
) -> None:
    """FSDP2: each block is its own all-gather/reduce-scatter unit, then each part's root gathers
    the rest (stem, embeddings, head). A 2-D data mesh (dp_replicate x dp_shard) makes it HSDP.
    Expert-parallel experts are units of their own first, sharded over the ranks that hold the
    same experts. Every unit divides its reduced gradients as ``reduction`` says."""
    fsdp = cfg.parallel.fsdp
    param_dtype = _param_dtype(parts, cfg, device)
    policy = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == "fp32" else DTYPES[param_dtype],
        reduce_dtype=DTYPES[fsdp.reduce_dtype],
    )
    # Pinned host memory makes the shards' copies to the GPU asynchronous; pinning needs CUDA.
    offload = (
        CPUOffloadPolicy(pin_memory=device.type == "cuda") if fsdp.cpu_offload else OffloadPolicy()
    )

    def shard(unit: nn.Module, over: DeviceMesh, *, reshard: bool) -> None:
        fully_shard(
            unit, mesh=over, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload
        )
        reduction.divide_fsdp(unit, over)

    expert_units, expert_mesh = (experts.modules, experts.mesh) if experts else ([], mesh)
    for part in parts:
        inside = {id(m) for m in part.modules()}
        for module in expert_units:
            if id(module) in inside:
                shard(module, expert_mesh, reshard=fsdp.reshard_after_forward)
        for block in blocks:
            if id(block) in inside:
                shard(block, mesh, reshard=fsdp.reshard_after_forward)
        # The root's parameters are needed again right at the start of backward: keep them.
        shard(part, mesh, reshard=False)


def _param_dtype(parts: list[nn.Module], cfg: Config, device: torch.device) -> str:
    """FSDP's compute dtype for parameters: the run's precision (``precision.dtype=auto``
    resolved for ``device``). BatchNorm keeps fp32 running statistics that its kernels refuse to
    mix with bf16 weights, so ``auto`` stays fp32 for such models (autocast still computes
    convolutions in the run's precision)."""
    requested = cfg.parallel.fsdp.param_dtype
    has_batchnorm = any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) for part in parts for m in part.modules()
    )
    if requested == "auto":
        return "fp32" if has_batchnorm else resolve_precision_dtype(cfg.precision, device)
    if requested != "fp32" and has_batchnorm:
        raise ConfigError(
            f"parallel.fsdp.param_dtype={requested}: model.name={cfg.model.name!r} has BatchNorm "
            f"layers, whose fp32 running statistics do not mix with {requested} weights; use "
            f"parallel.fsdp.param_dtype=auto or fp32 (autocast still computes in precision.dtype)"
        )
    return requested


def set_gradient_sync(modules: list[nn.Module], enabled: bool) -> None:
    """FSDP2's counterpart of DDP's no_sync: skip the reduce-scatter on accumulation micro-steps."""
    for module in modules:
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled)


def defers_gradient_sync(model: nn.Module, *, fsdp_grad_sync: str) -> bool:
    """Whether :func:`gradient_sync` skips the reduction of ``model``'s gradients on the
    micro-steps before the last: always under DDP, under FSDP2 only with
    ``fsdp_grad_sync`` (``parallel.fsdp.grad_sync``) ``last_microstep``."""
    if isinstance(model, DistributedDataParallel):
        return True
    return isinstance(model, FSDPModule) and fsdp_grad_sync == "last_microstep"


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool, *, fsdp_grad_sync: str) -> Iterator[None]:
    """Reduce gradients in this backward (``enabled``: the last micro-step of an accumulation),
    or, where the layout defers it, not.

    DDP defers with ``no_sync``: its unreduced gradients are full-size anyway, so skipping the
    all-reduce costs no memory. FSDP2 reduce-scatters on every micro-step by default, so a rank
    holds only its gradient shard; deferring (``requires_gradient_sync=False``) would keep an
    unsharded fp32 gradient of every parameter until the last micro-step, which the user opts
    into with ``parallel.fsdp.grad_sync=last_microstep``."""
    if enabled or not defers_gradient_sync(model, fsdp_grad_sync=fsdp_grad_sync):
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        set_gradient_sync([model], False)
        try:
            yield
        finally:
            set_gradient_sync([model], True)


__all__ = [
    "COMPILE_MODES",
    "FSDP_DTYPES",
    "FSDP_GRAD_SYNC",
    "STRATEGIES",
    "ParallelModel",
    "defers_gradient_sync",
    "gradient_sync",
    "parallelize",
    "set_gradient_sync",
    "validate_compile",
    "validate_parallel",
]
