"""Reading a checkpoint that may be hostile. Every read of a checkpoint folder's files by this
package goes through this module: listing and picking checkpoints (``read_checkpoint``,
``find_checkpoint``), checksums (``crc32``), and DCP's load
(``SafeFileSystemReader`` with ``SafeLoadPlanner``, which ``CheckpointManager.load`` passes to it).

A checkpoint is untrusted input: it may come from another machine, a download or a shared folder.
For a crafted one, this module guarantees:

* No code runs when it is read or loaded. DCP's ``.metadata`` is unpickled by
  ``_MetadataUnpickler``, which resolves only DCP's own dataclasses and enums, torch dtypes,
  ``torch.Size``, torch's layout helper, pathlib paths and ``OrderedDict``; any other global is an
  error. The state's non-tensor entries are loaded with ``torch.load(weights_only=True)``:
  primitives, lists, dicts, tuples and tensors, nothing else (DCP's default planner would unpickle
  them with full trust).
* Nothing outside the checkpoint folder is opened, and nothing is written. A file is opened only
  by a plain name (no folder part, no ``..``) directly in the folder, with O_NOFOLLOW (a symbolic
  link is refused, never followed) and O_NONBLOCK (a FIFO cannot hang the reader), and is read only
  if ``fstat`` of the opened descriptor says it is a regular file, so a file swapped between a
  check and the open is caught at the open (``_open_inside``). DCP's reader gets a file system that
  opens only such files, and only for reading (``_ContainedFileSystem``).
* A load reads only files the manifest lists: before DCP opens any shard, every rank checks that
  each storage entry of ``.metadata`` names a listed file (``SafeFileSystemReader``).
* A checkpoint is accepted only with a valid manifest: a JSON object with typed fields, a readable
  format version, the step its folder name says, and for each file a plain name, a size and, in
  format 2, a crc32; each listed file must be a regular file (``lstat``: not a symbolic link) of
  that size, and ``.metadata`` must be listed. ``verify=True`` (how ``find_checkpoint`` and
  ``resume`` pick one to load) also reads every file to compare its crc32 (a manager's ranks
  share these reads, each file read by one of them; any rank's mismatch fails the checkpoint,
  naming the file) and checks ``.metadata`` as a load would.

In an object store (``objects.ObjectFolder``) the same rules hold where they apply: objects opened
by plain names under the checkpoint's prefix only, for reading, each of the listed size.

Not guaranteed: that the values are what the run saved. crc32 catches accidental damage; a forger
rewrites the manifest too. Nor that the files stay as verified while they are read: whoever can
write into the folder during a load can change what is read, though still only regular files inside
it, through the restricted unpicklers. A checkpoint folder named by a path is resolved first, so
the folder itself may be reached through a symbolic link; its files may not.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pickle
import stat
import zlib
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, is_dataclass
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from sdnet_trainer.checkpoint.files import (
    DCP_METADATA,
    MANIFEST,
    READABLE_FORMATS,
    STEP_DIR,
    Folder,
    folder_of,
    invalid_field,
    step_dirs,
)
from sdnet_trainer.checkpoint.objects import ObjectFolder
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

_CHUNK = 4 * 2**20  # bytes read at a time for checksums
_MANIFEST_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format_version": int,
    "step": int,
    "world_size": int,
    "created": (int, float),
    "meta": dict,
    "files": list,
}


# What reading a checkpoint returns and raises. Defined here, the lowest module that needs them, so
# that this module imports nothing of the manager's; ``manager`` and the package re-export them.


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or validated; the message names its path."""


class Uncommitted(CheckpointError):
    """A step folder (prefix) without a manifest: a save that did not finish, or, in an object
    store, one in progress or a step being deleted."""


@dataclass(frozen=True)
class Checkpoint:
    """A committed, validated checkpoint folder (or object store prefix)."""

    path: Folder
    step: int
    world_size: int  # of the run that saved it
    meta: dict[str, Any] = field(hash=False)  # the dict passed to save(), JSON round-tripped

    def has_key(self, key: str) -> bool:
        """Whether the checkpoint holds ``key``: a top-level key of the saved state dict or a
        flattened prefix of one (``"model"``, ``"model.fc.weight"``, ``"rng/rank3"``)."""
        prefix = key + "."
        return key in self._keys or any(k.startswith(prefix) for k in self._keys)

    @cached_property
    def _keys(self) -> frozenset[str]:
        # DCP flattens nested dicts into dotted keys; its metadata lists all of them.
        return frozenset(_read_dcp_metadata(self.path).state_dict_metadata)


