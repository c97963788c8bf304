"""Checkpoints: torch.distributed.checkpoint (DCP) shards in one folder per step, committed
atomically.

Layout of the checkpoint directory::

    step_00000042/           a committed checkpoint: DCP's .metadata and __<rank>_<n>.distcp shards,
        manifest.json        plus this file, written last, listing every file, its size and crc32
    .staging_step_00000043.<run>/  a save in progress of run <run> (or the leftover of a crashed
                             one); never listed, only ever deleted by the run that named it
    .trash_*                 a checkpoint being deleted or replaced; never listed
    checkpoint.lock          which run saves into this directory (held from setup to close)

Every rank writes its own shard into the staging folder. DCP's save ends with a gather of all ranks'
write results on rank 0, which then writes ``.metadata``; so once ``dcp.save`` returns on rank 0,
every shard is on disk (fsynced: ``sync_files=True``). Rank 0 then commits alone: it writes the
manifest, renames the staging folder to its final name (atomic on POSIX) and fsyncs the parent
directory. A checkpoint is therefore visible only once complete, and a crash at any point leaves the
previous ones intact. Pruning deletes old checkpoints only after a newer one is committed.

A checkpoint directory belongs to one run at a time: the manager of a training run takes the lock
file on rank 0 when it is set up (see ``_FolderLock``) and releases it on ``close``.

An async save blocks the loop only while the state is copied into host memory; DCP then writes
that copy from a background thread and rank 0 commits when it is done. One storage writer and one
DCP stager (``DefaultStager``) serve every save of a manager: the stager keeps the host copy of
each tensor's storage from one save to the next (pinned memory when the state is on CUDA), so only
the first save allocates it; later ones copy into it. An async run therefore holds one extra copy
of its state in host memory for as long as the manager lives (released by ``close``).

Loading goes through DCP as well, which reshards to the current world size. A checkpoint is
untrusted input: before one is loaded (``resume``, export) every file's size and checksum are
verified; every file a load touches must be a regular file directly inside the checkpoint folder and
listed in its manifest (no symbolic links, no ``.metadata`` entry pointing elsewhere); non-tensor
entries and DCP's own ``.metadata`` are unpickled with restricted unpicklers, so a checkpoint from
elsewhere cannot run code when it is loaded.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import socket
import stat
import time
import uuid
import warnings
import weakref
import zlib
from collections.abc import Generator, Iterable, Iterator
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
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future as TorchFuture

from sdnet_trainer.compat import reusable_stager
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
# 2: every file entry carries its crc32. Format 1 manifests (sizes only) still load.
FORMAT_VERSION = 2
_READABLE_FORMATS = (1, 2)
DCP_METADATA = ".metadata"  # DCP's index of the checkpoint, written by rank 0 after every shard
LOCK = "checkpoint.lock"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STAGING_PREFIX = ".staging_"
_TRASH_PREFIX = ".trash_"
_STAGING_DIR = re.compile(r"^\.staging_step_(\d+)\.(.+)$")
_CHUNK = 4 * 2**20  # bytes read at a time for checksums
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


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
    ``resolve_resume`` collectively (same order on every rank); only rank 0 commits and deletes.

    ``run_id``: the id of the run that saves into the directory (identical on every rank and across
    torchrun's restarts of the same run). The directory is then this run's until ``close``: rank 0
    takes its lock file, and a directory held by another live run is a ConfigError on every rank.
    None: no lock (loading only, as export does); saves then stage under a random name."""

    def __init__(
        self,
        directory: str | Path,
        *,
        keep_last: int,
        async_save: bool,
        rank: int,
        world_size: int,
        process_group: dist.ProcessGroup | None = None,
        run_id: str | None = None,
    ) -> None:
        assert keep_last >= 1, "checkpoint.keep_last is checked before launch"
        self.directory = Path(directory).absolute()
        self.keep_last = keep_last
        self.async_save = async_save
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self._distributed = is_distributed()
        self._check_rank(rank, world_size)
        self._group, self._owns_group = self._checkpoint_group(process_group)
        self._pending: Future[None] | None = None
        self.directory.mkdir(parents=True, exist_ok=True)
        # One writer for every save (each save points it at its staging folder) and, for async
        # saves, one stager whose host buffers are reused; created at the first async save, when
        # it is known whether the state lives on CUDA (pinned buffers) or not.
        self._writer = _StagingWriter(self.directory, sync_files=True)
        self._stager: DefaultStager | None = None
        self._lock = _FolderLock(self.directory, run_id) if run_id is not None else None
        # Rank 0 takes the lock and names the staging folders; every rank follows its outcome.
        outcome: str | Exception | None = None
        if rank == 0:
            try:
                if self._lock is not None:
                    self._lock.acquire()
                outcome = _run_token(run_id) if run_id is not None else uuid.uuid4().hex[:12]
            except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
                outcome = exc
        outcome = self._from_rank0(outcome)
        if isinstance(outcome, Exception):
            self._release_group()
            raise outcome
        assert isinstance(outcome, str)
        self._token = outcome

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

    def staging_dir(self, step: int) -> Path:
        """The folder this manager writes the save of ``step`` into before committing it."""
        return self.directory / f"{_STAGING_PREFIX}{_step_name(step)}.{self._token}"

    # ------------------------------------------------------------------ saving

    def save(
        self, step: int, state_dict: dict[str, Any], *, meta: dict[str, Any] | None = None
    ) -> int:
        """Save ``state_dict`` (collective) as the checkpoint of ``step``; returns the bytes of
        this rank's tensors in it (what this rank writes, headers aside).

        Sync: returns once written and, on rank 0, committed. Async: returns once the state is
        copied to CPU memory, so the caller may keep mutating its tensors; the write and the commit
        finish in the background (``wait`` joins them). Every rank may save different keys (e.g. its
        own ``rng/rank{r}``); tensors present on every rank (replicated) are written once.

        A full disk is a CheckpointError saying so (bytes needed and free), after the staging
        folder is removed; the previous checkpoints stay."""
        self.wait()  # one save in flight; surfaces the previous async save's error
        meta = _json_round_trip(meta or {})
        staging = self.staging_dir(step)
        needed = _state_nbytes(state_dict)
        if self.rank == 0:
            # Leftover of a crashed save of this same step by this run. Safe before the collective:
            # other ranks write their shards only after rank 0 has joined the save and re-created
            # the folder.
            _remove_tree(staging)
        started = time.monotonic()
        try:
            with _single_process_quiet():
                if self.async_save:
                    # async_save copies every tensor into the stager's host buffers before it
                    # returns, then writes from that copy in DCP's writer thread. The buffers are
                    # free again: wait() above joined the previous save, the last one to read them.
                    response = dcp.async_save(
                        state_dict,
                        checkpoint_id=staging,
                        storage_writer=self._writer,
                        async_stager=self._stager_for(state_dict),
                        process_group=self._group,
                        no_dist=not self._distributed,
                    )
                else:
                    response = dcp.save(
                        state_dict,
                        checkpoint_id=staging,
                        storage_writer=self._writer,
                        process_group=self._group,
                        no_dist=not self._distributed,
                    )
            if not self.async_save:
                if self.rank == 0:
                    assert isinstance(response, Metadata)  # what dcp.save returns
                    self._commit(step, staging, response, meta=meta, started=started)
                return needed
        except (Exception, CheckpointException) as exc:
            failure = self._save_failed(exc, step, staging, needed, staging_only=self.async_save)
            if failure is exc:
                raise
            raise failure from exc
        upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        logger.debug("checkpoint step %d staged in %.2f s", step, time.monotonic() - started)
        self._pending = self._after_upload(
            upload, step, staging, meta=meta, started=started, needed=needed
        )
        return needed

    def _stager_for(self, state_dict: dict[str, Any]) -> DefaultStager:
        """The run's stager, made at the first async save. Its host buffers are cached per source
        storage and reused by every later save (a tensor whose storage is new, e.g. a state built
        afresh for each save, gets a new buffer; the old one is dropped with its source). Staging
        is synchronous: save() returns with the copy complete, so the loop may change its tensors
        at once. On CUDA the buffers are pinned and the device-to-host copies are issued without
        blocking, then waited for together.

        Where torch's stager cannot be reused (``compat.reusable_stager``: torch < 2.13), each
        save gets a new one: the same copy, into host buffers allocated (and pinned) afresh."""
        if self._stager is not None and not reusable_stager():
            self._stager.close()  # staged and written: wait() above joined its save
            self._stager = None
        if self._stager is None:
            cuda = _holds_cuda_tensors(state_dict)
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,  # the writer is a thread of this process
                    use_async_staging=False,
                    use_non_blocking_copy=cuda,
                )
            )
        return self._stager

    def _save_failed(
        self,
        exc: BaseException,
        step: int,
        staging: Path,
        needed: int,
        *,
        staging_only: bool = False,
    ) -> CheckpointError:
        """The CheckpointError for a failed save (``exc`` itself if it is one; ``staging_only``:
        async, the copy to CPU memory failed). A full disk gets its own message, and rank 0 removes
        the staging folder first: it holds a partial save and the space is needed."""
        if isinstance(exc, CheckpointError):
            return exc
        if not _is_disk_full(exc, directory=self.directory, needed=needed):
            if staging_only:
                return CheckpointError(f"cannot stage step {step} for saving: {_describe(exc)}")
            return CheckpointError(f"cannot save step {step} to {staging}: {_describe(exc)}")
        if self.rank == 0:
            _remove_tree(staging)
        free = _free_bytes(self.directory)
        on_rank = f" for rank {self.rank}'s part" if self.world_size > 1 else ""
        return CheckpointError(
            f"no space left on device: cannot save step {step} to {staging} (removed): it needs "
            f"about {_amount(needed)}{on_rank}, {_amount(free)} are free there; the previous "
            f"checkpoints are kept. Free some space or set checkpoint.dir to a filesystem with "
            f"room"
        )

    def _after_upload(
        self,
        upload: Future,
        step: int,
        staging: Path,
        *,
        meta: dict[str, Any],
        started: float,
        needed: int,
    ) -> Future[None]:
        """A future that completes once ``upload`` has and, on rank 0, the commit too."""
        done: Future[None] = Future()

        def finish(_: Future) -> None:
            # Runs in DCP's writer thread. Errors are logged now (the loop may not look for a
            # while) and kept for the next save() / wait() to raise.
            try:
                try:
                    metadata = upload.result()
                    if self.rank == 0:
                        self._commit(step, staging, metadata, meta=meta, started=started)
                except (Exception, CheckpointException) as exc:
                    failure = self._save_failed(exc, step, staging, needed)
                    if failure is exc:
                        raise
                    raise failure from exc
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
        # The checksums cost one sequential read of the whole checkpoint by rank 0 (from the page
        # cache for the shards this node just wrote, over the network for other nodes' shards on
        # a shared filesystem); an async save pays it in the background thread.
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": self.world_size,
            "created": time.time(),
            "meta": meta,
            "files": [
                {"name": name, "bytes": size, "crc32": _crc32(staging / name)}
                for name, size in sorted(files.items())
            ],
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
        """Delete checkpoints beyond keep_last (oldest first, never the one just committed), this
        run's staging folders of crashed earlier saves and interrupted deletions. Other runs'
        staging folders are never touched: one may be a save in progress."""
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
            if path.is_dir() and _is_stale(path.name, oldest_kept=oldest_kept, token=self._token):
                logger.info("deleting old checkpoint folder %s", path)
                _remove_tree(path)

    # ------------------------------------------------------------------ listing and resuming

    def checkpoints(self) -> list[Checkpoint]:
        """Committed, valid checkpoints, oldest first; invalid ones are skipped with a warning.
        Checks manifests and sizes only (cheap); ``resolve_resume`` verifies what it picks."""
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
        """``checkpoint.resume`` to a checkpoint: ``none`` -> None, ``auto`` -> the newest one that
        passes verification (sizes, checksums, DCP metadata; None if there is none), anything else
        a path (``find_checkpoint``, where a failed verification is a ConfigError).

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
            for _step, path in sorted(_step_dirs(self.directory), reverse=True):
                try:
                    return read_checkpoint(path, verify=True)
                except CheckpointError as exc:
                    logger.warning(
                        "checkpoint.resume=auto: skipping checkpoint %s: %s; trying the previous "
                        "one",
                        path,
                        exc,
                    )
            return None
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
        """Wait for the pending save, then release the directory's lock and the process group this
        manager created."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()  # drops the host buffers (and unpins them)
                self._stager = None
            if self._lock is not None:
                self._lock.release()
            self._release_group()

    def _release_group(self) -> None:
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


