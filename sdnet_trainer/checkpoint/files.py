"""The files of a checkpoint directory: their names, and the file-system steps the commit protocol
(``manager``) and the lock (``lock``) are built of, each durable or atomic where the protocol
needs it to be. A directory is a local folder (``Path``) or a prefix in an object store
(``objects.ObjectFolder``, where the same steps are made of objects: see ``objects``).

Names in the directory (``manager``'s docstring shows the layout): ``step_<8 digits>`` for a
committed checkpoint, ``.staging_step_<8 digits>.<run token>`` for a save in progress, ``.trash_*``
for a folder being deleted; inside a checkpoint, DCP's ``.metadata`` and the ``manifest.json``
written last.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeAlias

from sdnet_trainer.checkpoint.objects import ObjectFolder, is_url
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# 2: every file entry carries its crc32. Format 1 manifests (sizes only) still load.
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
DCP_METADATA = ".metadata"  # DCP's index of the checkpoint, written by rank 0 after every shard
STEP_DIR = re.compile(r"^step_(\d+)$")
STAGING_PREFIX = ".staging_"
_TRASH_PREFIX = ".trash_"
_STAGING_DIR = re.compile(r"^\.staging_step_(\d+)\.(.+)$")


# Where a checkpoint directory, or one checkpoint, is: a local folder or an object store's prefix.
Folder: TypeAlias = Path | ObjectFolder


def folder_of(value: str | Folder, storage_options: dict[str, Any] | None = None) -> Folder:
    """``checkpoint.dir`` (or any checkpoint location) as a Folder: a URL names an object store
    (opened with ``storage_options``), anything else a local path, made absolute; an
    ObjectFolder stays as it is."""
    if isinstance(value, ObjectFolder):
        return value
    if is_url(value):
        return ObjectFolder.of(str(value), storage_options)
    return Path(value).expanduser().absolute()


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_dirs(directory: Folder) -> Iterator[tuple[int, Folder]]:
    """The ``step_*`` folders (prefixes) in ``directory``, committed or not."""
    if isinstance(directory, ObjectFolder):
        for name in directory.listing()[1]:
            if m := STEP_DIR.match(name):
                yield int(m[1]), directory / name
        return
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if (m := STEP_DIR.match(path.name)) and path.is_dir():
            yield int(m[1]), path


def subfolders(directory: Folder) -> list[Folder]:
    """Every folder (prefix) directly in ``directory``: what pruning looks through."""
    if isinstance(directory, ObjectFolder):
        return [directory / name for name in directory.listing()[1]]
    return [path for path in sorted(directory.iterdir()) if path.is_dir()]


def invalid_field(record: dict[str, Any], kinds: dict[str, type | tuple[type, ...]]) -> str | None:
    """The first key of ``kinds`` that the JSON object ``record`` lacks or holds a value of another
    type under; None when every one is there with its type."""
    return next((key for key, kind in kinds.items() if not isinstance(record.get(key), kind)), None)


def commit(staging: Folder, final: Folder, manifest: dict[str, Any]) -> None:
    """Make the save in ``staging`` the checkpoint ``final`` by writing its manifest, last.
    A folder: the manifest written and fsynced, the folder renamed into place and the rename made
    durable. A prefix (where ``staging`` is ``final``: no rename in a store): the manifest's one
    PUT is the commit."""
    if isinstance(staging, ObjectFolder):
        assert staging == final, "an object store's save is written where it is committed"
        staging.write_bytes(MANIFEST, json.dumps(manifest, indent=2).encode())
        return
    assert isinstance(final, Path)
    write_json_atomic(staging / MANIFEST, manifest)
    replace_dir(staging, final)
    fsync_dir(final.parent)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    # Makes renames and new entries in the folder durable (POSIX: fsync on the directory).
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``. An existing ``dst`` (the same step saved again) is renamed aside
    first and deleted after: rename(2) cannot replace a non-empty folder."""
    if not dst.exists():
        os.rename(src, dst)
        return
    aside = _trash_path(dst)
    os.rename(dst, aside)
    os.rename(src, dst)
    fsync_dir(dst.parent)
    shutil.rmtree(aside, ignore_errors=True)


def is_stale(name: str, *, oldest_kept: int, token: str) -> bool:
    if m := STEP_DIR.match(name):
        return int(m[1]) < oldest_kept
    if m := _STAGING_DIR.match(name):
        # This run's: a crashed earlier save (one save is in flight at a time, and the current one
        # is committed by now). Another run's may be a save in progress: never ours to delete.
        return m[2] == token
    return name.startswith(_TRASH_PREFIX)  # an interrupted deletion


def remove_tree(path: Folder) -> None:
    """Delete a folder, best effort. A checkpoint is renamed aside first, so that it is never seen
    half deleted (e.g. shards gone, manifest still there); a prefix loses its manifest first."""
    if isinstance(path, ObjectFolder):
        try:
            path.remove_all(first=MANIFEST)
        except OSError as exc:
            logger.warning("could not delete %s: %s", path, exc)
        return
    try:
        if not path.exists():
            return
        if STEP_DIR.match(path.name):
            aside = _trash_path(path)
            os.rename(path, aside)
            path = aside
        shutil.rmtree(path)
    except OSError as exc:
        logger.warning("could not delete %s: %s", path, exc)


def move_aside(path: Folder) -> Folder | None:
    """Rename a folder to be deleted to a name no listing shows (``.trash_*`` folders keep theirs);
    the new path, or None if it is gone or cannot be renamed (logged). Deleting it is then
    ``remove_tree``'s, at leisure: one rename is all a listing or a new save can see. A prefix
    has no rename: its manifest is deleted here (the step no longer counts), the rest later."""
    if isinstance(path, ObjectFolder):
        try:
            path.remove(MANIFEST)
        except OSError as exc:
            logger.warning("could not delete %s: %s", path, exc)
            return None
        return path
    try:
        if not path.exists():
            return None
        if path.name.startswith(_TRASH_PREFIX):
            return path
        aside = _trash_path(path)
        os.rename(path, aside)
        return aside
    except OSError as exc:
        logger.warning("could not delete %s: %s", path, exc)
        return None


def _trash_path(path: Path) -> Path:
    """Where ``path`` is renamed to be deleted: a name no listing shows, unique per deletion."""
    return path.with_name(f"{_TRASH_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")


def make_directory(directory: Folder) -> None:
    """Create the checkpoint directory; a ConfigError naming checkpoint.dir when it cannot be (the
    preflight check says so before launch; this is for a folder that became uncreatable since).
    An object store's prefix needs no creating."""
    if isinstance(directory, ObjectFolder):
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"checkpoint.dir: cannot create the checkpoint directory {directory} "
            f"({exc.strerror or exc})"
        ) from None
