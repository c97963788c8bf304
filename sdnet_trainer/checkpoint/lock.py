"""The lock of a checkpoint directory: ``checkpoint.lock``, which names the one run that saves
into the directory (see ``FolderLock``), and the run's token that names its staging folders.

The lock is a file in a local folder (``_LockFile``) or an object under a store's prefix
(``_LockObject``); ``FolderLock`` decides who holds it the same way for both.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdnet_trainer.checkpoint.files import Folder, fsync_dir, invalid_field
from sdnet_trainer.checkpoint.objects import ObjectFolder
from sdnet_trainer.checkpoint.untrusted import CheckpointError
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

LOCK = "checkpoint.lock"
_LOCK_FIELDS: dict[str, type | tuple[type, ...]] = {
    "run_id": str,
    "host": str,
    "pid": int,
    "created": (int, float),
    "token": str,
}


class _LockFile:
    """The lock as a file: created with O_CREAT|O_EXCL, which is atomic on local filesystems and
    NFSv3+ alike. Not a lease (its holder's process can be checked): ``renew`` only reads it."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK

    def create(self, text: str) -> bool:
        """Create the lock holding ``text`` if there is none; False if there is one."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.path.parent)
        return True

    def renew(self, holder: dict[str, Any]) -> dict[str, Any] | None:
        """None while the file still names ``holder``'s token; else the holder it names now ({}
        when there is none)."""
        now = _parse_lock(self.read() or "")
        return None if now.get("token") == holder["token"] else now

    def read(self) -> str | None:
        """The lock's text; None if there is no lock (an OSError if it cannot be read)."""
        try:
            return self.path.read_text()
        except FileNotFoundError:
            return None

    def remove_if_unchanged(self, raw: str, token: str) -> bool:
        """Remove the lock file if it still holds ``raw``. Renamed aside first, so that of several
        runs replacing the same stale lock only one removes it; a lock that changed in between is
        put back (unless yet another run created one meanwhile: three runs starting in the same
        instant over a stale lock)."""
        aside = self.path.with_name(f".{LOCK}.{token}")
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

    def remove(self) -> None:
        os.unlink(self.path)


# A lock object is a lease: its holder writes it again every LEASE_RENEW_S; one not renewed for
# LEASE_EXPIRES_S (ten renewals missed: the holder's node is gone, as a preempted cloud node is,
# whose processes no other host can check) may be taken over. The margin also covers clocks that
# differ between hosts.
LEASE_RENEW_S = 60.0
LEASE_EXPIRES_S = 600.0


class _LockObject:
    """The lock as an object: created with a conditional PUT (``If-None-Match``), which S3, GCS
    and Azure make atomic, so of two runs starting at once exactly one gets it. A store has no
    rename: a stale lock is removed after reading it again, which two runs replacing the same
    stale lock in the same instant could both do (the conditional create still lets one of them
    in). The holder renews it from a thread (``start_lease``) until it is removed.

    The lease is fenced: every renewal replaces the object only if it is still the version this
    holder last wrote (S3's ``If-Match`` on its ETag, ``ObjectFolder.replace``). A holder that
    stalled past the lease and wakes after another run took the lock over finds a version that is
    not its own: it cannot write the new holder's lock back, and learns that it lost."""

    def __init__(self, directory: ObjectFolder) -> None:
        self.directory = directory
        self.path = directory / LOCK
        self._stop = threading.Event()
        # The lease thread and the saves (``FolderLock.fence``) renew one at a time: each
        # conditional write is made over the version the previous one left.
        self._renewing = threading.Lock()
        self._version: str | None = None  # of the lock as this holder last wrote it

    def create(self, text: str) -> bool:
        """The conditional create, then the object read back: a store that ignored the condition
        (some S3-compatible ones do) shows another holder's text there."""
        if not self.directory.create(LOCK, text.encode()):
            return False
        current = self.directory.read_versioned(LOCK)
        if current is None or current[0] != text.encode():
            return False
        self._version = current[1]
        return True

    def renew(self, holder: dict[str, Any]) -> dict[str, Any] | None:
        """Write ``holder`` again with a fresh ``renewed`` time over the version this holder last
        wrote: None once written; the holder the lock names now ({} when there is none) when it
        is not this one's any more, with nothing written. An OSError when the store cannot be
        reached."""
        with self._renewing:
            for _attempt in range(2):
                assert self._version is not None, "renewed before it was created"
                holder["renewed"] = time.time()
                data = json.dumps(holder).encode()
                written = self.directory.replace(LOCK, data, version=self._version)
                if written is not None:
                    self._version = written
                    return None
                current = self.directory.read_versioned(LOCK)
                now = _parse_lock(current[0].decode(errors="replace")) if current else {}
                if current is None or now.get("token") != holder["token"]:
                    return now
                # Still this holder's: a write of its own whose answer was lost, which the store's
                # library sent again (and the condition then refused). Its version is this one's.
                self._version = current[1]
        raise OSError(f"the checkpoint lock {self.path} kept changing while it was renewed")

    def start_lease(self, holder: dict[str, Any]) -> None:
        """Renew ``holder``'s lease every LEASE_RENEW_S until it is released or lost. The thread
        holds nothing of the ``FolderLock`` (whose garbage collection releases the lock)."""

        def keep() -> None:
            while not self._stop.wait(LEASE_RENEW_S):
                try:
                    now = self.renew(holder)
                except OSError as exc:  # the store is unreachable for now: try again later
                    logger.warning("could not renew the checkpoint lock %s: %s", self.path, exc)
                    continue
                if now is not None:
                    if not self._stop.is_set():  # not released: taken over
                        logger.error("%s", lease_lost(self.path, holder, now))
                    return

        threading.Thread(target=keep, name="checkpoint-lock-lease", daemon=True).start()

    def read(self) -> str | None:
        data = self.directory.read_bytes(LOCK)
        return None if data is None else data.decode(errors="replace")

    def remove_if_unchanged(self, raw: str, token: str) -> bool:
        if self.read() != raw:
            return False
        self.directory.remove(LOCK)
        return True

    def stop_lease(self) -> None:
        self._stop.set()

    def remove(self) -> None:
        self.stop_lease()
        self.directory.remove(LOCK)