# ---------------------------------------------------------------------- the directory's lock


class _FolderLock:
    """``checkpoint.lock`` in a checkpoint directory: JSON naming the run that saves into it (run
    id, host, pid, created). Rank 0 of that run creates it with O_CREAT|O_EXCL, which is atomic on
    local filesystems and NFSv3+ alike, so of two runs starting at once exactly one gets it.

    An existing lock is taken over when it names the same run id *and* the same torchrun launch
    (``TORCHELASTIC_RUN_ID``: torchrun restarted this run's workers; a new launch with the same
    run id, e.g. two started in the same second with the default time-based id, is not the same
    run), a process on this host that no longer exists (a crashed or preempted run; logged), or a
    manager of this process that was dropped without ``close`` (a notebook's earlier Trainer); any
    other holder, live or on another host (whose processes cannot be checked from here), refuses.

    A lock whose manager is garbage collected, or still held when the interpreter exits, is
    released then (``weakref.finalize``)."""

    def __init__(self, directory: Path, run_id: str) -> None:
        self.path = directory / LOCK
        self.run_id = run_id
        # The torchrun launch (its rendezvous id: a fresh uuid under --standalone, the job's id
        # when a scheduler passes --rdzv-id); None in a plain single process.
        self.launch = os.environ.get("TORCHELASTIC_RUN_ID")
        self.token = uuid.uuid4().hex  # tells this acquisition's file from a later taker's
        self.held = False
        self._release: weakref.finalize | None = None  # deletes the file; set once acquired

    def acquire(self) -> None:
        for _attempt in range(10):
            content = {
                "run_id": self.run_id,
                "launch": self.launch,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "created": time.time(),
                "token": self.token,
            }
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                raw = self._read()
                if raw is None:  # released meanwhile
                    continue
                holder = _parse_lock(raw)
                why = self._replaceable(holder)
                if why is None:
                    raise ConfigError(self._refusal(holder, raw)) from None
                if self._remove_if_unchanged(raw):
                    # A restart of this run is routine; replacing a crashed run's lock is news.
                    same_run = (
                        holder["run_id"] == self.run_id and holder.get("launch") == self.launch
                    )
                    log = logger.info if same_run else logger.warning
                    log("checkpoint lock %s: taking it over, %s", self.path, why)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(content, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(self.path.parent)
            self.held = True
            _HELD_HERE[self.token] = self
            self._release = weakref.finalize(self, _release_lock_file, self.path, self.token)
            return
        raise ConfigError(
            f"could not take the checkpoint lock {self.path}: it kept changing hands (several runs "
            f"starting with checkpoint.dir={self.path.parent} at once?)"
        )

    def release(self) -> None:
        """Delete the lock file if it is still this acquisition's (a restarted worker of the same
        run may have taken it over since)."""
        if self._release is not None:
            self._release()  # once: a finalize object runs at most once
        self.held = False

    def _read(self) -> str | None:
        """The lock's text, None if there is no lock. A holder writes its JSON right after
        creating the file: an empty or partial text is read again for a moment."""
        text = ""
        for _ in range(20):
            try:
                text = self.path.read_text()
            except FileNotFoundError:
                return None
            except OSError as exc:
                return f"<unreadable: {exc}>"
            if _parse_lock(text):
                return text
            time.sleep(0.1)
        return text

    def _replaceable(self, holder: dict[str, Any]) -> str | None:
        """Why the lock of ``holder`` may be taken over; None if it may not."""
        if not holder:
            return None  # unreadable: a person must decide
        same_launch = self.launch is not None and holder.get("launch") == self.launch
        if holder["run_id"] == self.run_id and same_launch:
            return f"it is held by the same run {self.run_id!r} (restarted workers)"
        if holder["host"] != socket.gethostname():
            return None
        if holder["pid"] == os.getpid():
            gc.collect()  # a dropped manager in a reference cycle releases its lock now
            here = _HELD_HERE.get(holder["token"])
            if here is None or not here.held:
                return (
                    f"its holder, run {holder['run_id']!r} of this process, was dropped without "
                    f"close()"
                )
        elif not _pid_alive(holder["pid"]):
            return (
                f"its holder, run {holder['run_id']!r} (pid {holder['pid']} on this host), no "
                f"longer exists"
            )
        return None

    def _remove_if_unchanged(self, raw: str) -> bool:
        """Remove the lock file if it still holds ``raw``. Renamed aside first, so that of several
        runs replacing the same stale lock only one removes it; a lock that changed in between is
        put back (unless yet another run created one meanwhile: three runs starting in the same
        instant over a stale lock)."""
        aside = self.path.with_name(f".{LOCK}.{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        if aside.read_text() == raw:
            aside.unlink()
            return True
        try:
            os.link(aside, self.path)
        except FileExistsError:
            pass
        aside.unlink()
        return False

    def _refusal(self, holder: dict[str, Any], raw: str) -> str:
        where = f"checkpoint.dir={self.path.parent}"
        if not holder:
            return (
                f"{where} is locked by an unreadable lock file {self.path} ({raw[:200]!r}); if no "
                f"run is saving into that folder, delete {self.path} and start again"
            )
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["created"]))
        if holder["host"] != socket.gethostname():
            state = "a process on another host"
        elif holder["pid"] == os.getpid():
            state = "this process: close() its Trainer or Checkpointer first"
        else:
            state = "a live process on this host"
        return (
            f"{where} is in use by run {holder['run_id']!r} (host {holder['host']}, pid "
            f"{holder['pid']}, {state}, since {since}; lock file {self.path}). Two runs must "
            f"not save into one checkpoint folder: wait for that run to finish, give this run "
            f"another checkpoint.dir, or, if that run is gone, delete {self.path} and start again"
        )


