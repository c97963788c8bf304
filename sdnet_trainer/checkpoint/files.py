"""The files of a checkpoint directory: their names, and the file-system steps the commit protocol
(``manager``) and the lock (``lock``) are built of, each durable or atomic where the protocol
needs it to be.

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
from typing import Any

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


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_dirs(directory: Path) -> Iterator[tuple[int, Path]]:
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if (m := STEP_DIR.match(path.name)) and path.is_dir():
            yield int(m[1]), path


def invalid_field(record: dict[str, Any], kinds: dict[str, type | tuple[type, ...]]) -> str | None:
    """The first key of ``kinds`` that the JSON object ``record`` lacks or holds a value of another
    type under; None when every one is there with its type."""
    return next((key for key, kind in kinds.items() if not isinstance(record.get(key), kind)), None)


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


def remove_tree(path: Path) -> None:
    """Delete a folder, best effort. A checkpoint is renamed aside first, so that it is never seen
    half deleted (e.g. shards gone, manifest still there)."""
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


def move_aside(path: Path) -> Path | None:
    """Rename a folder to be deleted to a name no listing shows (``.trash_*`` folders keep theirs);
    the new path, or None if it is gone or cannot be renamed (logged). Deleting it is then
    ``remove_tree``'s, at leisure: one rename is all a listing or a new save can see."""
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
