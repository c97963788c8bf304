"""Whole-config validation: every rule that involves more than one key or the world size.

Runs before any process group exists, on every rank, so a bad launch stops everywhere with the
same message. Each message names the keys and the numbers involved.
"""

from __future__ import annotations

import difflib
import importlib
import logging
from dataclasses import dataclass

import torch

from sdnet_trainer.config.schema import Config
from sdnet_trainer.distributed.comm import validate_comm
from sdnet_trainer.distributed.env import resolve_device
from sdnet_trainer.distributed.mesh import ParallelDims, parallel_dims
from sdnet_trainer.distributed.pipeline import check_schedule
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("constant", "cosine", "step", "multistep")
STRATEGIES = ("ddp", "fsdp", "zero1")
FSDP_DTYPES = ("auto", "fp32", "bf16", "fp16")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
OPTIM_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")
LM_DATASETS = ("tokens", "text")
BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cpu", "cuda")
PROGRESS = ("auto", "on", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
BATCH_POLICIES = ("keep_global", "keep_per_rank")
NONFINITE = ("abort", "skip")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}{hint}")


def _positive(key: str, value: float | None, *, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None:
        if not allow_none:
            raise ConfigError(f"{key} must be set")
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's samples split: global = world size x accumulation x micro-batch."""

    global_batch_size: int
    grad_accum_steps: int
    micro_batch_size: int


def batch_layout(cfg: Config, world_size: int) -> BatchLayout:
    """The batch split for ``world_size`` ranks; the batch rules live here alone.

    Without ``loop.micro_batch_size`` the micro-batch is derived from the global batch. With it,
    ``elastic.batch_policy`` says what survives a change of world size: ``keep_global`` re-derives
    the accumulation, ``keep_per_rank`` keeps accumulation and micro-batch (the global batch follows).
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
                f"choose a global batch that is a multiple of {split}")
        return BatchLayout(loop.global_batch_size, loop.grad_accum_steps, loop.global_batch_size // split)
    if cfg.elastic.enabled and cfg.elastic.batch_policy == "keep_per_rank":
        return BatchLayout(world_size * loop.grad_accum_steps * micro, loop.grad_accum_steps, micro)
    per_step = world_size * micro
    if loop.global_batch_size % per_step:
        raise ConfigError(
            f"loop.global_batch_size={loop.global_batch_size} is not divisible by {ranks} "
            f"x loop.micro_batch_size ({micro}) = {per_step}, so no whole number of accumulation steps "
            f"keeps it; change one of them or use elastic.batch_policy=keep_per_rank")
    accum = loop.global_batch_size // per_step
    if not cfg.elastic.enabled and accum != loop.grad_accum_steps:
        raise ConfigError(
            f"loop.micro_batch_size={micro} with {ranks} needs loop.grad_accum_steps="
            f"{accum} for loop.global_batch_size={loop.global_batch_size}, not {loop.grad_accum_steps} "
            f"(with elastic.enabled=true the accumulation is derived)")
    return BatchLayout(loop.global_batch_size, accum, micro)


def _dp_phrase(dims: ParallelDims, world_size: int) -> str:
    if dims.dp == world_size:
        return f"world size ({world_size})"
    return (f"data-parallel size ({dims.dp} = world size {world_size} / (parallel.tp {dims.tp} x "
            f"parallel.pp {dims.pp}))")


def resolve_optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """``optim.name``: a class of torch.optim (``AdamW``) or a dotted path (``my_pkg.Lion``)."""
    module_name, _, cls_name = name.rpartition(".")
    try:
        module = importlib.import_module(module_name or "torch.optim")
        cls = getattr(module, cls_name)
    except (ImportError, AttributeError):
        known = [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                 and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)]
        close = difflib.get_close_matches(cls_name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"optim.name={name!r} is neither a torch.optim class nor an importable "
                          f"dotted path{hint}") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optim.name={name!r} is not a torch.optim.Optimizer subclass")
    return cls


def validate(cfg: Config, *, world_size: int) -> None:
    """Raise ConfigError on the first rule the config breaks."""
    loop, data, optim, sched = cfg.loop, cfg.data, cfg.optim, cfg.sched

    _positive("loop.global_batch_size", loop.global_batch_size)
    _positive("loop.grad_accum_steps", loop.grad_accum_steps)
    _positive("loop.micro_batch_size", loop.micro_batch_size, allow_none=True)
    _choice("elastic.batch_policy", cfg.elastic.batch_policy, BATCH_POLICIES)
    if cfg.elastic.batch_policy == "keep_per_rank" and cfg.elastic.enabled and loop.micro_batch_size is None:
        raise ConfigError("elastic.batch_policy=keep_per_rank needs loop.micro_batch_size (the per-rank "
                          "batch to keep when the world size changes)")
    batch_layout(cfg, world_size)
    if (loop.max_steps is None) == (loop.max_epochs is None):
        raise ConfigError(f"set exactly one of loop.max_steps ({loop.max_steps}) and "
                          f"loop.max_epochs ({loop.max_epochs}); the other must be null")
    _positive("loop.max_steps", loop.max_steps, allow_none=True)
    _positive("loop.max_epochs", loop.max_epochs, allow_none=True)
    _positive("loop.eval_every_n_steps", loop.eval_every_n_steps, allow_none=True)
    _positive("loop.eval_batch_size", loop.eval_batch_size, allow_none=True)
    _positive("logging.log_every_n_steps", cfg.logging.log_every_n_steps)

    if data.name in LM_DATASETS:
        _validate_language_model(cfg)
    elif cfg.model.num_classes != data.num_classes:
        raise ConfigError(f"model.num_classes={cfg.model.num_classes} differs from "
                          f"data.num_classes={data.num_classes}")
    _positive("data.image_size", data.image_size)
    _positive("data.num_workers", data.num_workers, allow_zero=True)

    resolve_optimizer_class(optim.name)
    _positive("optim.lr", optim.lr, allow_zero=True)
    if optim.clip_grad_norm is not None and optim.clip_grad_value is not None:
        raise ConfigError(f"optim.clip_grad_norm={optim.clip_grad_norm} and optim.clip_grad_value="
                          f"{optim.clip_grad_value} are both set; clip by norm or by value, not both")
    _positive("optim.clip_grad_norm", optim.clip_grad_norm, allow_none=True)
    _positive("optim.clip_grad_value", optim.clip_grad_value, allow_none=True)
    if not 0.0 <= cfg.loss.label_smoothing < 1.0:
        raise ConfigError(f"loss.label_smoothing={cfg.loss.label_smoothing} must be in [0, 1)")

    _choice("sched.name", sched.name, SCHEDULES)
    _positive("sched.warmup_steps", sched.warmup_steps, allow_zero=True)
    if not 0.0 <= sched.warmup_start_factor <= 1.0:
        raise ConfigError(f"sched.warmup_start_factor={sched.warmup_start_factor} must be in [0, 1]")
    if not 0.0 <= sched.min_lr_ratio <= 1.0:
        raise ConfigError(f"sched.min_lr_ratio={sched.min_lr_ratio} must be in [0, 1]")
    if sched.name == "step":
        _positive("sched.step_size", sched.step_size)
    if sched.name == "multistep" and list(sched.milestones) != sorted(set(sched.milestones)):
        raise ConfigError(f"sched.milestones={list(sched.milestones)} must be strictly increasing")

    _choice("optim.implementation", optim.implementation, OPTIM_IMPLEMENTATIONS)
    _choice("precision.dtype", cfg.precision.dtype, PRECISIONS)
    _validate_parallel(cfg, world_size)
    validate_comm(cfg, world_size)
    if cfg.compile.mode not in COMPILE_MODES:
        raise ConfigError(f"compile.mode={cfg.compile.mode!r} is not one of "
                          f"{', '.join(str(m) for m in COMPILE_MODES)}")
    _choice("dist.backend", cfg.dist.backend, BACKENDS)
    _choice("dist.device", cfg.dist.device, DEVICES)
    _positive("dist.timeout_s", cfg.dist.timeout_s)
    if cfg.dist.backend == "nccl" and cfg.dist.device == "cpu":
        raise ConfigError("dist.backend=nccl needs dist.device=cuda (or auto on a GPU machine); "
                          "use dist.backend=gloo for CPU training")
    if cfg.dist.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("dist.device=cuda but torch.cuda.is_available() is False on this machine")
    if cfg.parallel.sync_batchnorm and resolve_device(cfg.dist, local_rank=0).type != "cuda":
        raise ConfigError("parallel.sync_batchnorm=true needs CUDA devices (torch's SyncBatchNorm runs "
                          "only on GPUs); on the CPU keep it false")
    ckpt = cfg.checkpoint
    _positive("checkpoint.every_n_steps", ckpt.every_n_steps, allow_none=True)
    _positive("checkpoint.every_n_minutes", ckpt.every_n_minutes, allow_none=True)
    _positive("checkpoint.keep_last", ckpt.keep_last)
    if not ckpt.resume:
        raise ConfigError("checkpoint.resume must be auto, none or a checkpoint path")
    _choice("health.nonfinite", cfg.health.nonfinite, NONFINITE)
    _positive("health.hang_timeout_s", cfg.health.hang_timeout_s, allow_none=True)
    _positive("health.heartbeat_s", cfg.health.heartbeat_s, allow_none=True)
    _choice("logging.progress_bar", cfg.logging.progress_bar, PROGRESS)
    _choice("logging.level", cfg.logging.level.upper(), LOG_LEVELS)


def _validate_language_model(cfg: Config) -> None:
    data, gpt = cfg.data, cfg.model.gpt
    if cfg.model.name == "gpt":
        if data.vocab_size != gpt.vocab_size:
            raise ConfigError(f"data.vocab_size={data.vocab_size} differs from model.gpt.vocab_size={gpt.vocab_size}")
        if data.seq_len > gpt.seq_len:
            raise ConfigError(f"data.seq_len={data.seq_len} is longer than the model's context "
                              f"model.gpt.seq_len={gpt.seq_len}")
    _positive("data.seq_len", data.seq_len)


def _validate_parallel(cfg: Config, world_size: int) -> None:
    """Degrees against the world size, and the combinations torch does not support."""
    parallel = cfg.parallel
    strategy = parallel.strategy
    _choice("parallel.strategy", strategy, STRATEGIES)
    _positive("parallel.ddp.bucket_cap_mb", parallel.ddp.bucket_cap_mb, allow_none=True)
    dims = parallel_dims(parallel, world_size)
    if strategy in ("ddp", "zero1") and dims.dp_shard > 1:
        raise ConfigError(f"parallel.strategy={strategy} replicates the model, so parallel.dp_shard={dims.dp_shard} "
                          f"has no meaning; use parallel=fsdp to shard over {dims.dp_shard} ranks")
    if strategy == "zero1" and (dims.tp > 1 or dims.pp > 1):
        raise ConfigError(f"parallel.strategy=zero1 runs with plain data parallelism only (parallel.tp={dims.tp}, "
                          f"parallel.pp={dims.pp}); use parallel=fsdp for sharding with tensor or pipeline parallelism")
    if strategy == "ddp" and dims.tp > 1 and dims.dp_replicate > 1:
        raise ConfigError(f"parallel.tp={dims.tp} with parallel.dp_replicate={dims.dp_replicate} under "
                          f"parallel.strategy=ddp: DDP does not take tensor-parallel (DTensor) parameters; use "
                          f"parallel=fsdp (FSDP x TP on a 2-D mesh)")
    layered = strategy != "ddp" or dims.tp > 1 or dims.pp > 1
    if layered and cfg.precision.dtype == "fp16":
        raise ConfigError(f"precision.dtype=fp16 with parallel.strategy={strategy}, parallel.tp={dims.tp}, "
                          f"parallel.pp={dims.pp}: the fp16 GradScaler is supported with plain DDP only; "
                          f"use precision=bf16")
    if parallel.sync_batchnorm and (strategy != "ddp" or dims.pp > 1):
        raise ConfigError(f"parallel.sync_batchnorm=true needs parallel.strategy=ddp without pipeline stages "
                          f"(parallel.strategy={strategy}, parallel.pp={dims.pp})")
    if parallel.fsdp.cpu_offload and resolve_device(cfg.dist, local_rank=0).type != "cuda":
        raise ConfigError("parallel.fsdp.cpu_offload=true moves sharded state from GPU to CPU memory and "
                          "needs CUDA devices; this run is on the CPU already, keep it false")
    _choice("parallel.fsdp.param_dtype", parallel.fsdp.param_dtype, FSDP_DTYPES)
    _choice("parallel.fsdp.reduce_dtype", parallel.fsdp.reduce_dtype, FSDP_DTYPES[1:])
    tp_cfg = parallel.tensor_parallel
    if dims.tp == 1 and (tp_cfg.loss_parallel or tp_cfg.sequence_parallel):
        raise ConfigError("parallel.tensor_parallel.loss_parallel / sequence_parallel need parallel.tp > 1")
    if dims.tp > 1 and cfg.model.name == "gpt":
        gpt = cfg.model.gpt
        # The model checks these too, but only once every rank has started.
        if gpt.n_heads % dims.tp:
            raise ConfigError(f"model.gpt.n_heads={gpt.n_heads} must be divisible by parallel.tp={dims.tp}: "
                              f"tensor parallelism gives each rank whole attention heads")
        if gpt.dropout > 0 and not tp_cfg.sequence_parallel:
            raise ConfigError(f"model.gpt.dropout={gpt.dropout} with parallel.tp={dims.tp} needs "
                              f"parallel.tensor_parallel.sequence_parallel=true (or model.gpt.dropout=0)")
    if dims.pp > 1:
        _validate_pipeline(cfg, dims, world_size)


def _validate_pipeline(cfg: Config, dims: ParallelDims, world_size: int) -> None:
    pipe = cfg.parallel.pipeline
    check_schedule(pipe, dims.pp)
    if cfg.loop.grad_accum_steps != 1:
        raise ConfigError(f"loop.grad_accum_steps={cfg.loop.grad_accum_steps} with parallel.pp={dims.pp}: the "
                          f"pipeline accumulates over its micro-batches; set loop.grad_accum_steps=1 and "
                          f"parallel.pipeline.microbatches instead")
    micro = batch_layout(cfg, world_size).micro_batch_size
    if micro % pipe.microbatches:
        raise ConfigError(f"the batch per data-parallel rank ({micro} = loop.global_batch_size "
                          f"{cfg.loop.global_batch_size} / {dims.dp} data-parallel ranks) is not divisible by "
                          f"parallel.pipeline.microbatches={pipe.microbatches}")