# The locks this process holds, by token: a lock file naming this process whose token is not here
# belongs to a manager that was dropped without close().
_HELD_HERE: weakref.WeakValueDictionary[str, _FolderLock] = weakref.WeakValueDictionary()


def _release_lock_file(path: Path, token: str) -> None:
    """Delete the lock file at ``path`` if it still holds ``token``. Also runs at interpreter exit
    (from weakref.finalize), so it does not rely on logging."""
    try:
        if _parse_lock(path.read_text()).get("token") == token:
            os.unlink(path)
    except OSError:
        pass


def _parse_lock(text: str) -> dict[str, Any]:
    """The holder a lock file names, or {} when it is not a valid lock."""
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    kinds: dict[str, type | tuple[type, ...]] = {
        "run_id": str,
        "host": str,
        "pid": int,
        "created": (int, float),
        "token": str,
    }
    if not isinstance(holder, dict) or not all(
        isinstance(holder.get(key), kind) for key, kind in kinds.items()
    ):
        return {}
    return holder


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _run_token(run_id: str) -> str:
    """A file-name-safe token of ``run_id`` for staging folder names: readable, and unique through
    a short hash of the exact id."""
    readable = re.sub(r"[^A-Za-z0-9_-]+", "-", run_id).strip("-")[:40]
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    return f"{readable}-{digest}" if readable else digest


