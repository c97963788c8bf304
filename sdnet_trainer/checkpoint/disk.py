"""A full disk while saving: how it is recognised through DCP's and torch's wrapping, and the
figures its message gives (the bytes a save needs, the bytes free).

DCP gathers every rank's failure to rank 0 pickled, without its chain, and torch's zip writer
reports a lost write as "unexpected pos"; so the writer of every save (``StagingWriter``) re-raises
a full disk as its OSError, and ``is_disk_full`` looks through the whole failure.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future as TorchFuture

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class StagingWriter(FileSystemWriter):
    """FileSystemWriter whose disk-full failures keep their errno on the way to rank 0. DCP
    gathers each rank's exception pickled, which drops its chain; and torch's zip writer reports
    a failed write of a tensor as "RuntimeError: ... unexpected pos", the OSError (ENOSPC) only
    in its ``__context__``. So a full disk is re-raised here as the OSError itself."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        with _disk_full_surfaced(self.path):
            return super().write_data(plan, planner)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with _disk_full_surfaced(self.path):
            super().finish(metadata, results)


@contextmanager
def _disk_full_surfaced(path: str | os.PathLike) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        if (full := _hidden_disk_full(exc, path)) is None:
            raise
        raise full from exc


def _hidden_disk_full(exc: Exception, path: str | os.PathLike) -> OSError | None:
    """An OSError for the disk-full error inside ``exc``'s chain; None when there is none or
    ``exc`` is that OSError itself."""
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return None
    for cause in _exception_chain(exc):
        if isinstance(cause, OSError) and cause.errno in _DISK_FULL:
            return OSError(cause.errno, os.strerror(cause.errno), str(path))
    return None


def _exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-rank failures of a CheckpointException."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, CheckpointException):
            stack += [failure for failure, _ in current.failures.values()]
        stack += [current.__cause__, current.__context__]


def is_disk_full(exc: BaseException, *, directory: Path, needed: int) -> bool:
    """Whether a save failed for lack of space: an ENOSPC/EDQUOT anywhere in the failure, or torch's
    zip writer's "unexpected pos" (a lost write, its OSError gone) while the filesystem has less
    room left than the save needs."""
    chain = list(_exception_chain(exc))
    if any(isinstance(e, OSError) and e.errno in _DISK_FULL for e in chain):
        return True
    short_write = any("unexpected pos" in str(e) for e in chain if isinstance(e, RuntimeError))
    return short_write and free_bytes(directory) < needed


def free_bytes(directory: Path) -> int:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


def state_nbytes(obj: Any) -> int:
    """Bytes of the tensors in a state dict (this rank's part of sharded ones): what a save
    writes, give or take headers and the small non-tensor entries."""
    return sum(t.numel() * t.element_size() for t in local_tensors(obj))


def local_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a state dict, a DTensor as this rank's shard of it: what this rank saves."""
    if isinstance(obj, DTensor):
        yield obj.to_local()
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from local_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from local_tensors(value)


def amount(n: int) -> str:
    """``n`` bytes for a message: "512 bytes", "1.5 GiB (1610612736 bytes)"."""
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit} ({n} bytes)"
