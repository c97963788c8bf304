"""Dry run: check a large layout on one machine, without its GPUs.

    python -m sdnet_trainer --dry-run world_size=1024 +recipe=gpt_tp_fsdp model=gpt_1b \\
        parallel.tp=8 parallel.pp=4 loop.global_batch_size=128 [ranks=0,256] [json=plan.json]

The config is validated for that world size as a launch would, then for each rank asked for
(default: the first rank of every pipeline stage, the ranks whose roles differ) torch's fake
process group stands in for the real one, the mesh is built, and the model is built on the meta
device and parallelized by the same code as a real rank (``Trainer.build_model``,
``parallelize``, ``Trainer.build_optimizer``). Nothing is allocated, so a 1B model on 1,024 ranks
plans in seconds.

First it names the settings that change what a rank keeps and sends: context parallel and its
attention (``parallel.cp_attention=auto`` is the ring, as on the launch's GPUs), float8 (with
the Linear layers converted) and activation checkpointing. Per rank it prints:

- parameter, gradient and optimizer-state bytes, counted from the rank's shards as
  ``observability.memory.training_state_bytes`` counts them in a real run (the optimizer takes
  one step on meta tensors so its state exists);
- an activation estimate: the bytes one forward of one micro-batch of the whole model keeps for
  backward, measured on the meta model with the run's float8 layers and activation checkpointing
  (``none``, ``full`` every n-th block, ``selective``) on the ``seq_len / cp`` tokens a rank
  holds, the keys and values the all-gather attention gathers included (``plan/model_stats.py``:
  fp32, fused attention; the parameters it keeps a view of are counted once, as parameters),
  scaled to this rank's pipeline stage by its share of the parameters, the samples' part divided
  by tensor parallelism, and multiplied by the micro-batches the stage keeps in flight;
- the collectives of one optimizer step and the bytes each moves (data parallel from the shards,
  over ``dp_shard x cp`` for FSDP and ``dp_replicate x cp`` for DDP; tensor and pipeline
  parallel from the activation sizes; context parallel from the measured keys and values;
  expert parallel's all-to-alls from the tokens a rank routes);
- for a mixture of experts, the bytes of the rank's expert weights and of their optimizer state
  (under ``parallel.ep`` a rank holds ``num_experts / ep`` experts, sharded by FSDP over the
  ``dp_shard / ep`` ranks that hold the same ones), part of the totals above;
- its start (``plan/start_cost.py``), from its own init steps and its family's state-dict adapter:
  initialising its shards (device and host bytes, values generated, the fill's scratch) and
  reading them from a Hugging Face folder (bytes read, the largest read's host buffers).

A config error a launch would hit (validation, the model's build, the layout) is printed as the
launch prints it, with exit code 2.
"""

from __future__ import annotations

import copy
import importlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from sdnet_trainer.config import Config
from sdnet_trainer.distributed.activation_checkpointing import saves
from sdnet_trainer.distributed.batching import batch_layout
from sdnet_trainer.distributed.context_parallel import ContextParallel
from sdnet_trainer.distributed.env import DistEnv
from sdnet_trainer.distributed.mesh import ParallelDims, build_mesh, parallel_dims
from sdnet_trainer.distributed.parallelize import _uses_fsdp, parallelize
from sdnet_trainer.lazy import loaded_types
from sdnet_trainer.models.init import init_steps
from sdnet_trainer.models.moe import GroupedExperts
from sdnet_trainer.models.parallel_spec import parallel_blocks
from sdnet_trainer.models.registry import decoder_sizes
from sdnet_trainer.observability.memory import step_on_meta, training_state_bytes
from sdnet_trainer.plan.experts import expert_bytes, expert_parallel_collectives
from sdnet_trainer.plan.model_stats import Activations, ContextShare, saved_activations
from sdnet_trainer.plan.start_cost import StartCost, start_cost
from sdnet_trainer.runtime.precision import DTYPES
from sdnet_trainer.training.classes import resolve_trainer_class


@dataclass
class Collective:
    kind: str  # all_gather, reduce_scatter, all_reduce, send/recv, ...
    over: str  # the mesh dimension(s) it runs on
    count: int  # per optimizer step
    bytes_each: int  # the tensor each call moves (full size, before the ring's (n-1)/n)


@dataclass
class RankPlan:
    rank: int
    coordinates: dict[str, int]
    params: int
    grads: int
    optim: int
    activations: int  # an estimate (module docstring)
    collectives: list[Collective] = field(default_factory=list)
    float8_layers: int = 0  # the model's Linear layers that compute in float8
    linear_layers: int = 0  # all its Linear layers
    activation_dtype: str = "fp32"  # what the activation estimate was measured in
    expert_params: int = 0  # of params: a mixture of experts' expert weights on this rank
    expert_optim: int = 0  # of optim: their optimizer state
    start: StartCost | None = None  # what allocating and initialising or loading it costs