# Checks the crc32 of the files of a checkpoint folder, {name: (bytes, crc32)} as its manifest
# lists them (names already checked to be plain file names of regular files there); raises a
# CheckpointError naming the first file that fails. ``check_checksums`` reads them all here; a
# manager spreads the reads over its ranks.
ChecksumCheck = Callable[[Folder, dict[str, tuple[int, int]]], None]


def check_checksums(folder: Folder, expected: dict[str, tuple[int, int]]) -> None:
    """Read every file in ``expected`` and compare its crc32 (``.metadata`` first: small)."""
    for name in sorted(expected, key=lambda n: n != DCP_METADATA):
        if (error := checksum_error(folder, name, expected[name][1])) is not None:
            raise CheckpointError(error)


def checksum_error(folder: Folder, name: str, expected: int) -> str | None:
    """Why ``folder/name`` fails its checksum (it differs, or cannot be read), or None."""
    try:
        actual = crc32(folder / name)
    except (OSError, CheckpointError) as exc:
        return f"cannot read {name} to check its checksum: {exc}"
    if actual != expected:
        return (
            f"{name} does not match its checksum (crc32 {actual:08x}, {MANIFEST} says "
            f"{expected:08x}): corrupted after it was written"
        )
    return None


def read_checkpoint(
    path: str | Folder, *, verify: bool = False, checksums: ChecksumCheck = check_checksums
) -> Checkpoint:
    """The checkpoint in ``path`` if its manifest is valid and every listed file is a regular file
    in the folder with the listed size; else CheckpointError saying why.

    ``verify``: also read every file to check its checksum (format 2 manifests; ``checksums``
    does it), and check that DCP's ``.metadata`` is readable and points only to files the manifest
    lists. This reads the whole checkpoint once: done when a checkpoint is picked for loading, not
    when listing."""
    path = Path(path) if isinstance(path, str) else path
    manifest = _read_manifest(path)
    name_step = STEP_DIR.match(path.name)
    if name_step and int(name_step[1]) != manifest["step"]:
        raise CheckpointError(
            f"the folder name says step {int(name_step[1])}, {MANIFEST} says "
            f"step {manifest['step']}"
        )
    listed = _check_files(path, manifest["files"], checksums=manifest["format_version"] >= 2)
    if verify:
        checksums(
            path,
            {
                name: (entry["bytes"], entry["crc32"])
                for name, entry in listed.items()
                if entry.get("crc32") is not None
            },
        )
        _check_storage_paths(_read_dcp_metadata(path), set(listed))
    return Checkpoint(
        path=path, step=manifest["step"], world_size=manifest["world_size"], meta=manifest["meta"]
    )


def find_checkpoint(
    value: str | Path,
    *,
    key: str,
    checksums: ChecksumCheck = check_checksums,
    storage_options: dict[str, Any] | None = None,
) -> Checkpoint:
    """The checkpoint a user named by path or URL (``key`` says where: checkpoint.resume, export's
    checkpoint=), for resume and export alike, verified (``read_checkpoint(verify=True)``, with
    ``checksums``): a step_* folder must pass; a checkpoint directory stands for its newest
    checkpoint that passes, failing ones skipped with the reason (URLs: ``storage_options``)."""
    path: Folder = folder_of(value, storage_options)
    if isinstance(path, Path):
        path = path.resolve()
        found, has_manifest = path.exists(), (path / MANIFEST).exists()
    else:
        objects, prefixes = path.listing()
        found, has_manifest = bool(objects or prefixes), MANIFEST in objects
    if not found:
        raise ConfigError(f"{key}={str(value)!r}: {path} does not exist")
    steps = sorted(step_dirs(path), reverse=True)
    if steps and not has_manifest:
        reasons = []
        for _, candidate in steps:
            try:
                checkpoint = read_checkpoint(candidate, verify=True, checksums=checksums)
            except CheckpointError as err:
                logger.warning("skipping checkpoint %s: %s", candidate, err)
                reasons.append(f"{candidate.name}: {err}")
                continue
            logger.info(
                "%s=%s is a checkpoint directory: using its newest checkpoint, %s",
                key,
                path,
                candidate.name,
            )
            return checkpoint
        raise ConfigError(
            f"{key}={str(value)!r}: {path} holds no usable checkpoint ({'; '.join(reasons)})"
        )
    try:
        return read_checkpoint(path, verify=True, checksums=checksums)
    except CheckpointError as err:
        hint = (
            f"; a run's checkpoints are in {path / 'checkpoints'}"
            if isinstance(path, Path) and (path / "checkpoints").is_dir()
            else ""
        )
        raise ConfigError(
            f"{key}={str(value)!r}: {path} is not a usable checkpoint: {err}{hint}"
        ) from None