class LeaseLost(CheckpointError):
    """This run's checkpoint lock was taken over (or deleted): it must write nothing more into
    the checkpoint folder."""


def lease_lost(path: Folder, mine: dict[str, Any], now: dict[str, Any]) -> LeaseLost:
    """The error of the holder ``mine`` of the lock ``path``, which names ``now`` instead."""
    generation = _generation(mine)
    lost = f"run {mine['run_id']!r} lost the checkpoint lock {path} (generation {generation})"
    if now:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now["created"]))
        why = (
            f"run {now['run_id']!r} (host {now['host']}, pid {now['pid']}) has held it since "
            f"{since} as generation {_generation(now)}"
        )
    else:
        why = (
            "the lock is gone or unreadable (deleted by hand, or by a run that took it over and "
            "ended)"
        )
    return LeaseLost(
        f"{lost}: {why}. This run writes nothing more into checkpoint.dir={path.parent}: its "
        f"saves are refused; its committed steps there stay as they are"
    )


def _generation(holder: dict[str, Any]) -> int:
    """The holder's lease generation: 1 for a lock created on a free folder, one more on each
    takeover (0 for a lock written before generations were counted)."""
    generation = holder.get("generation", 0)
    return generation if isinstance(generation, int) else 0


class FolderLock:
    """``checkpoint.lock`` in a checkpoint directory: JSON naming the run that saves into it (run
    id, host, pid, created). Rank 0 of that run creates it only if there is none (``_LockFile``,
    ``_LockObject``), so of two runs starting at once exactly one gets it.

    An existing lock is taken over when it names the same run id *and* the same torchrun launch
    (``TORCHELASTIC_RUN_ID``: torchrun restarted this run's workers; a new launch with the same
    run id, e.g. two started in the same second with the default time-based id, is not the same
    run), a process on this host that no longer exists (a crashed or preempted run; logged), or a
    manager of this process that was dropped without ``close`` (a notebook's earlier Trainer), or,
    in an object store, a holder whose lease expired (``LEASE_EXPIRES_S``); any other holder,
    live or on another host (whose processes cannot be checked from here), refuses.

    A holder whose lock was taken over since must stop writing: ``fence`` (before each save and
    each commit) renews the lease over the version this holder last wrote, or raises
    ``LeaseLost`` naming the run that holds it now. Each lock counts its ``generation`` (one more
    on each takeover), so messages tell the holders apart even within one run.

    A lock whose manager is garbage collected, or still held when the interpreter exits, is
    released then (``weakref.finalize``)."""

    def __init__(self, directory: Folder, run_id: str) -> None:
        self.lock = (
            _LockObject(directory) if isinstance(directory, ObjectFolder) else _LockFile(directory)
        )
        self.path = self.lock.path
        self.run_id = run_id
        # The torchrun launch (its rendezvous id: a fresh uuid under --standalone, the job's id
        # when a scheduler passes --rdzv-id); None in a plain single process.
        self.launch = os.environ.get("TORCHELASTIC_RUN_ID")
        self.token = uuid.uuid4().hex  # tells this acquisition's file from a later taker's
        self.held = False
        self._holder: dict[str, Any] = {}  # what this acquisition wrote into the lock
        self._release: weakref.finalize | None = None  # deletes the file; set once acquired

    def acquire(self) -> None:
        generation = 1
        for _attempt in range(10):
            content = {
                "run_id": self.run_id,
                "launch": self.launch,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "created": time.time(),
                "token": self.token,
                "generation": generation,
            }
            if not self.lock.create(json.dumps(content)):
                raw = self._read()
                if raw is None:  # released meanwhile
                    continue
                holder = _parse_lock(raw)
                why = self._replaceable(holder)
                if why is None:
                    raise ConfigError(self._refusal(holder, raw)) from None
                if self.lock.remove_if_unchanged(raw, self.token):
                    generation = _generation(holder) + 1
                    # A restart of this run is routine; replacing a crashed run's lock is news.
                    same_run = (
                        holder["run_id"] == self.run_id and holder.get("launch") == self.launch
                    )
                    log = logger.info if same_run else logger.warning
                    log("checkpoint lock %s: taking it over, %s", self.path, why)
                continue
            self.held = True
            self._holder = content
            if isinstance(self.lock, _LockObject):
                self.lock.start_lease(content)
            _HELD_HERE[self.token] = self
            self._release = weakref.finalize(self, _release_lock, self.lock, self.token)
            return
        raise ConfigError(
            f"could not take the checkpoint lock {self.path}: it kept changing hands (several runs "
            f"starting with checkpoint.dir={self.path.parent} at once?)"
        )

    def fence(self) -> None:
        """Before this holder writes into the folder: renew its lease (a lock file is only read
        again), or raise ``LeaseLost`` if another run took the lock over, with nothing written.
        A renewal that cannot reach the store is a CheckpointError too: the save is refused, not
        made on a lease that may have passed to another run."""
        assert self.held or self._holder, "fence() before acquire()"
        try:
            now = self.lock.renew(self._holder)
        except OSError as exc:
            raise CheckpointError(
                f"cannot renew the checkpoint lock {self.path} before writing into "
                f"checkpoint.dir={self.path.parent}: {exc}"
            ) from exc
        if now is not None:
            raise lease_lost(self.path, self._holder, now)

    def fence_every_rank(self, rank: int, from_rank0: Callable[[Any], Any]) -> None:
        """:meth:`fence` before a save that every rank writes: rank 0 renews, and every rank
        raises its LeaseLost together (``from_rank0``: a broadcast of rank 0's object, a
        collective like the save itself), so none is left waiting in the save's collectives."""
        outcome: Exception | None = None
        if rank == 0:
            try:
                self.fence()
            except CheckpointError as exc:
                outcome = exc
        outcome = from_rank0(outcome)
        if outcome is not None:
            raise outcome

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
                read = self.lock.read()
            except OSError as exc:
                return f"<unreadable: {exc}>"
            if read is None:
                return None
            text = read
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
        renewed = holder.get("renewed", holder["created"])
        age = time.time() - renewed if isinstance(renewed, (int, float)) else 0.0
        if isinstance(self.lock, _LockObject) and age > LEASE_EXPIRES_S:
            return (
                f"its holder, run {holder['run_id']!r} on host {holder['host']}, has not "
                f"renewed its lease for {age:.0f} s"
            )
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
            if isinstance(self.lock, _LockObject):
                state += f", whose lease is taken over once not renewed for {LEASE_EXPIRES_S:g} s"
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
_HELD_HERE: weakref.WeakValueDictionary[str, FolderLock] = weakref.WeakValueDictionary()


def _release_lock(lock: _LockFile | _LockObject, token: str) -> None:
    """Delete the lock if it still holds ``token``. Also runs at interpreter exit (from
    weakref.finalize), so it does not rely on logging."""
    if isinstance(lock, _LockObject):
        lock.stop_lease()
    try:
        if _parse_lock(lock.read() or "").get("token") == token:
            lock.remove()
    except OSError:
        pass


def _parse_lock(text: str) -> dict[str, Any]:
    """The holder a lock file names, or {} when it is not a valid lock."""
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(holder, dict) or invalid_field(holder, _LOCK_FIELDS) is not None:
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


def run_token(run_id: str) -> str:
    """A file-name-safe token of ``run_id`` for staging folder names: readable, and unique through
    a short hash of the exact id."""
    readable = re.sub(r"[^A-Za-z0-9_-]+", "-", run_id).strip("-")[:40]
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    return f"{readable}-{digest}" if readable else digest