class _Replicated(Exception):
    """Raised inside parallelize to stop before DDP wraps a replicated model (see plan_rank)."""


@contextmanager
def fake_group(rank: int, world_size: int) -> Iterator[None]:
    """torch's fake process group: every collective returns at once, moving nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_dtensor_caches()


def forget_dtensor_caches() -> None:
    """Empty DTensor's caches of sharding decisions and redistribution plans.

    They key on device meshes, and two meshes of one shape compare equal whatever their process
    group and rank: after a dry run, a real run of the same layout in this process would be
    served specs holding the fake group's mesh, whose coordinates are the planned rank's, and
    every rank would, for one, write rank 0's slice of each initial weight (``parallel=auto``
    plans in the process that then trains)."""
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    # Each where this torch release has it: the C++ dispatch's cache, the Python one (this
    # thread's), the redistribution planners.
    for clear in (
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
        getattr(propagator.propagate_op_sharding, "cache_clear", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
    ):
        if clear is not None:
            clear()


def plan_rank(cfg: Config, rank: int, world_size: int) -> RankPlan:
    """Build rank ``rank``'s part of the model as a real launch would, on meta tensors."""
    dims = parallel_dims(cfg.parallel, world_size)
    env = DistEnv(rank=rank, world_size=world_size, device=torch.device("cpu"), backend="fake")
    build = buildable(cfg, dims)
    trainer = resolve_trainer_class(cfg.trainer._target_)(build, env=env)
    with fake_group(rank, world_size):
        mesh = build_mesh(dims, "cpu")
        with torch.device("meta"):
            model = trainer.build_model()
        # The Trainer's init steps of its meta build (build_deferred); None: it would build the
        # model again on the CPU, with its values.
        steps = init_steps(model)
        held: list[nn.Module] = []
        start: list[StartCost] = []

        def keep_meta(parts: list[nn.Module]) -> None:
            # A real rank allocates and initialises its parts here (or reads them from a
            # Hugging Face folder): rehearsed on the same parts, steps and adapter. DDP's
            # wrapping comes next and reads values (it checks shapes across ranks with a
            # collective), so a replicated layout stops here: its bytes are the bare parts'.
            held.extend(parts)
            start.append(start_cost(cfg, model, steps, parts))
            if replicated:
                raise _Replicated

        replicated = not _uses_fsdp(cfg.parallel.strategy, dims) and dims.dp_replicate * dims.cp > 1
        try:
            parallel = parallelize(
                model, build, env, mesh, dims, loss_fn=trainer.loss_fn, materialize=keep_meta
            )
            trained, roots = (
                parallel.model,
                (parallel.pipeline.modules if parallel.pipeline is not None else [parallel.model]),
            )  # under pipeline parallelism the stages are the FSDP roots, outside the model
        except _Replicated:
            trained, roots = model, held
        optimizer = trainer.build_optimizer(trained)
        step_on_meta(trained, optimizer)
        sizes = training_state_bytes(trained, optimizer)
        experts = expert_bytes(trained, optimizer)
        blocks = {id(b) for b in parallel_blocks(model) if b is not None}
        collectives = _data_parallel_collectives(cfg, roots, blocks, dims)
        # Measured here: the all-gather attention's keys and values are gathered over this
        # fake group's cp mesh.
        saved = _saved(cfg, dims, mesh)
    # Global sizes (DTensor numel is the full tensor's): this rank's pipeline stage, whole.
    stage_numel = sum(p.numel() for p in model.parameters())
    stage = dims.coordinates(rank)["pp"]
    float8 = loaded_types("torchao.float8.float8_linear", "Float8Linear")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return RankPlan(
        rank=rank,
        coordinates=dims.coordinates(rank),
        params=sizes["params"],
        grads=sizes["grads"],
        optim=sizes["optim"],
        activations=_activation_estimate(cfg, dims, saved, stage_numel, stage),
        collectives=collectives
        + model_parallel_collectives(cfg, dims, stage)
        + context_parallel_collectives(cfg, dims, saved)
        + [
            Collective(*c)
            for c in expert_parallel_collectives(
                cfg,
                dims,
                stage,
                micro_steps=_micro_steps(cfg, dims),
                micro_batch=_micro_batch(cfg, dims),
                width=dtype_bytes(gpu_dtype(cfg)),
                recomputed=lambda block, op: _recomputed(cfg, block, op),
            )
        ],
        float8_layers=sum(isinstance(m, float8) for m in linears),
        linear_layers=len(linears),
        activation_dtype=saved.dtype,
        expert_params=experts["params"],
        expert_optim=experts["optim"],
        start=start[0] if start else None,
    )


