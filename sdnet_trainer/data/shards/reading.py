"""Reading shard members: range reads through a per-process reader (local ``pread`` or an fsspec
``cat_file`` range), each member's tar header checked against the index, and what the image and
the text data sets share (:class:`_ShardSet`: the shards' columns, the reader and
``data.on_bad_sample``)."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from torch.utils.data import Dataset

from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.data.bad_samples import (
    ON_BAD_SAMPLE,
    BadSampleError,
    SkippedSamples,
    first_loadable,
)
from sdnet_trainer.data.shards.index import _BLOCK, ShardError, ShardIndex

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Open local shard files kept per process (per loader worker): random sampling touches every
# shard, so this bounds file descriptors rather than promising hits.
_MAX_OPEN_SHARDS = 16


class _BadMember(Exception):
    """A member that cannot be read as the index says: follows data.on_bad_sample."""


class _Reader:
    """Range reads from shards, one per process: local shards through a few cached open files
    (``os.pread``, no shared seek position), others through their fsspec file system's
    ``cat_file(path, start, end)``, one range request each. Built lazily in the process that
    reads, since open files and HTTP sessions must not cross a fork."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._targets: dict[str, tuple[Any, str]] = {}
        self._files: OrderedDict[str, int] = OrderedDict()

    def read(self, url: str, start: int, length: int) -> bytes:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = fsspec.core.url_to_fs(url)
        fs, path = target
        if isinstance(fs, LocalFileSystem):
            return os.pread(self._file(path), length, start)
        return bytes(fs.cat_file(path, start=start, end=start + length))

    def _file(self, path: str) -> int:
        fd = self._files.get(path)
        if fd is not None:
            self._files.move_to_end(path)
            return fd
        fd = os.open(path, os.O_RDONLY)
        self._files[path] = fd
        if len(self._files) > _MAX_OPEN_SHARDS:
            _, oldest = self._files.popitem(last=False)
            os.close(oldest)
        return fd

    def close(self) -> None:
        while self._files:
            os.close(self._files.popitem()[1])

    def __del__(self, _getpid=os.getpid, _close=os.close) -> None:
        # Raw descriptors are not closed by the garbage collector. The os functions are bound
        # here because module globals may already be gone at interpreter exit. Not in a forked
        # child: its copies of the parent's descriptors are closed when it exits.
        if self.pid == _getpid():
            while self._files:
                _close(self._files.popitem()[1])


def _check_header(block: bytes, *, name: str, size: int) -> None:
    """Raise :class:`_BadMember` unless ``block`` is the tar header of member ``name`` of
    ``size`` bytes, as the index says."""
    problem = _header_problem(block, name=name, size=size)
    if problem is not None:
        raise _BadMember(f"the shard's index does not match it: {problem}")