def _read_manifest(path: Folder) -> dict[str, Any]:
    if isinstance(path, Path) and not path.is_dir():
        raise CheckpointError("not a folder")
    try:
        with _open_inside(path, MANIFEST) as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise Uncommitted(f"no {MANIFEST}: the save did not complete") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"unreadable {MANIFEST}: {exc}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{MANIFEST} is not a JSON object")
    if (key := invalid_field(manifest, _MANIFEST_FIELDS)) is not None:
        raise CheckpointError(f"{MANIFEST} lacks a valid {key!r}")
    if manifest["format_version"] not in READABLE_FORMATS:
        raise CheckpointError(
            f"{MANIFEST} has format version {manifest['format_version']}, "
            f"this version reads {', '.join(map(str, READABLE_FORMATS))}"
        )
    return manifest


def _is_file_name(name: Any) -> bool:
    """A plain file name: no folder part, nothing that leads out of the folder."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\0" not in name
        and (os.altsep is None or os.altsep not in name)
    )


def _check_files(path: Folder, files: list[Any], *, checksums: bool) -> dict[str, dict[str, Any]]:
    """{name: entry} of the manifest's files, each checked to be a regular file (not a symbolic
    link) directly in ``path`` with the listed size (an object directly under the prefix)."""
    listed = {}
    for entry in files:
        if not (
            isinstance(entry, dict)
            and _is_file_name(entry.get("name"))
            and isinstance(entry.get("bytes"), int)
            and (
                not checksums
                or (isinstance(entry.get("crc32"), int) and 0 <= entry["crc32"] < 2**32)
            )
        ):
            raise CheckpointError(f"{MANIFEST} has a malformed file entry: {entry!r}")
        listed[entry["name"]] = entry
    if DCP_METADATA not in listed:
        raise CheckpointError(f"{MANIFEST} does not list DCP's {DCP_METADATA}")
    if isinstance(path, ObjectFolder):
        try:
            present = path.listing()[0]
        except OSError as exc:
            raise CheckpointError(f"cannot list its objects: {exc}") from None
        for name, entry in listed.items():
            _check_size(name, present.get(name), entry["bytes"])
        return listed
    for name, entry in listed.items():
        try:
            info = os.lstat(path / name)
        except FileNotFoundError:
            raise CheckpointError(f"{name} is missing") from None
        if stat.S_ISLNK(info.st_mode):
            raise CheckpointError(
                f"{name} is a symbolic link (to {os.readlink(path / name)!r}); a checkpoint's "
                f"files must be regular files inside its folder"
            )
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{name} is not a regular file")
        _check_size(name, info.st_size, entry["bytes"])
    return listed


def _check_size(name: str, actual: int | None, listed: int) -> None:
    if actual is None:
        raise CheckpointError(f"{name} is missing")
    if actual != listed:
        raise CheckpointError(
            f"{name} is {actual} bytes, {MANIFEST} says {listed} (truncated or overwritten)"
        )


def _check_storage_paths(metadata: Metadata, listed: set[str]) -> None:
    """Every file DCP's ``.metadata`` points to must be one the manifest lists, which
    ``_check_files`` found inside the folder: DCP itself opens whatever path an entry names."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"{DCP_METADATA} has no storage entries")
    for index, info in storage.items():
        fqn = getattr(index, "fqn", index)
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str):
            raise CheckpointError(f"{DCP_METADATA} entry {fqn} names no file")
        if not _is_file_name(relative):
            raise CheckpointError(
                f"{DCP_METADATA} entry {fqn} points to {relative!r}, outside the checkpoint"
            )
        if relative not in listed:
            raise CheckpointError(
                f"{DCP_METADATA} entry {fqn} points to {relative!r}, a file {MANIFEST} does not "
                f"list"
            )


def crc32(path: Folder) -> int:
    """crc32 of a file, read in 4 MiB chunks. crc32 because it catches what it is for, accidental
    damage (zeroed, truncated or flipped bytes), at a few GB/s from the standard library; it is no
    defence against a forger, who can rewrite the manifest too: containment and the restricted
    unpicklers are."""
    crc = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with _open_inside(path.parent, path.name) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


