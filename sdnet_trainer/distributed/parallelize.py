"""Turn a bare model into this rank's parallel model, in the order the techniques compose:

    pipeline split -> tensor parallel -> channels_last -> activation checkpointing -> compile
    -> FSDP2 (fully_shard per block, then the root) or DDP

Every step is torch's own (``torch.distributed.pipelining``, DTensor ``parallelize_module`` via the
model's plan, composable ``checkpoint``, ``Module.compile``, ``fully_shard``, DDP). Activation
checkpointing and compile act on blocks in place, so parameter names never change and checkpoints
stay interchangeable between layouts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from sdnet_trainer.config.schema import Config
from sdnet_trainer.distributed.ddp import wrap_data_parallel
from sdnet_trainer.distributed.env import DistEnv
from sdnet_trainer.distributed.mesh import ParallelDims, dp_mesh
from sdnet_trainer.distributed.pipeline import split_model
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.parallel_spec import parallel_blocks, supports_tensor_parallel

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ParallelModel:
    """``model`` owns the parameters under their original names (optimizer, state dicts); the
    forward runs through ``model`` itself, or through ``stages`` (this rank's pipeline stages)."""

    model: nn.Module
    stages: list[nn.Module] | None = None
    stage_ids: list[int] | None = None
    num_stages: int = 1


def parallelize(model: nn.Module, cfg: Config, env: DistEnv, mesh: DeviceMesh | None,
                dims: ParallelDims) -> ParallelModel:
    """Apply the layout of ``cfg.parallel`` to ``model`` (already on ``env.device``)."""
    parallel = cfg.parallel
    parts: list[nn.Module] = [model]
    result = ParallelModel(model)
    if dims.pp > 1:
        ids, stages, num_stages = split_model(model, parallel.pipeline, model_name=cfg.model.name,
                                              pp_rank=mesh["pp"].get_local_rank(), pp=dims.pp)
        parts = list(stages)
        result = ParallelModel(model, stages, ids, num_stages)
    if dims.tp > 1:
        if not supports_tensor_parallel(model):
            raise ConfigError(f"parallel.tp={dims.tp}: model.name={cfg.model.name!r} has no tensor-parallel "
                              f"plan (the gpt family has one); use parallel.tp=1")
        model.apply_tensor_parallel(mesh["tp"], loss_parallel=parallel.tensor_parallel.loss_parallel,
                                    sequence_parallel=parallel.tensor_parallel.sequence_parallel)
    if cfg.model.channels_last:
        model.to(memory_format=torch.channels_last)
    blocks = [b for b in parallel_blocks(model) if b is not None]
    if cfg.model.activation_checkpointing:
        if not blocks:
            raise ConfigError(f"model.activation_checkpointing=true: model.name={cfg.model.name!r} has no "
                              f"blocks to checkpoint")
        for block in blocks:
            checkpoint_activations(block)
    if cfg.compile.enabled:
        kwargs = {"backend": cfg.compile.backend, "mode": cfg.compile.mode, "fullgraph": cfg.compile.fullgraph,
                  "dynamic": cfg.compile.dynamic}
        for block in blocks or [model]:
            block.compile(**kwargs)
    if parallel.strategy == "fsdp" and dims.dp > 1:
        _fully_shard(parts, blocks, cfg, dp_mesh(mesh, dims))
    elif dims.dp_replicate > 1 and dims.pp > 1:
        # DDP x PP: torch's pipeline stages drive FSDP2's gradient sync over micro-batches, while a
        # DDP-wrapped stage fails DDP's bucket rebuild (torch 2.14). FSDP2 on a (replicate, shard=1)
        # mesh is plain replication: gradients all-reduced once per step, parameters whole.
        _fully_shard(parts, [], cfg, mesh["dp_replicate", "dp_shard"])
    elif dims.dp_replicate > 1:
        group = mesh["dp_replicate"].get_group() if dims.dp_replicate < env.world_size else None
        parts = [wrap_data_parallel(part, parallel, env, process_group=group) for part in parts]
    if result.stages is not None:
        result.stages = parts
    else:
        result.model = parts[0]
    return result


def _fully_shard(parts: list[nn.Module], blocks: list[nn.Module], cfg: Config, mesh: DeviceMesh) -> None:
    """FSDP2: each block is its own all-gather/reduce-scatter unit, then each part's root gathers
    the rest (stem, embeddings, head). A 2-D data mesh (dp_replicate x dp_shard) makes it HSDP."""
    fsdp = cfg.parallel.fsdp
    param_dtype = _param_dtype(parts, cfg)
    policy = MixedPrecisionPolicy(param_dtype=None if param_dtype == "fp32" else _DTYPES[param_dtype],
                                  reduce_dtype=_DTYPES[fsdp.reduce_dtype])
    offload = CPUOffloadPolicy() if fsdp.cpu_offload else OffloadPolicy()
    kwargs = {"mesh": mesh, "mp_policy": policy, "offload_policy": offload}
    for part in parts:
        inside = {id(m) for m in part.modules()}
        for block in blocks:
            if id(block) in inside:
                fully_shard(block, reshard_after_forward=fsdp.reshard_after_forward, **kwargs)
        # The root's parameters are needed again right at the start of backward: keep them.
        fully_shard(part, reshard_after_forward=False, **kwargs)


def _param_dtype(parts: list[nn.Module], cfg: Config) -> str:
    """FSDP's compute dtype for parameters. BatchNorm keeps fp32 running statistics that its
    kernels refuse to mix with bf16 weights, so ``auto`` stays fp32 for such models (autocast
    still computes convolutions in precision.dtype)."""
    requested = cfg.parallel.fsdp.param_dtype
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for part in parts for m in part.modules())
    if requested == "auto":
        return "fp32" if has_batchnorm else cfg.precision.dtype
    if requested != "fp32" and has_batchnorm:
        raise ConfigError(f"parallel.fsdp.param_dtype={requested}: model.name={cfg.model.name!r} has BatchNorm "
                          f"layers, whose fp32 running statistics do not mix with {requested} weights; use "
                          f"parallel.fsdp.param_dtype=auto or fp32 (autocast still computes in precision.dtype)")
    return requested


def set_gradient_sync(modules: list[nn.Module], enabled: bool) -> None:
    """FSDP2's counterpart of DDP's no_sync: skip the reduce-scatter on accumulation micro-steps."""
    for module in modules:
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled)


__all__ = ["ParallelModel", "parallelize", "set_gradient_sync"]
