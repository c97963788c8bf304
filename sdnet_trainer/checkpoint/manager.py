"""Checkpoints: torch.distributed.checkpoint (DCP) shards in one folder per step, committed
atomically.

Layout of the checkpoint directory::

    step_00000042/           a committed checkpoint: DCP's .metadata and __<rank>_<n>.distcp shards,
        manifest.json        plus this file, written last, listing every file, its size and crc32
    .staging_step_00000043.<run>/  a save in progress of run <run> (or the leftover of a crashed
                             one); never listed, only ever deleted by the run that named it
    .trash_*                 a checkpoint being deleted or replaced; never listed
    checkpoint.lock          which run saves into this directory (held from setup to close)

Every rank writes its own shard into the staging folder and computes each file's crc32 from the
bytes on their way to it (``disk.StagingWriter``). DCP's save ends with a gather of all ranks'
write results on rank 0, which carry those checksums, and rank 0 then writes ``.metadata``; so once
``dcp.save`` returns on rank 0, every shard is on disk (fsynced: ``sync_files=True``) and its
checksum is known there. Rank 0 then commits alone, reading no shard: it writes the manifest from
the gathered sizes and checksums, renames the staging folder to its final name (atomic on POSIX)
and fsyncs the parent directory. A checkpoint is therefore visible only once complete, and a crash
at any point leaves the previous ones intact. The commit is a few metadata operations, so the other
ranks, already in the next step, never wait on it for long (a rank 0 that read a 0.6 TB checkpoint
back would outlast ``dist.step_timeout_s``).

Pruning deletes old checkpoints only after a newer one is committed, and off the save's path:
rank 0 renames each out of sight at the commit, and a background thread deletes the files
(``close`` waits for it). Resuming verifies the picked checkpoint's checksums with every rank
reading a share of its files (``resolve_resume``), not rank 0 reading them all.

A checkpoint directory belongs to one run at a time: the manager of a training run takes the lock
file on rank 0 when it is set up and renews it before each save and commit (``lock.FolderLock``:
a run whose lock was taken over writes nothing more) and releases it on ``close``.

An async save blocks the loop only while the state is copied into host memory; DCP then writes
that copy from a background thread and rank 0 commits when it is done. Only what this rank writes
is copied: DCP writes a tensor held by several ranks (DDP's replicated model and optimizer state)
once, so the ranks first agree, by DCP's own dedup rule, which of them writes each one
(``host_copy.written_here``). One storage writer and one DCP stager (``DefaultStager``) serve
every save of a manager: the stager keeps the host copy of each tensor's storage from one save to
the next (pinned memory when the state is on CUDA), so only the first save allocates it; later
ones copy into it. An async run therefore holds one extra copy of its share of the state (under
DDP about 1/world_size of it) in host memory for as long as the manager lives (released by
``close``).

Loading goes through DCP as well, which reshards to the current world size. A checkpoint is
untrusted input: every read of one (listing, resuming, export, the load itself) goes through
``untrusted``, whose docstring says what a hostile checkpoint can and cannot do.

In an object store (``checkpoint.dir=s3://...``: ``objects``), where there is no rename, each
save is written straight under ``step_<n>/`` and the manifest's one PUT, last, is the commit; a
step is deleted manifest first. The staging, checksums, pruning, lock and verified reads above
hold there as well.

The parts: ``files`` (names in the folder, atomic and durable file steps), ``lock`` (the folder's
lock), ``group`` (the ranks' process group), ``disk`` (writing, checksums, a full disk),
``host_copy`` (an async save's host copy), ``verify`` (checksums checked by every rank),
``untrusted`` (reading); this module, the protocol over them.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from sdnet_trainer.checkpoint import disk, files, host_copy, verify
from sdnet_trainer.checkpoint.files import Folder
from sdnet_trainer.checkpoint.group import CheckpointGroup, sendable, single_process_quiet
from sdnet_trainer.checkpoint.lock import FolderLock, run_token
from sdnet_trainer.checkpoint.objects import ObjectFolder
from sdnet_trainer.checkpoint.untrusted import (
    Checkpoint,
    CheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    Uncommitted,
    find_checkpoint,
    read_checkpoint,
)

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Owns one checkpoint directory. Every rank constructs one and calls ``save``, ``load`` and
    ``resolve_resume`` collectively (same order on every rank); only rank 0 commits and deletes.

    ``run_id``: the id of the run that saves into the directory (identical on every rank and across
    torchrun's restarts of the same run). The directory is then this run's until ``close``: rank 0
    takes its lock file, and a directory held by another live run is a ConfigError on every rank.
    None: no lock (loading only, as export does); saves then stage under a random name.

    ``directory``: a local folder, or an object store's URL (opened with ``storage_options``)."""

    def __init__(
        self,
        directory: str | Folder,
        *,
        keep_last: int,
        async_save: bool,
        rank: int,
        world_size: int,
        process_group: dist.ProcessGroup | None = None,
        run_id: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        assert keep_last >= 1, "checkpoint.keep_last is checked before launch"
        self.directory = files.folder_of(directory, storage_options)
        self.keep_last = keep_last
        self.storage_options = storage_options
        self.async_save = async_save
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self._ranks = CheckpointGroup(process_group, rank=rank, world_size=world_size)
        self._pending: Future[None] | None = None
        # One writer for every save (each save points it at its staging folder) and, for async
        # saves, one stager whose host buffers are reused; created at the first async save, when
        # it is known whether the state lives on CUDA (pinned buffers) or not.
        self._writer = disk.StagingWriter(self.directory, sync_files=True)
        self._stager: DefaultStager | None = None
        # Rank 0 deletes pruned folders in this thread, off the save's path (see _prune).
        self._deleter: ThreadPoolExecutor | None = None
        self._lock = FolderLock(self.directory, run_id) if run_id is not None else None
        # Rank 0 takes the lock and names the staging folders; every rank follows its outcome.
        outcome: str | Exception | None = None
        if rank == 0:
            try:
                files.make_directory(self.directory)
                if self._lock is not None:
                    self._lock.acquire()
                outcome = run_token(run_id) if run_id is not None else uuid.uuid4().hex[:12]
            except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
                outcome = exc
        outcome = self._ranks.from_rank0(outcome)
        if isinstance(outcome, Exception):
            self._ranks.release()
            raise outcome
        assert isinstance(outcome, str)
        self._token = outcome
        if rank != 0:
            # Rank 0 made it; on a filesystem that other nodes do not share (unsupported: their
            # shards would be out of rank 0's reach), each node needs its own.
            files.make_directory(self.directory)

    def staging_dir(self, step: int) -> Folder:
        """The folder this manager writes the save of ``step`` into before committing it (in an
        object store, the step's own prefix: there is no rename)."""
        if isinstance(self.directory, ObjectFolder):
            return self.directory / files.step_name(step)
        return self.directory / f"{files.STAGING_PREFIX}{files.step_name(step)}.{self._token}"

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
        folder is removed; the previous checkpoints stay. A lost lock: ``LeaseLost``, no write."""
        self.wait()  # one save in flight; surfaces the previous async save's error
        if self._lock is not None:
            self._lock.fence_every_rank(self.rank, self._ranks.from_rank0)
        meta = _json_round_trip(meta or {})
        staging = self.staging_dir(step)
        if self.async_save:
            # Only what this rank writes is copied to host memory (and kept there for the run).
            state_dict = host_copy.written_here(
                state_dict, ranks=self._ranks, rank=self.rank, world_size=self.world_size
            )
        needed = disk.state_nbytes(state_dict)
        if self.rank == 0:
            # Leftover of a crashed save of this same step by this run (in a store: any objects
            # under the step's prefix, manifest first). Safe before the collective: other ranks
            # write their shards only after rank 0 has joined the save and re-created the folder.
            if isinstance(staging, ObjectFolder) and files.MANIFEST in staging.listing()[0]:
                logger.warning(
                    "checkpoint step %d is saved again: the committed %s is deleted first (a "
                    "store has no rename to replace it at the commit)",
                    step,
                    staging,
                )
            files.remove_tree(staging)
        started = time.monotonic()
        try:
            with single_process_quiet():
                if self.async_save:
                    self._stager = host_copy.stager_for(self._stager, state_dict)
                    # async_save copies every tensor into the stager's host buffers before it
                    # returns, then writes from that copy in DCP's writer thread. The buffers are
                    # free again: wait() above joined the previous save, the last one to read them.
                    response = dcp.async_save(
                        state_dict,
                        checkpoint_id=staging,  # type: ignore[arg-type]  # the writer takes it
                        storage_writer=self._writer,
                        async_stager=self._stager,
                        process_group=self._ranks.group,
                        no_dist=self._ranks.no_dist,
                    )
                else:
                    response = dcp.save(
                        state_dict,
                        checkpoint_id=staging,
                        storage_writer=self._writer,
                        process_group=self._ranks.group,
                        no_dist=self._ranks.no_dist,
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

    def _save_failed(
        self,
        exc: BaseException,
        step: int,
        staging: Folder,
        needed: int,
        *,
        staging_only: bool = False,
    ) -> CheckpointError:
        """The CheckpointError for a failed save (``exc`` itself if it is one; ``staging_only``:
        async, the copy to CPU memory failed). A full disk gets its own message, and rank 0 removes
        the staging folder first: it holds a partial save and the space is needed."""
        if isinstance(exc, CheckpointError):
            return exc
        if not disk.is_disk_full(exc, directory=self.directory, needed=needed):
            why = disk.describe_failure(exc)
            if staging_only:
                return CheckpointError(f"cannot stage step {step} for saving: {why}")
            return CheckpointError(f"cannot save step {step} to {staging}: {why}")
        if self.rank == 0:
            files.remove_tree(staging)
        free = disk.amount(disk.free_bytes(self.directory))
        on_rank = f" for rank {self.rank}'s part" if self.world_size > 1 else ""
        return CheckpointError(
            f"no space left on device: cannot save step {step} to {staging} (removed): it needs "
            f"about {disk.amount(needed)}{on_rank}, {free} are free there; the previous "
            f"checkpoints are kept. Free some space or set checkpoint.dir to a filesystem with "
            f"room"
        )

    def _after_upload(
        self,
        upload: Future,
        step: int,
        staging: Folder,
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
        self,
        step: int,
        staging: Folder,
        metadata: Metadata,
        *,
        meta: dict[str, Any],
        started: float,
    ) -> Checkpoint:
        """Rank 0, after DCP's save returned: the lease renewed (a save that outlived the
        lock is never committed), manifest, atomic rename (``files.commit``), pruning."""
        if self._lock is not None:
            self._lock.fence()
        written = disk.written_files(staging, metadata)
        checksums = disk.recorded_checksums(staging, written, self._writer.file_checksums)
        manifest = {
            "format_version": files.FORMAT_VERSION,
            "step": step,
            "world_size": self.world_size,
            "created": time.time(),
            "meta": meta,
            "files": [
                {"name": name, "bytes": size, "crc32": checksums[name]}
                for name, size in sorted(written.items())
            ],
        }
        final = self.directory / files.step_name(step)
        files.commit(staging, final, manifest)
        logger.info(
            "checkpoint step %d saved to %s (%.1f MB, %.2f s)",
            step,
            final,
            sum(written.values()) / 2**20,
            time.monotonic() - started,
        )
        try:
            self._prune(committed=step)
        except Exception as exc:  # noqa: BLE001 - the step is committed: pruning waits for the next
            logger.warning("checkpoint step %d saved, but pruning failed: %s", step, exc)
        return Checkpoint(path=final, step=step, world_size=self.world_size, meta=meta)

    def _prune(self, *, committed: int) -> None:
        """Delete checkpoints beyond keep_last (oldest first, never the one just committed), this
        run's staging folders of crashed earlier saves and interrupted deletions. Other runs'
        staging folders are never touched: one may be a save in progress.

        Off the save's path: each folder is renamed aside here (one rename: no listing sees it half
        deleted, and no later save of the same step meets it), and its files are deleted by one
        background thread of rank 0 (``_deleter``; ``close`` waits for it). Deleting a large
        checkpoint on a network filesystem takes minutes, which a sync save would otherwise add to
        rank 0's step while the other ranks wait in the next collective."""
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
        for path in files.subfolders(self.directory):
            if files.is_stale(path.name, oldest_kept=oldest_kept, token=self._token):
                logger.info("deleting old checkpoint folder %s", path)
                self._delete_in_background(path)

    def _delete_in_background(self, path: Folder) -> None:
        aside = files.move_aside(path)
        if aside is None:
            return
        if self._deleter is None:
            self._deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-prune")
        self._deleter.submit(files.remove_tree, aside)

    # ------------------------------------------------------------------ listing and resuming

    def checkpoints(self) -> list[Checkpoint]:
        """Committed, valid checkpoints, oldest first; invalid ones are skipped with a warning.
        Checks manifests and sizes only (cheap); ``resolve_resume`` verifies what it picks.
        In an object store a step without its manifest is routine (a step being deleted, a save
        cut short that the next save or pruning removes): skipped without a warning."""
        found = []
        for _step, path in sorted(files.step_dirs(self.directory)):
            try:
                found.append(read_checkpoint(path))
            except CheckpointError as exc:
                routine = isinstance(exc, Uncommitted) and isinstance(path, ObjectFolder)
                (logger.debug if routine else logger.warning)(
                    "skipping checkpoint %s: %s", path, exc
                )
        return found

    def latest(self) -> Checkpoint | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def resolve_resume(self, resume: str) -> Checkpoint | None:
        """``checkpoint.resume`` to a checkpoint: ``none`` -> None, ``auto`` -> the newest one that
        passes verification (sizes, checksums, DCP metadata; None if there is none), anything else
        a path (``find_checkpoint``, where a failed verification is a ConfigError).

        Collective: rank 0 decides and the other ranks follow, so all of them load the same one.
        The checksums of each checkpoint rank 0 considers are read by all ranks, each file by one
        of them (``verify``): the other ranks serve those requests until rank 0 sends its
        decision."""
        self.wait()  # the broadcasts below share the group with a background save
        if self.rank == 0:
            outcome: Checkpoint | Exception | None
            try:
                outcome = self._resolve(resume)
            except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
                outcome = exc
            self._ranks.from_rank0(verify.Decided(sendable(outcome)))
        else:
            outcome = verify.follow_rank0(self._ranks, self.rank)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _shared_checksums(self, folder: Folder, expected: dict[str, tuple[int, int]]) -> None:
        """Rank 0, while resolving: the checksums of ``folder``'s files checked by every rank,
        the files divided by size; a CheckpointError naming the first file that fails."""
        verify.check_on_every_rank(self._ranks, folder, expected, self.world_size)

    def _resolve(self, resume: str) -> Checkpoint | None:
        if resume == "none":
            return None
        if resume == "auto":
            for _step, path in sorted(files.step_dirs(self.directory), reverse=True):
                try:
                    return read_checkpoint(path, verify=True, checksums=self._shared_checksums)
                except CheckpointError as exc:
                    logger.warning(
                        "checkpoint.resume=auto: skipping checkpoint %s: %s; trying the previous "
                        "one",
                        path,
                        exc,
                    )
            return None
        return find_checkpoint(
            resume,
            key="checkpoint.resume",
            checksums=self._shared_checksums,
            storage_options=self.storage_options,
        )

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
            with single_process_quiet():
                dcp.load(
                    request,
                    storage_reader=SafeFileSystemReader(checkpoint.path),
                    planner=SafeLoadPlanner(),
                    process_group=self._ranks.group,
                    no_dist=self._ranks.no_dist,
                )
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(
                f"cannot load checkpoint {checkpoint.path}: {disk.describe_failure(exc)}"
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
            if self._deleter is not None:
                self._deleter.shutdown(wait=True)  # the pruned folders' deletions finish
                self._deleter = None
            if self._lock is not None:
                self._lock.release()
            self._ranks.release()


def _json_round_trip(meta: dict[str, Any]) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint meta must be JSON data: {exc}") from None