def cp_attention(cfg: Config) -> str:
    """The attention context parallel runs on the launch's devices: ``auto`` is the ring on
    GPUs, which the dry run assumes (as :func:`gpu_dtype` does) unless ``dist.device=cpu``."""
    requested = cfg.parallel.cp_attention
    if requested != "auto":
        return requested
    return "allgather" if cfg.dist.device == "cpu" else "ring"


def buildable(cfg: Config, dims: ParallelDims) -> Config:
    """``cfg`` as this machine can check and build it: the ring attention needs CUDA, which the
    dry run may not have (as the launch's float8 needs a GPU it does not check), and changes no
    parameter, so its layouts are validated and built with the all-gather attention (and their
    attention accounted as the ring's: :func:`context_parallel_collectives`)."""
    if dims.cp == 1 or cp_attention(cfg) != "ring":
        return cfg
    build = copy.deepcopy(cfg)
    build.parallel.cp_attention = "allgather"
    return build


def _saved(cfg: Config, dims: ParallelDims, mesh: DeviceMesh) -> Activations:
    """The activations of one forward of the whole model as this layout keeps them (checkpointing
    mode, float8, a rank's share of each sequence), measured once per setting in a process."""
    parallel = cfg.parallel
    context = None
    if dims.cp > 1:
        method = cp_attention(cfg)

        def gather_keys(model: nn.Module) -> None:
            share = ContextParallel(
                mesh["cp"],
                seq_len=cfg.data.seq_len,
                method="allgather",
                device=torch.device("meta"),
            )
            share.apply(model)

        context = ContextShare(dims.cp, method, gather_keys if method == "allgather" else None)
    return saved_activations(
        cfg,
        parallel.activation_checkpointing,
        every=parallel.activation_checkpointing_every,
        context=context,
    )


def gpu_dtype(cfg: Config) -> str:
    """The compute dtype on the launch's GPUs: ``precision.dtype=auto`` picks bf16 on GPUs with
    native bf16 (A100, H100 and later), assumed here since this machine may have none."""
    return "bf16" if cfg.precision.dtype == "auto" else cfg.precision.dtype


def fsdp_param_dtype(cfg: Config) -> str:
    """The dtype FSDP gathers parameters in: ``parallel.fsdp.param_dtype``, ``auto`` following
    the compute dtype."""
    param_dtype = cfg.parallel.fsdp.param_dtype
    return gpu_dtype(cfg) if param_dtype == "auto" else param_dtype


def dtype_bytes(name: str) -> int:
    return torch.empty((), dtype=DTYPES[name]).element_size()