@contextmanager
def _open_inside(folder: Folder, name: str) -> Iterator[io.BufferedReader]:
    """``folder/name`` opened for reading if it is a regular file there: never through a symbolic
    link (O_NOFOLLOW), never outside ``folder``, never blocking on a FIFO (O_NONBLOCK, which
    regular files ignore). In an object store: the object of that plain name under the prefix."""
    if not _is_file_name(name):
        raise CheckpointError(f"refusing to read {name!r}: not a file name inside {folder}")
    if isinstance(folder, ObjectFolder):
        with folder.open(name) as stream:
            yield cast(io.BufferedReader, stream)
        return
    try:
        fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(
                f"{name} is a symbolic link; a checkpoint's files must be regular files inside "
                f"its folder"
            ) from None
        raise
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{name} is not a regular file")
        yield f


# ---------------------------------------------------------------------- loading through DCP


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that unpickles non-tensor entries with ``weights_only=True``: primitives,
    lists, dicts, tuples and tensors load; any other object is refused instead of constructed
    (DCP's default uses ``weights_only=False``, i.e. runs arbitrary pickled code)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(
                f"entry {fqn!r} is not plain data (refused to unpickle it): {exc}"
            ) from None
        if self.flatten_state_dict:
            _set_path(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _set_path(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """Put ``value`` at ``path`` (keys and list indices) in the state dict being loaded into.
    The containers along the path exist: DCP planned the read from this same state dict."""
    container: Any = root
    for key in path[:-1]:
        container = container[key]
    container[path[-1]] = value


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``, which holds only DCP's own dataclasses and enums, torch
    dtypes, ``torch.Size`` and a path; every other global is refused."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (is_dataclass(obj) or issubclass(obj, Enum)):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


class _ContainedFileSystem(FileSystem):
    """DCP's file system for reading one checkpoint: it opens only regular files directly inside
    the checkpoint folder (objects directly under its prefix), never through a symbolic link, and
    writes nothing."""

    def __init__(self, root: Folder) -> None:
        self.root = root

    def init_path(self, path: str | os.PathLike | ObjectFolder) -> Folder:  # type: ignore[override]
        return path if isinstance(path, ObjectFolder) else Path(path)

    def concat_path(self, path: Any, suffix: str) -> Folder:  # type: ignore[override]
        return self.init_path(path) / suffix

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[io.IOBase, None, None]:
        path = self.init_path(path)
        if mode != "rb":
            raise CheckpointError(f"refusing to open {path} with mode {mode!r}: reading only")
        if path.parent != self.root:
            raise CheckpointError(f"refusing to read {path}: outside the checkpoint {self.root}")
        with _open_inside(self.root, path.name) as stream:
            yield cast(io.IOBase, stream)


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``.metadata`` is read with a restricted unpickler, whose storage
    entries must point to files the manifest lists, and which opens only regular files inside the
    checkpoint folder."""

    def __init__(self, path: Folder) -> None:
        super().__init__(str(path))
        self.contained = _ContainedFileSystem(path)
        self.fs = self.contained
        self.path = path  # type: ignore[assignment]  # DCP joins names onto it with concat_path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self.contained = _ContainedFileSystem(self.contained.init_path(self.path))
        self.fs = self.contained

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata: only written without collectives
            raise CheckpointError(f"{self.path} has no {DCP_METADATA}")
        metadata = _read_dcp_metadata(self.contained.root)
        assert metadata.storage_meta is not None  # _read_dcp_metadata fills it in
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        # Every rank, with the metadata its reads will follow: the files it names are checked
        # against the manifest before DCP opens any of them.
        manifest = _read_manifest(self.contained.root)
        listed: set[str] = {
            e["name"]
            for e in manifest["files"]
            if isinstance(e, dict) and _is_file_name(e.get("name"))
        }
        _check_storage_paths(metadata, listed)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


def _read_dcp_metadata(path: Folder) -> Metadata:
    try:
        with _open_inside(path, DCP_METADATA) as f:
            metadata = _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path / DCP_METADATA}: {exc}") from None
    except CheckpointError as exc:
        raise CheckpointError(f"cannot read {path / DCP_METADATA}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path / DCP_METADATA} does not hold DCP metadata")
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    return metadata