# ---------------------------------------------------------------------- validation


def read_checkpoint(path: str | Path, *, verify: bool = False) -> Checkpoint:
    """The checkpoint in ``path`` if its manifest is valid and every listed file is a regular file
    in the folder with the listed size; else CheckpointError saying why.

    ``verify``: also read every file to check its checksum (format 2 manifests), and check that
    DCP's ``.metadata`` is readable and points only to files the manifest lists. This reads the
    whole checkpoint once: done when a checkpoint is picked for loading, not when listing."""
    path = Path(path)
    manifest = _read_manifest(path)
    name_step = _STEP_DIR.match(path.name)
    if name_step and int(name_step[1]) != manifest["step"]:
        raise CheckpointError(
            f"the folder name says step {int(name_step[1])}, {MANIFEST} says "
            f"step {manifest['step']}"
        )
    listed = _check_files(path, manifest["files"], checksums=manifest["format_version"] >= 2)
    if verify:
        for name in sorted(listed, key=lambda n: n != DCP_METADATA):  # .metadata first: small
            expected = listed[name].get("crc32")
            if expected is not None and (actual := _crc32(path / name)) != expected:
                raise CheckpointError(
                    f"{name} does not match its checksum (crc32 {actual:08x}, {MANIFEST} says "
                    f"{expected:08x}): corrupted after it was written"
                )
        _check_storage_paths(_read_dcp_metadata(path), set(listed))
    return Checkpoint(
        path=path, step=manifest["step"], world_size=manifest["world_size"], meta=manifest["meta"]
    )