def _data_parallel_collectives(
    cfg: Config, roots: list[nn.Module], blocks: set[int], dims: ParallelDims
) -> list[Collective]:
    """FSDP: per unit an all-gather of its parameters in forward (again in backward when it
    reshards) and a reduce-scatter of its gradients, every micro-step (with
    ``parallel.fsdp.grad_sync=last_microstep``: once per step), over the shard group
    ``dp_shard x cp``: context-parallel peers hold the same parameters and shard them too
    (expert-parallel experts: over the ``dp_shard / ep`` ranks that hold the same ones).
    Replicated parameters (DDP, ZeRO-1): one all-reduce of the gradients per step over the
    replicas and their context-parallel peers (ZeRO-1: then a broadcast of the updated
    parameters)."""
    if dims.batch_ranks == 1:
        return []
    micro = _micro_steps(cfg, dims)
    units = {id(m): m for r in roots for m in r.modules() if isinstance(m, FSDPModule)}
    if units:
        fsdp = cfg.parallel.fsdp
        param_dtype = fsdp_param_dtype(cfg)
        shard = dims.dp_shard * dims.cp
        shard_over = "dp_shard x cp" if dims.cp > 1 else "dp_shard"
        out = []
        for unit in units.values():
            # This rank's shard times the shard group: the unit's parameters as the group
            # gathers them (a tensor-parallel rank's part of each, not the global size).
            owned = _owned(unit)
            local = sum(_local_numel(p) for p in owned)
            # Gradients of trained parameters only (model.lora freezes the base).
            trained = sum(_local_numel(p) for p in owned if p.requires_grad)
            if local == 0:
                continue  # a stage root whose parameters all sit in its blocks
            name = type(unit).__name__.removeprefix("FSDP")
            experts = isinstance(unit, GroupedExperts)
            group = shard // dims.ep if experts else shard
            over = "dp_shard_mod_ep" if experts else shard_over
            if group > 1:
                # The roots keep their parameters from forward to backward (parallelize).
                resharded = id(unit) in blocks or experts
                gathers = 2 if resharded and fsdp.reshard_after_forward else 1
                full = local * group
                out.append(
                    Collective(
                        f"all_gather ({name})",
                        over,
                        gathers * micro,
                        full * dtype_bytes(param_dtype),
                    )
                )
                reductions = micro if fsdp.grad_sync == "every_microstep" else 1
                reduced = trained * group * dtype_bytes(fsdp.reduce_dtype)
                if trained:
                    out.append(Collective(f"reduce_scatter ({name})", over, reductions, reduced))
            if dims.dp_replicate > 1 and trained:  # HSDP, or replication under pipeline parallelism
                out.append(
                    Collective(
                        f"all_reduce ({name})",
                        "dp_replicate",
                        1,
                        trained * dtype_bytes(fsdp.reduce_dtype),
                    )
                )
        return out
    if dims.cp > 1:
        over = "dp_replicate x cp"
    else:
        over = "dp_replicate x dp_shard" if dims.dp_replicate > 1 else "dp"
    grads = sum(
        p.numel() * p.element_size() for r in roots for p in r.parameters() if p.requires_grad
    )
    out = [Collective("all_reduce (gradients)", over, 1, grads)]
    if cfg.parallel.strategy == "zero1":
        out.append(Collective("broadcast (updated parameters)", over, 1, grads))
    return out


def _local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def _owned(unit: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``unit``'s own FSDP group: not those of a nested FSDP unit. (The nested
    units' parameters are collected once: asking each parameter whether some nested unit holds
    it walks the model once per parameter: seconds for a model of hundreds of units.)"""
    nested = {
        id(q)
        for module in unit.modules()
        if module is not unit and isinstance(module, FSDPModule)
        for q in module.parameters()
    }
    return [p for p in unit.parameters() if id(p) not in nested]


def _micro_steps(cfg: Config, dims: ParallelDims) -> int:
    """Forwards and backwards a rank runs per optimizer step: the accumulation steps, or the
    pipeline's micro-batches."""
    if dims.pp > 1:
        return cfg.parallel.pipeline.microbatches
    return batch_layout(cfg, dims.pp * dims.dp * dims.cp * dims.tp).grad_accum_steps


