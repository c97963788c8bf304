"""Before launch: the ``fault_tolerance.*`` keys, the combinations torchft cannot serve, torchft
itself, and the lighthouse's address (reachable within ``timeouts.connect_s``, never a hang)."""

from __future__ import annotations

import math
import os
from datetime import timedelta
from types import ModuleType

from sdnet_trainer.config.checks import check_choice, check_positive
from sdnet_trainer.config.schema import Config, FaultToleranceConfig
from sdnet_trainer.errors import ConfigError

MODES = ("sync", "local_sgd", "diloco")
REPLICA_BACKENDS = ("auto", "gloo", "nccl")
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable, read when the key is null
EXTRA = "pip install 'sdnet_trainer[ft]'"


def require_torchft() -> ModuleType:
    """torchft, or a ConfigError naming the extra that installs it."""
    try:
        import torchft
    except ImportError as err:
        raise ConfigError(
            f"fault_tolerance.enabled=true needs torchft, which is not installed ({err}); "
            f"install the ft extra: {EXTRA}"
        ) from None
    return torchft


def lighthouse_address(ft: FaultToleranceConfig) -> str:
    """The lighthouse's address: the key, else $TORCHFT_LIGHTHOUSE."""
    address = ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not address:
        raise ConfigError(
            f"fault_tolerance.enabled=true needs the lighthouse's address: set "
            f"fault_tolerance.lighthouse=http://HOST:PORT (or ${LIGHTHOUSE_ENV}); start one with "
            f"python -m sdnet_trainer.ft.lighthouse"
        )
    return address


def check_lighthouse(address: str, *, connect_s: float) -> None:
    """Connect to the lighthouse once; a ConfigError after at most ``connect_s`` seconds."""
    from torchft._torchft import LighthouseClient

    try:
        LighthouseClient(address, connect_timeout=timedelta(seconds=connect_s))
    except Exception as err:  # torchft raises RuntimeError with the transport's reason
        raise ConfigError(
            f"fault_tolerance.lighthouse={address!r} is not reachable within "
            f"fault_tolerance.timeouts.connect_s={connect_s:g} s ({err}); start it with "
            f"python -m sdnet_trainer.ft.lighthouse, or fix the address"
        ) from None


def share_divisor(ft: FaultToleranceConfig, group_size: int) -> int:
    """What the global batch must be a multiple of. sync: every quorum from 1 to ``groups``
    groups divides it among its groups' ranks; semi-sync: each group keeps a fixed share."""
    if ft.mode == "sync":
        return group_size * math.lcm(*range(1, ft.groups + 1))
    return group_size * ft.groups


def validate_ft(cfg: Config, world_size: int) -> None:
    """``fault_tolerance.*`` and what it cannot be combined with; ``world_size`` is one group's."""
    ft = cfg.fault_tolerance
    if not ft.enabled:
        return
    check_choice("fault_tolerance.mode", ft.mode, MODES)
    check_positive("fault_tolerance.groups", ft.groups)
    check_positive("fault_tolerance.min_groups", ft.min_groups)
    check_positive("fault_tolerance.sync_every", ft.sync_every)
    check_positive("fault_tolerance.bucket_mb", ft.bucket_mb)
    check_choice("fault_tolerance.replica_backend", ft.replica_backend, REPLICA_BACKENDS)
    if ft.replica_backend == "nccl" and cfg.dist.device == "cpu":
        raise ConfigError(
            "fault_tolerance.replica_backend=nccl needs CUDA tensors, and dist.device=cpu: use "
            "replica_backend=gloo (or auto) on the CPU"
        )
    check_positive("fault_tolerance.outer_lr", ft.outer_lr)
    if not 0 <= ft.outer_momentum < 1:
        raise ConfigError(f"fault_tolerance.outer_momentum={ft.outer_momentum} must be in [0, 1)")
    if ft.min_groups > ft.groups:
        raise ConfigError(
            f"fault_tolerance.min_groups={ft.min_groups} exceeds fault_tolerance.groups={ft.groups}"
        )
    if not 0 <= ft.replica_group < ft.groups:
        raise ConfigError(
            f"fault_tolerance.replica_group={ft.replica_group} must be in "
            f"[0, fault_tolerance.groups={ft.groups})"
        )
    _validate_timeouts(ft)
    _refuse_combinations(cfg)
    divisor = share_divisor(ft, world_size)
    if cfg.loop.global_batch_size % divisor:
        quorums = f"every quorum of 1..{ft.groups} groups" if ft.mode == "sync" else "each group"
        raise ConfigError(
            f"loop.global_batch_size={cfg.loop.global_batch_size} must be a multiple of "
            f"{divisor} under fault_tolerance.mode={ft.mode}: {quorums} x {world_size} "
            f"rank(s) per group take equal shares"
        )
    lighthouse_address(ft)
    require_torchft()


