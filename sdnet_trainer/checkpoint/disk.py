"""The writer of every save (``StagingWriter``): the checksum of each file as it is written, and a
full disk recognised through DCP's and torch's wrapping, with the figures its message gives (the
bytes a save needs, the bytes free).

Checksums: every rank computes the crc32 of each file it writes from the bytes on their way to the
file (``_ChecksummingFileSystem``), and hands it to rank 0 with its write results, which DCP's save
gathers on rank 0 anyway; rank 0's ``finish`` collects them (``file_checksums``) for the manifest.
So no rank reads a shard back to commit a checkpoint, and rank 0 never reads the other ranks'.

The same writer saves into an object store's prefix (``objects``): the checksumming wraps DCP's
fsspec streams there instead of its local files.

A full disk: DCP gathers every rank's failure to rank 0 pickled, without its chain, and torch's zip
writer reports a lost write as "unexpected pos"; so ``StagingWriter`` re-raises a full disk as its
OSError, and ``is_disk_full`` looks through the whole failure.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import shutil
import zlib
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future as TorchFuture

from sdnet_trainer.checkpoint import files
from sdnet_trainer.checkpoint.files import Folder
from sdnet_trainer.checkpoint.objects import ObjectFolder, dcp_file_system
from sdnet_trainer.checkpoint.untrusted import CheckpointError, crc32

logger = logging.getLogger(__name__)

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class ChecksummedWriteResult(WriteResult):
    """A WriteResult that also carries the size and crc32 of the whole file its item went to: DCP
    gathers every rank's write results on rank 0, so the checksums travel with them."""

    file_bytes: int
    file_crc32: int


class StagingWriter(FileSystemWriter):
    """FileSystemWriter that checksums every file while writing it and whose disk-full failures
    keep their errno on the way to rank 0.

    ``file_checksums`` (rank 0, after a save's ``finish``): {file name: (bytes, crc32)} of every
    file of the save, every rank's shards and ``.metadata``, none of them read back.

    Disk full: DCP gathers each rank's exception pickled, which drops its chain; and torch's zip
    writer reports a failed write of a tensor as "RuntimeError: ... unexpected pos", the OSError
    (ENOSPC) only in its ``__context__``. So a full disk is re-raised here as the OSError itself.

    ``directory``: a local folder, or an object store's prefix (DCP's fsspec streams; each object
    is durable once its upload completes, so nothing is fsynced there)."""

    def __init__(self, directory: Folder, *, sync_files: bool) -> None:
        remote = directory if isinstance(directory, ObjectFolder) else None
        super().__init__(str(directory), sync_files=sync_files and remote is None)
        self._files = _ChecksummingFileSystem(remote)
        self.fs = self._files
        self.path = self._files.init_path(directory)
        self.file_checksums: dict[str, tuple[int, int]] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._files.written.clear()
        self.file_checksums = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        with _disk_full_surfaced(self.path):
            results = super().write_data(plan, planner).wait()  # FileSystemWriter: already done
        checksummed: TorchFuture[list[WriteResult]] = TorchFuture()
        checksummed.set_result([self._with_checksum(result) for result in results])
        return checksummed

    def _with_checksum(self, result: WriteResult) -> WriteResult:
        name = result.storage_data.relative_path
        if (record := self._files.written.get(name)) is None:
            # The file was not written front to back (a seek): read it back, on this rank.
            logger.debug("checksumming %s by reading it back", name)
            record = self._files.written[name] = read_checksum(self._files.folder(self.path), name)
        return ChecksummedWriteResult(
            index=result.index,
            size_in_bytes=result.size_in_bytes,
            storage_data=result.storage_data,
            file_bytes=record[0],
            file_crc32=record[1],
        )

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with _disk_full_surfaced(self.path):
            super().finish(metadata, results)
        # torch 2.11's FileSystemWriter.finish records where each item's bytes are on a copy of the
        # metadata (the one it writes), so the metadata dcp.save returns, which the commit reads,
        # has none; later torch records it on the metadata itself. The same map, either way.
        if metadata.storage_data is None:
            metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        checksums = {
            result.storage_data.relative_path: (result.file_bytes, result.file_crc32)
            for rank_results in results
            for result in rank_results
            if isinstance(result, ChecksummedWriteResult)
        }
        for name, record in self._files.written.items():  # this rank's: .metadata, written just now
            if record is not None:
                checksums.setdefault(name, record)
        self.file_checksums = checksums


class _ChecksummingFileSystem(FileSystem):
    """DCP's file system (local, or fsspec's on the object store of ``remote``), keeping the size
    and crc32 of each file written through it (``written``: {file name: (bytes, crc32)}, None for
    a file not written front to back). A rename carries the record to the new name (DCP writes
    ``.metadata`` under a temporary name)."""

    def __init__(self, remote: ObjectFolder | None = None) -> None:
        self.remote = remote
        self.inner = FileSystem() if remote is None else dcp_file_system(remote)
        self.written: dict[str, tuple[int, int] | None] = {}

    def folder(self, path: str | os.PathLike) -> Folder:
        """The save's folder (``path``: what ``init_path`` returned) for reading files back."""
        if self.remote is not None:
            return ObjectFolder(str(path), self.remote.options)
        return Path(path)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        with self.inner.create_stream(path, mode) as raw:
            if mode != "wb":
                yield raw
                return
            stream = _ChecksummedStream(raw)
            yield stream  # type: ignore[misc]
        self.written[_name(path)] = stream.record()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.inner.rename(path, new_path)
        if _name(path) in self.written:
            self.written[_name(new_path)] = self.written.pop(_name(path))

    def init_path(self, path: str | os.PathLike | ObjectFolder) -> str | os.PathLike:
        if self.remote is not None:
            return str(path)  # a URL: the store is open already (fsspec's init_path reopens it)
        return self.inner.init_path(path)  # type: ignore[arg-type]  # a local path

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str | os.PathLike:
        return self.inner.concat_path(path, suffix)

    def mkdir(self, path: str | os.PathLike) -> None:
        if self.remote is None:  # a store has no folders (s3fs would create a missing bucket)
            self.inner.mkdir(path)

    def exists(self, path: str | os.PathLike) -> bool:
        return self.inner.exists(path)

    def rm_file(self, path: str | os.PathLike) -> None:
        self.inner.rm_file(path)

    def ls(self, path: str | os.PathLike) -> list[str]:
        return self.inner.ls(path)  # type: ignore[attr-defined]  # both file systems have it

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


