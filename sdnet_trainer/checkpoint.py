"""Checkpoints: torch.distributed.checkpoint (DCP) shards in one folder per step, committed
atomically.

Layout of the checkpoint directory::

    step_00000042/           a committed checkpoint: DCP's .metadata and __<rank>_<n>.distcp shards,
        manifest.json        plus this file, written last, listing every file and its size
    .staging_step_00000043/  a save in progress (or the leftover of a crashed one); never listed
    .trash_*                 a checkpoint being deleted or replaced; never listed

Every rank writes its own shard into the staging folder. DCP's save ends with a gather of all ranks'
write results on rank 0, which then writes ``.metadata``; so once ``dcp.save`` returns on rank 0,
every shard is on disk (fsynced: ``sync_files=True``). Rank 0 then commits alone: it writes the
manifest, renames the staging folder to its final name (atomic on POSIX) and fsyncs the parent
directory. A checkpoint is therefore visible only once complete, and a crash at any point leaves the
previous ones intact. Pruning deletes old checkpoints only after a newer one is committed.

Loading goes through DCP as well, which reshards to the current world size. Non-tensor entries and
DCP's own ``.metadata`` are unpickled with restricted unpicklers, so a checkpoint from elsewhere
cannot run code when it is loaded.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, is_dataclass
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from sdnet_trainer.distributed.ops import is_distributed
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save and load that it "assumes" a single process; that
    is exactly the no_dist case this manager selects on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="torch.distributed is disabled, unavailable or uninitialized",
            category=UserWarning,
        )
        yield


MANIFEST = "manifest.json"
FORMAT_VERSION = 1
DCP_METADATA = ".metadata"  # DCP's index of the checkpoint, written by rank 0 after every shard
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STAGING_PREFIX = ".staging_"
_TRASH_PREFIX = ".trash_"
_STAGING_DIR = re.compile(r"^\.staging_step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or validated; the message names its path."""


@dataclass(frozen=True)
class Checkpoint:
    """A committed, validated checkpoint folder."""

    path: Path
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