def _validate_timeouts(ft: FaultToleranceConfig) -> None:
    t = ft.timeouts
    for name in ("connect_s", "step_s", "quorum_s"):
        check_positive(f"fault_tolerance.timeouts.{name}", getattr(t, name))
    if not t.connect_s <= t.step_s <= t.quorum_s:
        raise ConfigError(
            f"fault_tolerance.timeouts must satisfy connect_s ({t.connect_s:g}) <= step_s "
            f"({t.step_s:g}) <= quorum_s ({t.quorum_s:g}): a quorum waits out a slow step, and a "
            f"step outlasts a connection attempt (docs/fault_tolerance.md)"
        )


def _refuse_combinations(cfg: Config) -> None:
    """Layouts whose state or communication torchft's replica groups cannot carry. Served inside
    a group: one process, DDP, and FSDP2 in sync mode (HSDP across groups); every group must run
    the same number of ranks (one config for all; a joining group with another count is refused
    when it receives a peer's state, see room.py)."""
    parallel, loop = cfg.parallel, cfg.loop
    refusals = {
        "parallel.pp": (parallel.pp != 1, "pipeline stages cannot be recovered from a peer"),
        "parallel.tp": (parallel.tp != 1, "tensor-parallel shards are not averaged across groups"),
        "parallel.strategy=zero1": (
            parallel.strategy == "zero1",
            "ZeRO-1's sharded optimizer state cannot be sent to a joining group",
        ),
        f"parallel.strategy=fsdp under fault_tolerance.mode={cfg.fault_tolerance.mode}": (
            parallel.strategy == "fsdp" and cfg.fault_tolerance.mode != "sync",
            "LocalSGD and DiLoCo are not set up for FSDP's sharded parameters; FSDP inside a "
            "group (HSDP across groups) needs fault_tolerance.mode=sync, or use "
            "parallel.strategy=ddp",
        ),
        f"comm.hook={cfg.comm.hook}": (
            cfg.comm.hook != "none",
            "the gradients cross groups through torchft's process group, not a DDP comm hook",
        ),
        "elastic.enabled": (cfg.elastic.enabled, "the replica groups replace elastic restarts"),
        "loop.grad_accum_steps": (
            loop.grad_accum_steps != 1 or loop.micro_batch_size is not None,
            "each rank's share of a step is one micro-batch (leave loop.micro_batch_size null)",
        ),
        "data.mixup_alpha/cutmix_alpha": (
            cfg.data.mixup_alpha > 0 or cfg.data.cutmix_alpha > 0,
            "batch mixing is not divided among the groups",
        ),
        "precision.dtype=fp16": (
            cfg.precision.dtype == "fp16",
            "the GradScaler's skips are not agreed across groups; use bf16 or fp32",
        ),
        "model.moe.load_balance=bias": (
            cfg.model.name == "moe" and cfg.model.moe.load_balance == "bias",
            "the experts' load is summed inside a group only, so the groups' routing biases "
            "would drift apart; use model.moe.load_balance=aux_loss",
        ),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise ConfigError(f"fault_tolerance.enabled=true cannot be combined with {key}: {why}")


__all__ = [
    "MODES",
    "check_lighthouse",
    "lighthouse_address",
    "require_torchft",
    "share_divisor",
    "validate_ft",
]