def _micro_batch(cfg: Config, dims: ParallelDims) -> int:
    size = batch_layout(cfg, dims.pp * dims.dp * dims.cp * dims.tp).micro_batch_size
    return max(1, size // cfg.parallel.pipeline.microbatches) if dims.pp > 1 else size


def _activation_estimate(
    cfg: Config, dims: ParallelDims, saved: Activations, stage_numel: int, stage: int
) -> int:
    """Bytes kept for backward (see the module docstring): an estimate, not a measurement."""
    pipe = cfg.parallel.pipeline
    in_flight = 1
    if dims.pp > 1:  # GPipe runs every forward before any backward; 1F1B keeps pp - stage
        gpipe = pipe.schedule == "GPipe"
        in_flight = pipe.microbatches if gpipe else min(pipe.microbatches, dims.pp - stage)
    # A stage's share of the activations taken as its share of the parameters.
    stage_fraction = stage_numel / max(1, saved.params)
    kept = per_tensor_parallel_rank(saved, _micro_batch(cfg, dims), dims.tp)
    return int(kept * stage_fraction * in_flight)


def per_tensor_parallel_rank(saved: Activations, batch: int, tp: int) -> float:
    """What one tensor-parallel rank keeps of ``saved`` at ``batch``: the activations of the
    samples split with the heads and the hidden units; what does not grow with the batch (the
    rotary angles, the all-gather attention's mask) whole, since no layout splits it."""
    return saved.fixed + saved.per_sample * batch / tp


def _recomputed(cfg: Config, block: int, op: object) -> bool:
    """Whether activation checkpointing runs ``op`` (an op overload packet) of block ``block``
    again in backward: ``full`` in every checkpointed block, ``selective`` unless the op is one
    whose output it saves (``saves``)."""
    mode = cfg.parallel.activation_checkpointing
    if mode == "full":
        return block % cfg.parallel.activation_checkpointing_every == 0
    return mode == "selective" and not saves(op)


def model_parallel_collectives(cfg: Config, dims: ParallelDims, stage: int) -> list[Collective]:
    """Tensor parallel (GPT, Llama): per block two all-reduces of the (micro-batch, tokens, dim)
    stream in forward and two in backward, and the forward's two again where activation
    checkpointing recomputes them (with sequence parallel: a reduce-scatter and an all-gather in
    place of each all-reduce; the tokens are a rank's ``seq_len / cp``). Pipeline: per
    micro-batch one send forward and one backward at each stage boundary this rank has."""
    out: list[Collective] = []
    sizes = decoder_sizes(cfg.model)
    if sizes is None or (dims.tp == 1 and dims.pp == 1):
        return out
    dim, n_layers = sizes
    micro = _micro_steps(cfg, dims)
    dtype = gpu_dtype(cfg)
    tokens = cfg.data.seq_len // dims.cp
    stream = _micro_batch(cfg, dims) * tokens * dim * dtype_bytes(dtype)
    layers = math.ceil(n_layers / dims.pp)
    if dims.tp > 1:
        sequence_parallel = cfg.parallel.tensor_parallel.sequence_parallel
        functional = torch.ops._c10d_functional
        op = functional.reduce_scatter_tensor if sequence_parallel else functional.all_reduce
        first = stage * layers
        per_step = sum(4 + 2 * _recomputed(cfg, b, op) for b in range(first, first + layers))
        count = per_step * micro
        if sequence_parallel:
            for kind in ("reduce_scatter", "all_gather"):
                out.append(Collective(f"{kind} (TP stream)", "tp", count, stream))
        else:
            out.append(Collective("all_reduce (TP stream)", "tp", count, stream))
    if dims.pp > 1:
        boundaries = (stage > 0) + (stage < dims.pp - 1)
        out.append(
            Collective("send/recv (pipeline activations)", "pp", 2 * boundaries * micro, stream)
        )
    return out


def context_parallel_collectives(
    cfg: Config, dims: ParallelDims, saved: Activations
) -> list[Collective]:
    """Context parallel, per attention call (a block) and micro-step, over ``cp``, from the keys
    and values the measure saw (``Activations.attention``, split by tensor parallelism's heads),
    in the compute dtype:

    - ``allgather``: the keys and the values each all-gathered in forward (torch's
      ``flex_cp_allgather``), again where activation checkpointing recomputes the forward, and
      their gradients reduce-scattered in backward;
    - ``ring``, as torch's ring attention runs with its default rotation (all-gather): the keys
      and values gathered together in forward (again under full checkpointing; selective saves
      the attention kernel's output) and once more in backward, where the keys' and values'
      gradients (fp32) also pass around the ring, ``cp`` times; with the all-to-all rotation,
      ``cp - 1`` passes of this rank's keys and values in forward and in backward instead of
      the gathers."""
    if dims.cp == 1 or not saved.attention:
        return []
    micro, batch = _micro_steps(cfg, dims), _micro_batch(cfg, dims)
    width = dtype_bytes(gpu_dtype(cfg))
    out: list[Collective] = []
    if cp_attention(cfg) == "allgather":
        # Imported for its op (torch.ops.cplib), which the all-gather attention runs.
        importlib.import_module("torch.distributed.tensor.experimental._context_parallel")
        gather = torch.ops.cplib.flex_cp_allgather
        for block, (keys, values) in enumerate(saved.attention):
            runs = 1 + _recomputed(cfg, block, gather)
            for what, elements in (("key", keys), ("value", values)):
                size = elements * batch // dims.tp * width
                out.append(Collective(f"all_gather (CP {what}s)", "cp", runs * micro, size))
                out.append(Collective(f"reduce_scatter (CP {what} gradients)", "cp", micro, size))
        return out
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _cp_options,
        _RotateMethod,
    )

    kernel = torch.ops.aten._scaled_dot_product_flash_attention
    gathers = _cp_options.rotate_method == _RotateMethod.ALL_GATHER
    for block, (keys, values) in enumerate(saved.attention):
        whole = (keys + values) * batch // dims.tp
        forwards = 1 + _recomputed(cfg, block, kernel)
        if gathers:
            out.append(
                Collective(
                    "all_gather (ring keys, values)", "cp", (forwards + 1) * micro, whole * width
                )
            )
        else:
            steps = (forwards + 1) * (dims.cp - 1) * micro
            out.append(
                Collective("send/recv (ring keys, values)", "cp", steps, whole // dims.cp * width)
            )
        out.append(
            Collective(
                "send/recv (ring key, value gradients)", "cp", dims.cp * micro, whole // dims.cp * 4
            )
        )
    return out