class CheckpointManager:
    """Owns one checkpoint directory. Every rank constructs one and calls ``save``, ``load`` and
    ``resolve_resume`` collectively (same order on every rank); only rank 0 commits and deletes."""

    def __init__(
        self,
        directory: str | Path,
        *,
        keep_last: int,
        async_save: bool,
        rank: int,
        world_size: int,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        assert keep_last >= 1, "checkpoint.keep_last is checked before launch"
        self.directory = Path(directory).absolute()
        self.keep_last = keep_last
        self.async_save = async_save
        self.rank = rank
        self.world_size = world_size
        self._distributed = is_distributed()
        self._check_rank(rank, world_size)
        self._group, self._owns_group = self._checkpoint_group(process_group)
        self._pending: Future[None] | None = None
        self.directory.mkdir(parents=True, exist_ok=True)

    def _check_rank(self, rank: int, world_size: int) -> None:
        actual = (dist.get_rank(), dist.get_world_size()) if self._distributed else (0, 1)
        if (rank, world_size) != actual:
            raise ValueError(
                f"CheckpointManager got rank {rank} of {world_size}, but the process "
                f"group says rank {actual[0]} of {actual[1]}"
            )

    def _checkpoint_group(
        self, group: dist.ProcessGroup | None
    ) -> tuple[dist.ProcessGroup | None, bool]:
        if group is not None or not self._distributed:
            return group, False
        # A group of its own, as DCP recommends: async saves run collectives from a background
        # thread, which must never interleave with the training loop's collectives. gloo, because
        # async save needs a CPU backend and the collectives only carry small pickled plans.
        # new_group is collective: every rank must construct the manager at the same point.
        own = dist.new_group(backend="gloo")
        # Every rank joins (no ``ranks`` given), so this rank is a member and gets a real group.
        return cast(dist.ProcessGroup, own), True

    # ------------------------------------------------------------------ saving

    def save(
        self, step: int, state_dict: dict[str, Any], *, meta: dict[str, Any] | None = None
    ) -> None:
        """Save ``state_dict`` (collective) as the checkpoint of ``step``.

        Sync: returns once written and, on rank 0, committed. Async: returns once the state is
        copied to CPU memory, so the caller may keep mutating its tensors; the write and the commit
        finish in the background (``wait`` joins them). Every rank may save different keys (e.g. its
        own ``rng/rank{r}``); tensors present on every rank (replicated) are written once."""
        self.wait()  # one save in flight; surfaces the previous async save's error
        meta = _json_round_trip(meta or {})
        staging = self.directory / f"{_STAGING_PREFIX}{_step_name(step)}"
        if self.rank == 0:
            # Leftover of a crashed save of this same step. Safe before the collective: other ranks
            # write their shards only after rank 0 has joined the save and re-created the folder.
            _remove_tree(staging)
        writer = FileSystemWriter(staging, sync_files=True)
        started = time.monotonic()
        # Async: the writer doubles as DCP's stager (BlockingAsyncStager), so async_save copies
        # every tensor to new CPU memory before returning, then writes from that copy in a thread.
        save = dcp.async_save if self.async_save else dcp.save
        try:
            with _single_process_quiet():
                response = save(
                    state_dict,
                    storage_writer=writer,
                    process_group=self._group,
                    no_dist=not self._distributed,
                )
        except (Exception, CheckpointException) as exc:
            what = (
                f"stage step {step} for saving"
                if self.async_save
                else f"save step {step} to {staging}"
            )
            raise CheckpointError(f"cannot {what}: {_describe(exc)}") from exc
        if not self.async_save:
            if self.rank == 0:
                assert isinstance(response, Metadata)  # what dcp.save returns
                self._commit(step, staging, response, meta=meta, started=started)
            return
        upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        logger.debug("checkpoint step %d staged in %.2f s", step, time.monotonic() - started)
        self._pending = self._after_upload(upload, step, staging, meta=meta, started=started)

    def _after_upload(
        self, upload: Future, step: int, staging: Path, *, meta: dict[str, Any], started: float
    ) -> Future[None]:
        """A future that completes once ``upload`` has and, on rank 0, the commit too."""
        done: Future[None] = Future()

        def finish(_: Future) -> None:
            # Runs in DCP's writer thread. Errors are logged now (the loop may not look for a
            # while) and kept for the next save() / wait() to raise.
            try:
                try:
                    metadata = upload.result()
                except (Exception, CheckpointException) as exc:
                    raise CheckpointError(
                        f"cannot save step {step} to {staging}: {_describe(exc)}"
                    ) from exc
                if self.rank == 0:
                    self._commit(step, staging, metadata, meta=meta, started=started)
            except BaseException as exc:  # noqa: BLE001 - handed over to wait(), never dropped
                logger.error("async checkpoint of step %d failed: %s", step, exc, exc_info=exc)
                done.set_exception(exc)
            else:
                done.set_result(None)

        upload.add_done_callback(finish)
        return done

    def wait(self) -> None:
        """Block until the pending async save, if any, is written and committed; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _commit(
        self, step: int, staging: Path, metadata: Metadata, *, meta: dict[str, Any], started: float
    ) -> Checkpoint:
        """Rank 0, after DCP's save returned: manifest, atomic rename, then pruning."""
        files = _written_files(staging, metadata)
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": self.world_size,
            "created": time.time(),
            "meta": meta,
            "files": [{"name": name, "bytes": size} for name, size in sorted(files.items())],
        }
        _write_json_atomic(staging / MANIFEST, manifest)
        final = self.directory / _step_name(step)
        _replace_dir(staging, final)
        _fsync_dir(self.directory)
        logger.info(
            "checkpoint step %d saved to %s (%.1f MB, %.2f s)",
            step,
            final,
            sum(files.values()) / 2**20,
            time.monotonic() - started,
        )
        self._prune(committed=step)
        return Checkpoint(path=final, step=step, world_size=self.world_size, meta=meta)

    def _prune(self, *, committed: int) -> None:
        """Delete checkpoints beyond keep_last (oldest first, never the one just committed), staging
        folders of crashed earlier saves and interrupted deletions."""
        kept = self.checkpoints()[-self.keep_last :]
        oldest_kept = min([c.step for c in kept] + [committed])
        newer = [c.step for c in kept if c.step > committed]
        if newer:
            logger.warning(
                "checkpoint directory %s holds steps %s after the just saved step %d (from "
                "another run?); resume=auto will pick them",
                self.directory,
                newer,
                committed,
            )
        for path in sorted(self.directory.iterdir()):
            if path.is_dir() and _is_stale(path.name, oldest_kept=oldest_kept, committed=committed):
                logger.info("deleting old checkpoint folder %s", path)
                _remove_tree(path)

    # ------------------------------------------------------------------ listing and resuming

    def checkpoints(self) -> list[Checkpoint]:
        """Committed, valid checkpoints, oldest first; invalid ones are skipped with a warning."""
        found = []
        for _step, path in sorted(_step_dirs(self.directory)):
            try:
                found.append(read_checkpoint(path))
            except CheckpointError as exc:
                logger.warning("skipping checkpoint %s: %s", path, exc)
        return found

    def latest(self) -> Checkpoint | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def resolve_resume(self, resume: str) -> Checkpoint | None:
        """``checkpoint.resume`` to a checkpoint: ``none`` -> None, ``auto`` -> the newest valid one
        (None if there is none), anything else a path (``find_checkpoint``).

        Collective: rank 0 decides and the other ranks follow, so all of them load the same one."""
        self.wait()  # the broadcast below shares the group with a background save
        outcome: Checkpoint | Exception | None = None
        if self.rank == 0:
            try:
                outcome = self._resolve(resume)
            except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
                outcome = exc
        outcome = self._from_rank0(outcome)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _resolve(self, resume: str) -> Checkpoint | None:
        if resume == "none":
            return None
        if resume == "auto":
            return self.latest()
        return find_checkpoint(resume, key="checkpoint.resume")

    def _from_rank0(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        if isinstance(obj, Exception) and not isinstance(obj, (ConfigError, CheckpointError)):
            obj = CheckpointError(f"{type(obj).__name__}: {obj}")  # any exception, made picklable
        box = [obj]
        dist.broadcast_object_list(box, group=self._group, group_src=0)
        return box[0]

    # ------------------------------------------------------------------ loading

    def load(
        self,
        checkpoint: Checkpoint,
        state_dict: dict[str, Any],
        *,
        optional_keys: Iterable[str] = (),
    ) -> None:
        """Load ``checkpoint`` into ``state_dict`` in place (collective): tensors are copied into
        the existing tensors, other values replaced. Any key of ``state_dict`` that the checkpoint
        lacks is an error, except the ``optional_keys`` (left untouched: e.g. ``rng/rank3`` after a
        run is resumed on more ranks). The state is resharded to this world size."""
        self.wait()  # a background save shares the group
        request = dict(state_dict)
        for key in optional_keys:
            if key in request and not checkpoint.has_key(key):
                logger.info(
                    "checkpoint %s has no %r; keeping its current value", checkpoint.path, key
                )
                del request[key]
        try:
            # Missing keys fail inside DCP's planning step, which reports them on every rank: a
            # check here that raised on one rank only would leave the others waiting.
            with _single_process_quiet():
                dcp.load(
                    request,
                    storage_reader=SafeFileSystemReader(checkpoint.path),
                    planner=SafeLoadPlanner(),
                    process_group=self._group,
                    no_dist=not self._distributed,
                )
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(
                f"cannot load checkpoint {checkpoint.path}: {_describe(exc)}"
            ) from exc
        # DCP replaces non-tensor top-level values in the dict it was given: copy them back.
        state_dict.update(request)

    def close(self) -> None:
        """Wait for the pending save, then release the process group this manager created."""
        try:
            self.wait()
        finally:
            if self._owns_group and self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group, self._owns_group = None, False


def _describe(exc: BaseException) -> str:
    """One line per failed rank instead of DCP's CheckpointException, which lists tracebacks (they
    stay available through ``raise ... from``)."""
    if isinstance(exc, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in exc.failures.items()
        )
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------- validation


def read_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint in ``path`` if its manifest is valid and every listed file exists with the
    listed size; else CheckpointError saying why."""
    path = Path(path)
    manifest = _read_manifest(path)
    name_step = _STEP_DIR.match(path.name)
    if name_step and int(name_step[1]) != manifest["step"]:
        raise CheckpointError(
            f"the folder name says step {int(name_step[1])}, {MANIFEST} says "
            f"step {manifest['step']}"
        )
    _check_files(path, manifest["files"])
    return Checkpoint(
        path=path, step=manifest["step"], world_size=manifest["world_size"], meta=manifest["meta"]
    )


def find_checkpoint(value: str | Path, *, key: str) -> Checkpoint:
    """The checkpoint a user named by path (``key`` says where: checkpoint.resume, export's
    checkpoint=), for resume and export alike: a step_* folder must be a valid checkpoint; a
    checkpoint directory stands for its newest valid one, invalid ones skipped with the reason."""
    path = Path(value).expanduser().resolve()
    if not path.exists():
        raise ConfigError(f"{key}={str(value)!r}: {path} does not exist")
    steps = sorted(_step_dirs(path), reverse=True)
    if steps and not (path / MANIFEST).exists():
        reasons = []
        for _, candidate in steps:
            try:
                checkpoint = read_checkpoint(candidate)
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
        return read_checkpoint(path)
    except CheckpointError as err:
        hint = (
            f"; a run's checkpoints are in {path / 'checkpoints'}"
            if (path / "checkpoints").is_dir()
            else ""
        )
        raise ConfigError(
            f"{key}={str(value)!r}: {path} is not a usable checkpoint: {err}{hint}"
        ) from None


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError("not a folder")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no {MANIFEST}: the save did not complete") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"unreadable {MANIFEST}: {exc}") from None
    expected: dict[str, type | tuple[type, ...]] = {
        "format_version": int,
        "step": int,
        "world_size": int,
        "created": (int, float),
        "meta": dict,
        "files": list,
    }
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{MANIFEST} is not a JSON object")
    for key, kind in expected.items():
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"{MANIFEST} lacks a valid {key!r}")
    if manifest["format_version"] != FORMAT_VERSION:
        raise CheckpointError(
            f"{MANIFEST} has format version {manifest['format_version']}, "
            f"this version reads {FORMAT_VERSION}"
        )
    return manifest


def _check_files(path: Path, files: list[Any]) -> None:
    listed = {}
    for entry in files:
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("bytes"), int)
            and "/" not in entry["name"]
        ):
            raise CheckpointError(f"{MANIFEST} has a malformed file entry: {entry!r}")
        listed[entry["name"]] = entry["bytes"]
    if DCP_METADATA not in listed:
        raise CheckpointError(f"{MANIFEST} does not list DCP's {DCP_METADATA}")
    for name, size in listed.items():
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{name} is missing") from None
        if actual != size:
            raise CheckpointError(
                f"{name} is {actual} bytes, {MANIFEST} says {size} (truncated or overwritten)"
            )


# ---------------------------------------------------------------------- safe reading


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


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose ``.metadata`` is read with a restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata: only written without collectives
            raise CheckpointError(f"{self.path} has no {DCP_METADATA}")
        metadata = _read_dcp_metadata(Path(self.path))
        assert metadata.storage_meta is not None  # _read_dcp_metadata fills it in
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _read_dcp_metadata(path: Path) -> Metadata:
    try:
        with open(path / DCP_METADATA, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path / DCP_METADATA}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path / DCP_METADATA} does not hold DCP metadata")
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    return metadata


# ---------------------------------------------------------------------- filesystem


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def _step_dirs(directory: Path) -> Iterator[tuple[int, Path]]:
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if (m := _STEP_DIR.match(path.name)) and path.is_dir():
            yield int(m[1]), path


def _written_files(staging: Path, metadata: Metadata) -> dict[str, int]:
    """{name: bytes} of every file of a finished save: DCP's .metadata and the shard files it points
    into, each checked to hold the byte ranges DCP recorded for it. Taken from DCP's metadata rather
    than a directory listing, which a network filesystem may serve stale to rank 0."""
    needed = {DCP_METADATA: 1}
    for info in metadata.storage_data.values():  # FileSystemWriter: where each item's bytes are
        needed[info.relative_path] = max(
            needed.get(info.relative_path, 0), info.offset + info.length
        )
    files = {}
    for name, minimum in needed.items():
        try:
            files[name] = (staging / name).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"DCP's save finished but {staging / name} is missing") from None
        if files[name] < minimum:
            raise CheckpointError(
                f"DCP's save finished but {staging / name} holds {files[name]} "
                f"bytes, fewer than the {minimum} it wrote there"
            )
    return files


def _json_round_trip(meta: dict[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint meta must be JSON data: {exc}") from None


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    # Makes renames and new entries in the folder durable (POSIX: fsync on the directory).
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``. An existing ``dst`` (the same step saved again) is renamed aside
    first and deleted after: rename(2) cannot replace a non-empty folder."""
    if not dst.exists():
        os.rename(src, dst)
        return
    aside = dst.with_name(f"{_TRASH_PREFIX}{dst.name}.{uuid.uuid4().hex[:8]}")
    os.rename(dst, aside)
    os.rename(src, dst)
    _fsync_dir(dst.parent)
    shutil.rmtree(aside, ignore_errors=True)


def _is_stale(name: str, *, oldest_kept: int, committed: int) -> bool:
    if m := _STEP_DIR.match(name):
        return int(m[1]) < oldest_kept
    if m := _STAGING_DIR.match(name):
        return int(m[1]) < committed  # a crashed earlier save (a later step's may be another run's)
    return name.startswith(_TRASH_PREFIX)  # an interrupted deletion


def _remove_tree(path: Path) -> None:
    """Delete a folder, best effort. A checkpoint is renamed aside first, so that it is never seen
    half deleted (e.g. shards gone, manifest still there)."""
    try:
        if not path.exists():
            return
        if _STEP_DIR.match(path.name):
            aside = path.with_name(f"{_TRASH_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
            os.rename(path, aside)
            path = aside
        shutil.rmtree(path)
    except OSError as exc:
        logger.warning("could not delete %s: %s", path, exc)
