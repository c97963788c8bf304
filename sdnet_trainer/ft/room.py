"""The fault-tolerance room the training loop calls at fixed points.

    begin_step      the quorum (sync mode): blocks until the lighthouse has this step's groups;
                    a group behind the others receives the live state from a healthy peer here
    average         before the first backward (sync): the group's count of counted targets
                    averaged over the quorum's groups (distributed/reduction.py)
    reduce_gradients  after backward (sync): every gradient averaged over the quorum's groups, in
                    buckets, through torchft's managed process group (NCCL in a subprocess on
                    CUDA, gloo on the CPU), reconfigured at each new quorum
    should_commit   before the update: the group's vote; False discards the step everywhere in
                    this group (a peer failed during it, or the quorum is below min_groups)

Inside a group: one process, DDP, or FSDP2 (HSDP across the groups: each group shards within
itself, and rank r of every group holds the same shards, so the Manager's process group, which
links rank r of each group, averages the local shards). Every group runs the same number of ranks.

The state a joining group receives is built from the checkpoint's own parts (model, optimizer,
schedule, the run's counters with the data position, the weight average, the loss scaler): the
same ``state_dict`` / ``load_state_dict`` pairs a checkpoint writes and reads; FSDP2's DTensors
travel as their local shards and are placed again on arrival (``shards.py``). Rank r of the
joining group receives from rank r of a peer. The random streams are not copied: each group
re-derives them from (seed, group, rank, step), as a resume on another world size does. torchft's
Manager keeps its own step equal to the run's committed steps.

Semi-sync modes (``local_sgd``, ``diloco``) wrap the optimizer with ``torchft.local_sgd``: the
quorum, the parameters' average (or DiLoCo's outer step) and the commit happen inside the
optimizer's step every ``sync_every`` steps.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from sdnet_trainer.checkpoint.parts import Part
from sdnet_trainer.config.schema import FaultToleranceConfig
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.ft.checks import check_lighthouse, lighthouse_address, require_torchft
from sdnet_trainer.ft.data import StepShare
from sdnet_trainer.ft.shards import local_shards, rebuild_shards

logger = logging.getLogger(__name__)

# Checkpoint parts that are not sent to a joining group: per-rank by nature (the random streams,
# PowerSGD's error feedback) or this group's own (its trackers' run ids).
NOT_SENT = ("rng", "comm", "trackers")
# Sent beside the parts: the sender's group size, which the receiver's must equal (rank r receives
# rank r's shards).
GROUP_RANKS = "group_ranks"
LOOPBACK = ("localhost", "127.0.0.1", "::1")


def replica_backend(cfg: FaultToleranceConfig, device: torch.device) -> str:
    """``fault_tolerance.replica_backend`` resolved: auto is nccl where the gradients are on CUDA
    (they cross the groups from device memory, never through the host), gloo otherwise."""
    if cfg.replica_backend != "auto":
        return cfg.replica_backend
    return "nccl" if device.type == "cuda" else "gloo"


def _recording_group(backend: str, timeout: timedelta) -> Any:
    """torchft's reconfigurable process group across the groups, remembering the global ranks of
    its last quorum (the group ids the metrics report). nccl: ``ProcessGroupBabyNCCL``, which runs
    NCCL in a subprocess, so that a peer's death kills (and a reconfiguration replaces) that
    subprocess and never leaves this process's CUDA context behind a hung NCCL communicator."""
    from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

    base = ProcessGroupBabyNCCL if backend == "nccl" else ProcessGroupGloo

    class Recording(base):  # type: ignore[valid-type,misc]
        quorum_ranks: list[int] = []

        def configure(self, *args: Any, **kwargs: Any) -> None:
            ranks = kwargs.get("global_ranks", args[7] if len(args) > 7 else None)
            self.quorum_ranks = list(ranks or [])
            super().configure(*args, **kwargs)

    return Recording(timeout=timeout)


