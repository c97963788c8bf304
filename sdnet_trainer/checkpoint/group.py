"""The ranks of a checkpoint directory's manager: the process group its collectives run on (DCP's
save and load, its own broadcasts) and rank 0's decisions handed to every rank."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch.distributed as dist

from sdnet_trainer.checkpoint.untrusted import CheckpointError
from sdnet_trainer.distributed.ops import is_distributed
from sdnet_trainer.errors import ConfigError


class CheckpointGroup:
    """The group a manager's collectives run on: ``process_group`` if given, else (under
    torch.distributed) a gloo group of its own, released by ``release``; ``group`` is None in a
    single process, where ``no_dist`` tells DCP to run without collectives.

    Constructing one is collective under torch.distributed (``new_group``): every rank must
    construct its manager at the same point."""

    def __init__(self, process_group: dist.ProcessGroup | None, *, rank: int, world_size: int):
        self.no_dist = not is_distributed()
        actual = (0, 1) if self.no_dist else (dist.get_rank(), dist.get_world_size())
        if (rank, world_size) != actual:
            raise ValueError(
                f"CheckpointManager got rank {rank} of {world_size}, but the process "
                f"group says rank {actual[0]} of {actual[1]}"
            )
        self.rank, self.world_size = actual
        self.group, self._owns_group = self._checkpoint_group(process_group)

    def _checkpoint_group(
        self, group: dist.ProcessGroup | None
    ) -> tuple[dist.ProcessGroup | None, bool]:
        if group is not None or self.no_dist:
            return group, False
        # A group of its own, as DCP recommends: async saves run collectives from a background
        # thread, which must never interleave with the training loop's collectives. gloo, because
        # async save needs a CPU backend and the collectives only carry small pickled plans.
        own = dist.new_group(backend="gloo")
        # Every rank joins (no ``ranks`` given), so this rank is a member and gets a real group.
        return cast(dist.ProcessGroup, own), True

    def from_rank0(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (collective). An exception other than a ConfigError or
        CheckpointError arrives as a CheckpointError naming it: any exception, made picklable."""
        if self.no_dist:
            return obj
        box = [sendable(obj)]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def to_rank0(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj``, in rank order, on rank 0; None on the other ranks (collective)."""
        if self.no_dist:
            return [obj]
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, gathered, group=self.group, group_dst=0)
        return gathered

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (collective)."""
        if self.no_dist:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def release(self) -> None:
        """Destroy the group if this object created it; the caller's group is left alone."""
        if self._owns_group and self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group, self._owns_group = None, False


def sendable(obj: Any) -> Any:
    """``obj``, or for an exception other than a ConfigError or CheckpointError, a CheckpointError
    naming it: any exception, made picklable for another rank."""
    if isinstance(obj, Exception) and not isinstance(obj, (ConfigError, CheckpointError)):
        return CheckpointError(f"{type(obj).__name__}: {obj}")
    return obj


@contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save and load that it "assumes" a single process; that
    is exactly the no_dist case a group of one process (``CheckpointGroup.no_dist``) selects on
    purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="torch.distributed is disabled, unavailable or uninitialized",
            category=UserWarning,
        )
        yield
