"""``fault_tolerance.*``: per-step fault tolerance across replica groups (sdnet_trainer/ft/).

Kept beside schema.py, which holds every other group; ``Config`` includes it from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class FTTimeoutsConfig:
    # One hierarchy, shortest first (docs/fault_tolerance.md): connect <= step <= quorum.
    # connect: reaching the lighthouse and a peer's manager (an unreachable lighthouse fails the
    # launch after this long); step: each cross-group collective, the commit vote and a state
    # transfer to a joining group; quorum: the wait for a quorum at the start of a step (longer
    # than a step, so a slow peer is waited for rather than dropped; semi-sync modes wait a whole
    # sync_every interval).
    connect_s: float = 10.0
    step_s: float = 30.0
    quorum_s: float = 60.0


@dataclass
class FaultToleranceConfig:
    # Per-step fault tolerance across replica groups with torchft (the [ft] extra): each group is
    # its own launch of this CLI; a group that dies is dropped at the next quorum, one that starts
    # copies the live state from a healthy peer. Every key below needs enabled=true: set without
    # it, it is refused before launch (sdnet_trainer/config/guards.py).
    enabled: bool = False
    replica_group: int = 0  # this launch's group, 0 <= replica_group < groups
    groups: int = 1  # the groups expected (the most a quorum may hold)
    min_groups: int = 1  # fewer in a quorum: the step is not committed
    lighthouse: Optional[str] = None  # http://host:port (else $TORCHFT_LIGHTHOUSE)
    timeouts: FTTimeoutsConfig = field(default_factory=FTTimeoutsConfig)
    # Sync mode's gradient average across groups goes in buckets of this many MB (DDP's default
    # size): one bucket is the reduction's extra memory, not a flat copy of every gradient.
    bucket_mb: float = 25.0
    # The process group across groups: auto = torchft's NCCL group run in a subprocess
    # (ProcessGroupBabyNCCL, which outlives a peer's death) on CUDA, gloo on the CPU.
    replica_backend: str = "auto"
    # sync: gradients averaged across groups every step; local_sgd: parameters averaged every
    # sync_every steps; diloco: an outer Nesterov-SGD step on the averaged pseudo-gradient
    # every sync_every steps (outer_lr, outer_momentum).
    mode: str = "sync"
    sync_every: int = 10  # local_sgd and diloco only
    outer_lr: float = 0.7  # diloco only
    outer_momentum: float = 0.9  # diloco only


__all__ = ["FTTimeoutsConfig", "FaultToleranceConfig"]