def find_checkpoint(value: str | Path, *, key: str) -> Checkpoint:
    """The checkpoint a user named by path (``key`` says where: checkpoint.resume, export's
    checkpoint=), for resume and export alike, verified (``read_checkpoint(verify=True)``): a
    step_* folder must pass; a checkpoint directory stands for its newest checkpoint that passes,
    failing ones skipped with the reason."""
    path = Path(value).expanduser().resolve()
    if not path.exists():
        raise ConfigError(f"{key}={str(value)!r}: {path} does not exist")
    steps = sorted(_step_dirs(path), reverse=True)
    if steps and not (path / MANIFEST).exists():
        reasons = []
        for _, candidate in steps:
            try:
                checkpoint = read_checkpoint(candidate, verify=True)
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
        return read_checkpoint(path, verify=True)
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
        with _open_inside(path, MANIFEST) as f:
            manifest = json.loads(f.read())
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
    if manifest["format_version"] not in _READABLE_FORMATS:
        raise CheckpointError(
            f"{MANIFEST} has format version {manifest['format_version']}, "
            f"this version reads {', '.join(map(str, _READABLE_FORMATS))}"
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


def _check_files(path: Path, files: list[Any], *, checksums: bool) -> dict[str, dict[str, Any]]:
    """{name: entry} of the manifest's files, each checked to be a regular file (not a symbolic
    link) directly in ``path`` with the listed size."""
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
        if info.st_size != entry["bytes"]:
            raise CheckpointError(
                f"{name} is {info.st_size} bytes, {MANIFEST} says {entry['bytes']} (truncated or "
                f"overwritten)"
            )
    return listed


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


def _crc32(path: Path) -> int:
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
def _open_inside(folder: Path, name: str) -> Iterator[io.BufferedReader]:
    """``folder/name`` opened for reading if it is a regular file there: never through a symbolic
    link (O_NOFOLLOW), never outside ``folder``, never blocking on a FIFO (O_NONBLOCK, which
    regular files ignore)."""
    if not _is_file_name(name):
        raise CheckpointError(f"refusing to read {name!r}: not a file name inside {folder}")
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


class _ContainedFileSystem(FileSystem):
    """DCP's local filesystem for reading one checkpoint: it opens only regular files directly
    inside the checkpoint folder, never through a symbolic link, and writes nothing."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        path = Path(path)
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

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _ContainedFileSystem(Path(self.path))

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self.fs = _ContainedFileSystem(Path(self.path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata: only written without collectives
            raise CheckpointError(f"{self.path} has no {DCP_METADATA}")
        metadata = _read_dcp_metadata(Path(self.path))
        assert metadata.storage_meta is not None  # _read_dcp_metadata fills it in
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        # Every rank, with the metadata its reads will follow: the files it names are checked
        # against the manifest before DCP opens any of them.
        manifest = _read_manifest(Path(self.path))
        listed: set[str] = {
            e["name"]
            for e in manifest["files"]
            if isinstance(e, dict) and _is_file_name(e.get("name"))
        }
        _check_storage_paths(metadata, listed)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


def _read_dcp_metadata(path: Path) -> Metadata:
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


# ---------------------------------------------------------------------- writing and a full disk


class _StagingWriter(FileSystemWriter):
    """FileSystemWriter whose disk-full failures keep their errno on the way to rank 0. DCP
    gathers each rank's exception pickled, which drops its chain; and torch's zip writer reports
    a failed write of a tensor as "RuntimeError: ... unexpected pos", the OSError (ENOSPC) only
    in its ``__context__``. So a full disk is re-raised here as the OSError itself."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        try:
            return super().write_data(plan, planner)
        except Exception as exc:
            if (full := _hidden_disk_full(exc, self.path)) is None:
                raise
            raise full from exc

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            super().finish(metadata, results)
        except Exception as exc:
            if (full := _hidden_disk_full(exc, self.path)) is None:
                raise
            raise full from exc
        # torch 2.11's FileSystemWriter.finish records where each item's bytes are on a copy of the
        # metadata (the one it writes), so the metadata dcp.save returns, which the commit reads,
        # has none; later torch records it on the metadata itself. The same map, either way.
        if metadata.storage_data is None:
            metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}


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


