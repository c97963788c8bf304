"""The hooks ``comm.hook`` names and what each needs: :func:`validate_comm` checks a config
against them before launch; :class:`~sdnet_trainer.distributed.comm.GradientComm` installs them.

Here live the pieces that do not hold per-run state: the 16-bit cast hooks, the check that gloo
can all-reduce bf16, whether this torch's batched PowerSGD runs, and which gradients PowerSGD
compresses (:func:`compression_plan`).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from sdnet_trainer.config.schema import Config
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

HOOKS = ("none", "fp16", "bf16", "powersgd", "local_sgd")
# Strategies whose gradients go through DDP's reducer, where a comm hook sits.
DDP_STRATEGIES = ("ddp", "zero1")
# bf16 all-reduce in NCCL (release notes of NCCL 2.10.3).
NCCL_BF16 = (2, 10)


def validate_comm(cfg: Config, world_size: int) -> None:
    """Raise ConfigError for a ``comm.*`` setting that cannot work with the rest of the config."""
    comm, parallel = cfg.comm, cfg.parallel
    if comm.hook not in HOOKS:
        raise ConfigError(f"comm.hook={comm.hook!r} is not one of {', '.join(HOOKS)}")
    if comm.hook == "none":
        return
    if parallel.strategy not in DDP_STRATEGIES:
        raise ConfigError(
            f"comm.hook={comm.hook} needs parallel.strategy=ddp or zero1; "
            f"{parallel.strategy.upper()} reduces gradients itself (parallel.strategy="
            f"{parallel.strategy}); use comm.hook=none"
        )
    if parallel.tp > 1 or parallel.pp > 1:
        raise ConfigError(
            f"comm.hook={comm.hook} works on plain DDP gradient buckets; it cannot be "
            f"combined with parallel.tp={parallel.tp} / parallel.pp={parallel.pp}"
        )
    if comm.hook == "powersgd":
        ps = comm.powersgd
        if ps.rank < 1:
            raise ConfigError(
                f"comm.powersgd.rank={ps.rank} must be >= 1 (the rank of the gradient "
                f"approximation)"
            )
        if ps.min_compression_rate <= 0:
            raise ConfigError(
                f"comm.powersgd.min_compression_rate={ps.min_compression_rate} must be > 0"
            )
        if (ps.use_error_feedback or ps.warm_start) and ps.start_iter < 2:
            # torch's PowerSGDState refuses this too: DDP rebuilds its buckets after the first
            # step, and per-bucket error and warm-start memories must not span that change.
            raise ConfigError(
                f"comm.powersgd.start_iter={ps.start_iter} must be >= 2 with "
                f"use_error_feedback or warm_start (DDP's buckets change after step 1)"
            )
        if ps.batched and not batched_powersgd_works():
            raise ConfigError(BATCHED_BROKEN)
        if cfg.loop.max_steps is not None and ps.start_iter >= cfg.loop.max_steps:
            logger.warning(
                "comm.powersgd.start_iter=%d >= loop.max_steps=%d: PowerSGD never starts, "
                "every step is a plain all-reduce",
                ps.start_iter,
                cfg.loop.max_steps,
            )
    if comm.hook == "local_sgd":
        ls = comm.local_sgd
        if ls.period < 1:
            raise ConfigError(
                f"comm.local_sgd.period={ls.period} must be >= 1 (steps between parameter averages)"
            )
        if ls.start_step < 0:
            raise ConfigError(f"comm.local_sgd.start_step={ls.start_step} must be >= 0")
        if parallel.strategy == "zero1":
            # ZeroRedundancyOptimizer has each rank update only its shard of the parameters and
            # then broadcasts the shards: replicas become equal again after every step, each shard
            # moved by one rank's local gradient. That is neither local SGD nor data parallelism.
            raise ConfigError(
                "comm.hook=local_sgd cannot run with parallel.strategy=zero1: the "
                "sharded optimizer re-synchronises all replicas every step; use "
                "parallel.strategy=ddp"
            )
        if ls.period == 1:
            logger.warning(
                "comm.local_sgd.period=1 averages the parameters every step: as much "
                "communication as comm.hook=none, with none of its overlap"
            )
    if comm.hook == "bf16":
        from sdnet_trainer.distributed.env import resolve_backend, resolve_device

        device = resolve_device(cfg.dist, local_rank=0)
        if device.type == "cuda" and resolve_backend(cfg.dist, device) == "nccl":
            version = torch.cuda.nccl.version() if dist.is_nccl_available() else (0,)
            if tuple(version) < NCCL_BF16:
                raise ConfigError(
                    f"comm.hook=bf16 needs NCCL >= 2.10 for bf16 all-reduce; this torch "
                    f"has NCCL {'.'.join(map(str, version))}; use comm.hook=fp16"
                )
        # gloo: checked with a one-element all-reduce when GradientComm is built (the group
        # does not exist yet here).
    if world_size == 1:
        logger.warning("comm.hook=%s has no effect in a single process (no DDP wrapper)", comm.hook)


BATCHED_BROKEN = (
    f"comm.powersgd.batched=true: torch {torch.__version__}'s batched_powerSGD_hook fails at its "
    f"first compressed step (its _orthogonalize accepts only batches of matrices); use "
    f"comm.powersgd.batched=false, the per-matrix PowerSGD"
)


def batched_powersgd_works() -> bool:
    """Whether torch's batched_powerSGD_hook can run: it orthogonalises a single matrix with a
    helper that, since torch 1.12, asserts a batch of them (still so in torch 2.14)."""
    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
    except AssertionError:
        return False
    return True


def compression_plan(shape: torch.Size, rank: int, min_rate: float) -> tuple[int, int, int] | None:
    """(n, m, r) when powerSGD_hook compresses a gradient of ``shape`` (viewed as n x m) with rank
    r, None when it all-reduces it as is; the rule of torch's ``_should_compress``."""
    if len(shape) == 0:
        return None
    n = shape[0]
    m = math.prod(shape[1:])
    r = min(n, m, rank)
    compress, _, _ = powerSGD_hook._should_compress(n, m, r, min_rate)
    return (n, m, r) if compress else None


# The hooks' ``bucket`` parameters carry no annotation: DDP compares it with dist.GradBucket, and
# under ``from __future__ import annotations`` it would be a string.
def fp16_hook(process_group: dist.ProcessGroup, bucket):
    return default_hooks.fp16_compress_hook(process_group, bucket)


def bf16_hook(process_group: dist.ProcessGroup, bucket):
    # Registered under its own name: DDP refuses a hook named bf16_compress_hook unless torch was
    # built with NCCL >= 2.10, even for gloo (validate_comm and check_gloo_bf16 check the backend
    # actually in use instead).
    return default_hooks.bf16_compress_hook(process_group, bucket)


def check_gloo_bf16(process_group: dist.ProcessGroup | None) -> None:
    """gloo gained bf16 reductions late; fail with a config message rather than in backward."""
    try:
        dist.all_reduce(torch.zeros(1, dtype=torch.bfloat16), group=process_group)
    except RuntimeError as err:
        raise ConfigError(
            f"comm.hook=bf16: this torch's gloo backend cannot all-reduce bf16 ({err}); "
            f"use comm.hook=fp16"
        ) from err