def reduce_in_buckets(
    grads: list[torch.Tensor],
    allreduce: Callable[[torch.Tensor], Any],
    *,
    bucket_bytes: int,
) -> None:
    """Reduce ``grads`` in place through ``allreduce`` (a tensor in, a work with ``wait()`` out),
    with at most one bucket of ``bucket_bytes`` as extra memory.

    A contiguous gradient of a bucket's size or more is reduced where it lies, started at once
    and waited for at the end, so that several are in flight together and overlap the packing
    of the others; smaller ones are packed in order into the one bucket (one dtype at a time),
    reduced, and copied back before the bucket is packed again. Every group walks the same
    gradients in the same order, so the collectives pair up; a bucket as large as all the
    gradients is the flat reduction. (A non-contiguous gradient larger than a bucket, which
    neither DDP nor FSDP2 leaves, is reduced through a contiguous copy of itself.)"""
    large = {id(g) for g in grads if _nbytes(g) >= bucket_bytes and g.is_contiguous()}
    works = [allreduce(g) for g in grads if id(g) in large]
    packed = [g for g in grads if id(g) not in large]
    if packed:
        capacity = min(bucket_bytes, sum(map(_nbytes, packed)))
        bucket = torch.empty(capacity, dtype=torch.uint8, device=packed[0].device)
        for group in _buckets(packed, capacity):
            size = sum(g.numel() for g in group)
            if size * group[0].element_size() > capacity:  # one oversized gradient
                flat = group[0].contiguous()
            else:
                flat = bucket[: size * group[0].element_size()].view(group[0].dtype)
                torch.cat([g.reshape(-1) for g in group], out=flat)
            allreduce(flat).wait()
            for g, piece in zip(group, flat.reshape(-1).split([g.numel() for g in group]),
                                strict=True):  # fmt: skip
                g.copy_(piece.view_as(g))
    for work in works:
        work.wait()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _buckets(grads: list[torch.Tensor], capacity: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of one dtype, each at most ``capacity`` bytes."""
    runs: list[list[torch.Tensor]] = []
    used = capacity
    for g in grads:
        nbytes = _nbytes(g)
        if not runs or used + nbytes > capacity or runs[-1][0].dtype != g.dtype:
            runs.append([])
            used = 0
        runs[-1].append(g)
        used += nbytes
    return runs


def reachable(host: str) -> str:
    """``host`` as another machine reaches it: this host's name for a loopback name (torchrun's
    store listens on every interface)."""
    return socket.gethostname() if host in LOOPBACK else host


class QuorumTimeout(RuntimeError):
    """No quorum formed within ``fault_tolerance.timeouts.quorum_s``."""


class FaultTolerance:
    """One replica group's link to the others: a torchft Manager over the run's parts."""

    def __init__(
        self,
        cfg: FaultToleranceConfig,
        *,
        group_rank: int,
        group_size: int,
        distributed: bool,
        parts: Mapping[str, Part],
        after_load: Callable[[], None],
        step: int,
        device: torch.device | None = None,
    ) -> None:
        require_torchft()
        from torch.distributed import TCPStore
        from torchft import Manager

        self.cfg, self.group_rank, self.group_size = cfg, group_rank, group_size
        self.parts = {name: part for name, part in parts.items() if name not in NOT_SENT}
        self.after_load = after_load
        address = lighthouse_address(cfg)
        t = cfg.timeouts
        if group_rank == 0:
            check_lighthouse(address, connect_s=t.connect_s)  # fails fast, before anything waits
        # The group's store: torchrun's (MASTER_ADDR/PORT) when the group has several ranks, else
        # one of our own on a free port. Its address reaches the other groups through the quorum
        # (they meet in the quorum's first member's store): the host's name, never a loopback
        # name such as the "localhost" of torchrun --standalone, which names each peer's own host.
        self._store = None
        if distributed:
            store_addr = reachable(os.environ["MASTER_ADDR"])
            store_port = int(os.environ["MASTER_PORT"])
        else:
            store_addr = socket.gethostname()
            self._store = TCPStore(store_addr, 0, is_master=True, wait_for_workers=False)
            store_port = self._store.port
        self.backend = replica_backend(cfg, device or torch.device("cpu"))
        self.pg = _recording_group(self.backend, timedelta(seconds=t.step_s))
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=self._load,
            state_dict=self._state_dict,
            min_replica_size=cfg.min_groups,
            use_async_quorum=False,  # a joining group heals before the step and takes part in it
            timeout=timedelta(seconds=t.step_s),
            quorum_timeout=timedelta(seconds=t.quorum_s),
            connect_timeout=timedelta(seconds=t.connect_s),
            rank=group_rank,
            world_size=group_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=address,
            replica_id=f"sdnet_group_{cfg.replica_group}",
            hostname=socket.gethostname(),
            init_sync=False,  # every group builds the same initial weights from loop.seed
        )
        if cfg.mode == "sync":  # the Manager counts committed steps, as the run's counters do
            self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.share = StepShare(groups=cfg.groups, index=cfg.replica_group)
        self.recoveries, self.recovery_seconds = 0, 0.0
        self.degraded_steps, self.skipped_steps = 0, 0
        self._loaded, self._closed = False, False

    # ------------------------------------------------------------------ the state a peer sends

    def _state_dict(self) -> dict[str, Any]:
        state = {name: local_shards(part.state.state_dict()) for name, part in self.parts.items()}
        return {**state, GROUP_RANKS: self.group_size}

    def _load(self, state: dict[str, Any]) -> None:
        sent = state.get(GROUP_RANKS, self.group_size)
        if sent != self.group_size:
            raise ConfigError(
                f"fault tolerance: replica group {self.cfg.replica_group} runs {self.group_size} "
                f"rank(s) and the peer it recovers from {sent}: every replica group must run the "
                f"same number of ranks"
            )
        for name, part in self.parts.items():
            if name in state:  # each shard placed as this rank's live DTensor there
                live = part.state.state_dict()
                part.state.load_state_dict(rebuild_shards(state[name], live, where=name))
        self.after_load()
        self._loaded = True

    # ------------------------------------------------------------------ the loop's fixed points

    def begin_step(self) -> StepShare:
        """The quorum before the step (sync mode); a recovery from a peer happens here."""
        if self.cfg.mode != "sync":
            return self.share  # semi-sync: a fixed share; the quorum is inside optimizer.step
        started = time.perf_counter()
        quorum_s = self.cfg.timeouts.quorum_s
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=quorum_s))
        except TimeoutError as err:
            raise QuorumTimeout(
                f"replica group {self.cfg.replica_group}: no quorum within "
                f"fault_tolerance.timeouts.quorum_s={quorum_s:g} s (the lighthouse needs its "
                f"--min-groups groups, and fault_tolerance.min_groups={self.cfg.min_groups}); "
                f"are the other groups running and pointed at the same lighthouse? ({err})"
            ) from None
        if self._loaded:
            self._loaded = False
            self.recoveries += 1
            self.recovery_seconds += time.perf_counter() - started
            logger.info(
                "fault tolerance: recovered step %d from a peer in %.2f s",
                self.manager.current_step(),
                time.perf_counter() - started,
            )
        index = self.manager.participating_rank()
        self.share = StepShare(groups=self.manager.num_participants(), index=index or 0)
        return self.share

    @torch.no_grad()
    def reduce_gradients(self, model: nn.Module) -> None:
        """Average every gradient over the quorum's groups (sync mode), in buckets of
        ``fault_tolerance.bucket_mb`` (:func:`reduce_in_buckets`). Under FSDP2 a gradient is a
        DTensor holding this rank's shard, already averaged over the group by FSDP's
        reduce-scatter; rank r of every group holds the same shard, so the local shards are what
        is averaged (in place: ``to_local`` shares the DTensor's storage). A failed bucket is
        recorded by the Manager, which skips the rest and votes the step down."""
        reduce_in_buckets(self.local_gradients(model), self.manager.allreduce,
                          bucket_bytes=int(self.cfg.bucket_mb * 2**20))  # fmt: skip

    @staticmethod
    def local_gradients(model: nn.Module) -> list[torch.Tensor]:
        """Each trainable parameter's gradient as this rank holds it (a zero one where backward
        left none, so every group reduces the same tensors)."""
        shards = []
        for param in model.parameters():
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
            shards.append(grad.to_local() if isinstance(grad, DTensor) else grad)
        return shards

    def average(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` averaged over the quorum's groups (sync mode; semi-sync groups step on their
        own data, so their own value stands). A failed peer's error is recorded by the Manager
        and the step is then not committed."""
        if self.cfg.mode != "sync":
            return value
        value = value.clone()
        self.manager.allreduce(value).wait()  # AVG over the participants
        return value

    def should_commit(self) -> bool:
        """The group's vote on this step; counts degraded (fewer groups) and skipped steps.

        A collective of this step that failed (a peer group died) first closes this rank's
        cross-group connections, before the vote waits on the group: gloo's ring all-reduce
        receives from one neighbour and sends to the other, so a survivor whose neighbour was
        the dead group fails at once, while the survivor that receives from it would wait, for
        the bytes it will now never send, until ``fault_tolerance.timeouts.step_s``. Closing
        the sockets ends that wait within milliseconds; the next quorum builds a new group."""
        if self.manager.errored() is not None:
            self._drop_connections()
        committed = self.manager.should_commit()
        if not committed:
            self.skipped_steps += 1
            logger.warning("fault tolerance: step not committed (a peer failed or too few groups)")
        elif self.share.groups < self.cfg.groups:
            self.degraded_steps += 1
        return committed

    def _drop_connections(self) -> None:
        if self.backend == "nccl":
            # NCCL runs in torchft's subprocess: killing it ends every wait on the dead peer, and
            # the next quorum's configure starts a new one.
            self.pg.shutdown()
        else:
            # torchft's abort lets go of the gloo group; its destructor closes the sockets once
            # the last reference goes, and a failed work object caught in a reference cycle would
            # keep it: the young generations are collected first (cheap, the imports are frozen).
            gc.collect(1)
            self.pg.abort()
        logger.warning(
            "fault tolerance: a collective failed; this rank's cross-group connections are closed"
        )

    def semi_sync(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> AbstractContextManager:
        """``torchft.local_sgd``'s wrapper around the loop (semi-sync modes), else nothing."""
        cfg = self.cfg
        if cfg.mode == "sync":
            return nullcontext()
        from torchft.local_sgd import DiLoCo, LocalSGD

        if cfg.mode == "local_sgd":
            return LocalSGD(self.manager, model, optimizer, sync_every=cfg.sync_every)
        outer = torch.optim.SGD(
            model.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True
        )
        # The last synced weights are kept on the host (pinned where there is an accelerator).
        return DiLoCo(self.manager, [model], optimizer, outer, sync_every=cfg.sync_every)

    def metrics(self) -> dict[str, float]:
        """``ft/*``: the quorum now, and the run's recoveries, degraded and skipped steps."""
        members = set(self.quorum_groups())
        return {
            "ft/quorum_size": float(self.share.groups),
            # One gauge per expected group: 1 while it is in the quorum.
            **{f"ft/in_quorum/group{g}": float(g in members) for g in range(self.cfg.groups)},
            "ft/recoveries": float(self.recoveries),
            "ft/recovery_seconds": self.recovery_seconds,
            "ft/degraded_steps": float(self.degraded_steps),
            "ft/skipped_steps": float(self.skipped_steps),
            "ft/committed_steps": float(self.manager.current_step()),
        }

    def quorum_groups(self) -> list[int]:
        """The replica groups of the last quorum (from the managed process group's ranks)."""
        ranks = getattr(self.pg, "quorum_ranks", [])
        return sorted({r // self.group_size for r in ranks})

    def close(self) -> None:
        """Stop the Manager's servers and threads, and let go of the managed gloo group and of
        the parts (the live model and optimizer) while the interpreter is whole: a gloo group
        whose worker threads outlive it aborts the process at exit ("terminate called without an
        active exception", after a run that finished). Closing twice is a no-op."""
        if self._closed:
            return
        self._closed = True
        self.manager.shutdown(wait=False)
        self.pg.shutdown()  # drops torchft's gloo group: its destructor joins the worker threads
        self.parts, self._store = {}, None


__all__ = [
    "GROUP_RANKS",
    "NOT_SENT",
    "FaultTolerance",
    "QuorumTimeout",
    "reachable",
    "reduce_in_buckets",
    "replica_backend",
]