def _header_problem(block: bytes, *, name: str, size: int) -> str | None:
    """Why ``block`` is not the tar header of member ``name`` of ``size`` bytes; None if it is."""
    try:
        checksum = int(block[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
        member_size = int(block[124:136].split(b"\0", 1)[0].strip() or b"-1", 8)
    except ValueError:
        return "no tar header in front of it"
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    if checksum != unsigned:
        return "no tar header in front of it (checksum mismatch)"
    if member_size != size:
        return f"its tar header says {member_size} bytes, the index {size}"
    encoded = name.encode("utf-8")
    # Longer or non-ASCII names live in a pax/GNU header before this one; this one holds a stand-in.
    if name.isascii() and len(encoded) <= 100:
        header_name = block[:100].split(b"\0", 1)[0]
        prefix = block[345:500].split(b"\0", 1)[0]
        full = prefix + b"/" + header_name if prefix else header_name
        if full != encoded:
            return f"its tar header names {full.decode('utf-8', 'replace')!r}"
    return None


class _ShardSet(Dataset):
    """What the image and the text data sets share: the shards, their members as columns (entry
    ``i`` of the shards' indexes in shard order), a per-process reader, and
    ``data.on_bad_sample`` for members that cannot be read (or decoded)."""

    skipped: SkippedSamples | None

    def __init__(
        self,
        shards: Sequence[ShardIndex],
        *,
        on_bad_sample: str,
        shard_bytes: Sequence[int] | None,
    ) -> None:
        check_choice("data.on_bad_sample", on_bad_sample, ON_BAD_SAMPLE)
        self.on_bad_sample = on_bad_sample
        self.urls = [shard.url for shard in shards]
        # What can be read of each shard: its size now (shorter than the index says when the
        # shard was truncated after indexing; those members then fail as bad samples).
        self.shard_bytes = (
            list(shard_bytes) if shard_bytes is not None else [s.tar_bytes for s in shards]
        )
        self.keys = [f"{key}.{ext}" for shard in shards for key, ext in zip(shard.keys, shard.exts)]
        # Compact columns: ImageNet has 1.28 million samples, and spawned workers get a copy.
        self._shard = torch.tensor(
            [number for number, shard in enumerate(shards) for _ in range(len(shard))],
            dtype=torch.int32,
        )
        self._offset = torch.tensor([o for s in shards for o in s.offsets], dtype=torch.int64)
        self._size = torch.tensor([n for s in shards for n in s.sizes], dtype=torch.int64)
        self._reader: _Reader | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def _skip_counter(self) -> SkippedSamples | None:
        """The counter of replaced loads under skip (None under error), once ``len`` is known."""
        return SkippedSamples(len(self)) if self.on_bad_sample == "skip" else None

    def _entry(self, member: int) -> tuple[int, str, int, int]:
        """(shard number, key with extension, offset, size) of member ``member``."""
        return (
            int(self._shard[member]),
            self.keys[member],
            int(self._offset[member]),
            int(self._size[member]),
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_reader"] = None  # open files stay in the process that opened them
        return state

    def _read_range(self, number: int, start: int, length: int) -> bytes:
        """``length`` bytes of shard ``number`` from ``start``; short only at the shard's end."""
        reader = self._reader
        if reader is None or reader.pid != os.getpid():
            reader = self._reader = _Reader()
        data = reader.read(self.urls[number], start, length)
        if len(data) > length:
            # A server that ignores Range sends the whole shard: fail rather than read it all.
            raise ShardError(
                f"data: shard {self.urls[number]}: asked for {length} bytes at {start}, got "
                f"{len(data)}; the server does not honour HTTP range requests"
            )
        return data

    def _member(self, number: int, key: str, offset: int, size: int, *, header: bool) -> bytes:
        """The bytes of member ``key`` (at ``offset``, ``size`` long) of shard ``number``; with
        ``header``, its tar header is read along and checked against the index."""
        if offset + size > self.shard_bytes[number]:
            raise _BadMember(
                f"the shard is truncated: it has {self.shard_bytes[number]} bytes, the member "
                f"ends at byte {offset + size}"
            )
        extra = _BLOCK if header else 0
        data = self._read_range(number, offset - extra, size + extra)
        if len(data) < size + extra:
            raise _BadMember(f"the shard ends {size + extra - len(data)} bytes before the member")
        if header:
            _check_header(data[:_BLOCK], name=key, size=size)
        return data[extra:]

    def _first_loadable(self, index: int, load: Callable[[int], T | None]) -> T:
        size = len(self)
        return first_loadable(
            index,
            size,
            load,
            self.skipped,
            none_loads=f"none of the {size} samples in {len(self.urls)} shards can be loaded; "
            f"check data.root",
        )

    def _bad(self, index: int, where: str, verb: str, reason: str, cause: Exception) -> None:
        """Raise for a bad sample under error; log it once under skip."""
        if self.skipped is None:
            raise BadSampleError(
                f"data: cannot {verb} {where} ({reason}); fix or re-create the shard, or set "
                f"data.on_bad_sample=skip"
            ) from cause
        if self.skipped.mark_bad(index):
            logger.warning(
                "data: skipping %s (%s): it cannot be %s; the next sample that can is loaded in "
                "its place (data.on_bad_sample=skip)",
                where,
                reason,
                "read" if verb == "read" else "decoded",
            )