def _name(path: str | os.PathLike) -> str:
    """The file name in a local path or an object's URL."""
    return os.fspath(path).rstrip("/").rsplit("/", 1)[-1]


class _ChecksummedStream:
    """A file opened for writing, with the crc32 of what was written to it. The checksum is that of
    the file as long as every write appends; a seek elsewhere than the end voids it."""

    def __init__(self, raw: io.IOBase) -> None:
        self._raw = raw
        self._crc = 0
        self._size = 0
        self._appending = True

    def write(self, data: Any) -> int:
        n = self._raw.write(data)
        view = memoryview(data)
        if n is None or n != view.nbytes:
            self._appending = False  # a partial write: the file holds something else
        elif self._appending:
            self._crc = zlib.crc32(view, self._crc)
            self._size += n
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        position = self._raw.seek(offset, whence)
        if position != self._size:
            self._appending = False
        return position

    def record(self) -> tuple[int, int] | None:
        return (self._size, self._crc) if self._appending else None

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self._raw, name)


def read_checksum(folder: Folder, name: str) -> tuple[int, int]:
    """(bytes, crc32) of a file this process wrote, read back."""
    return sizes(folder, [name])[name], crc32(folder / name)


def sizes(folder: Folder, names: list[str]) -> dict[str, int]:
    """{name: bytes} of files in ``folder`` (FileNotFoundError naming the first missing one); an
    object store's prefix is listed once for all of them."""
    if isinstance(folder, ObjectFolder):
        present = folder.listing()[0]
        if missing := [name for name in names if name not in present]:
            raise FileNotFoundError(f"{folder / missing[0]}")
        return {name: present[name] for name in names}
    return {name: (folder / name).stat().st_size for name in names}


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


def is_disk_full(exc: BaseException, *, directory: Folder, needed: int) -> bool:
    """Whether a save failed for lack of space: an ENOSPC/EDQUOT anywhere in the failure, or torch's
    zip writer's "unexpected pos" (a lost write, its OSError gone) while the filesystem has less
    room left than the save needs. An object store's failures are its own (never a disk's)."""
    if isinstance(directory, ObjectFolder):
        return False
    chain = list(_exception_chain(exc))
    if any(isinstance(e, OSError) and e.errno in _DISK_FULL for e in chain):
        return True
    short_write = any("unexpected pos" in str(e) for e in chain if isinstance(e, RuntimeError))
    return short_write and free_bytes(directory) < needed


def free_bytes(directory: Folder) -> int:
    if isinstance(directory, ObjectFolder):
        return 0  # a store has no free space to speak of (is_disk_full never asks for one)
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


def written_files(staging: Folder, metadata: Metadata) -> dict[str, int]:
    """{name: bytes} of every file of a finished save: DCP's .metadata and the shard files it points
    into, each checked to hold the byte ranges DCP recorded for it. Taken from DCP's metadata rather
    than a directory listing, which a network filesystem may serve stale to rank 0."""
    needed = {files.DCP_METADATA: 1}
    for info in metadata.storage_data.values():  # FileSystemWriter: where each item's bytes are
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    try:
        found = sizes(staging, sorted(needed))
    except FileNotFoundError as exc:
        raise CheckpointError(f"DCP's save finished but {exc.filename or exc} is missing") from None
    for name, minimum in needed.items():
        if found[name] < minimum:
            raise CheckpointError(
                f"DCP's save finished but {staging / name} holds {found[name]} "
                f"bytes, fewer than the {minimum} it wrote there"
            )
    return found


def recorded_checksums(
    staging: Folder, written: dict[str, int], recorded: dict[str, tuple[int, int]]
) -> dict[str, int]:
    """{name: crc32} of the files of a finished save, from what the ranks recorded while writing
    them (``disk.StagingWriter``): nothing is read back. A file none recorded (a storage writer
    that does not record) is read here, with a warning; one whose size differs from what its
    writer wrote was changed since."""
    checksums = {}
    for name, size in written.items():
        if name not in recorded:
            logger.warning("no checksum was recorded for %s while saving: reading it", name)
            checksums[name] = crc32(staging / name)
            continue
        recorded_size, checksums[name] = recorded[name]
        if recorded_size != size:
            raise CheckpointError(
                f"{staging / name} holds {size} bytes, but {recorded_size} were written to it"
            )
    return checksums


def describe_failure(exc: BaseException) -> str:
    """One line per failed rank instead of DCP's CheckpointException, which lists tracebacks (they
    stay available through ``raise ... from``)."""
    if isinstance(exc, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in exc.failures.items()
        )
    return f"{type(exc).__name__}: {exc}"