def _is_disk_full(exc: BaseException, *, directory: Path, needed: int) -> bool:
    """Whether a save failed for lack of space: an ENOSPC/EDQUOT anywhere in the failure, or torch's
    zip writer's "unexpected pos" (a lost write, its OSError gone) while the filesystem has less
    room left than the save needs."""
    chain = list(_exception_chain(exc))
    if any(isinstance(e, OSError) and e.errno in _DISK_FULL for e in chain):
        return True
    short_write = any("unexpected pos" in str(e) for e in chain if isinstance(e, RuntimeError))
    return short_write and _free_bytes(directory) < needed


def _free_bytes(directory: Path) -> int:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


def _state_nbytes(obj: Any) -> int:
    """Bytes of the tensors in a state dict (this rank's part of sharded ones): what a save
    writes, give or take headers and the small non-tensor entries."""
    if isinstance(obj, DTensor):
        return _state_nbytes(obj.to_local())
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_nbytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_nbytes(value) for value in obj)
    return 0


def _holds_cuda_tensors(obj: Any) -> bool:
    """Whether a state dict holds a tensor (or a DTensor's local shard) on a CUDA device."""
    if isinstance(obj, DTensor):
        return _holds_cuda_tensors(obj.to_local())
    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, dict):
        return any(_holds_cuda_tensors(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_cuda_tensors(value) for value in obj)
    return False


def _amount(n: int) -> str:
    """``n`` bytes for a message: "512 bytes", "1.5 GiB (1610612736 bytes)"."""
    if n < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit} ({n} bytes)"


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


def _is_stale(name: str, *, oldest_kept: int, token: str) -> bool:
    if m := _STEP_DIR.match(name):
        return int(m[1]) < oldest_kept
    if m := _STAGING_DIR.match(name):
        # This run's: a crashed earlier save (one save is in flight at a time, and the current one
        # is committed by now). Another run's may be a save in progress: never ours to delete.
        return m[2] == token
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
