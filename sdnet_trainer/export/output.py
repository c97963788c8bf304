"""The output folder: export writes only its own files. It refuses a folder that is a link and
any file there that no earlier export wrote (its EXPORT_MANIFEST lists those), stages every file
inside the folder and moves them into place by renames once all are written and checked."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sdnet_trainer.checkpoint import Checkpoint
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export.writers import ExportError

# Lists the files exports wrote into their output folder: the only files a later export replaces.
EXPORT_MANIFEST = "export_manifest.json"
MANIFEST_WRITER = "sdnet_trainer.export"
MANIFEST_MAX_BYTES = 1 << 20
_STAGING_PREFIX = ".staging_export_"


def output_folder(out: str | None, checkpoint: Checkpoint) -> Path:
    """``out=`` as an absolute path (its last part is not resolved: a link there is refused, not
    followed), else ``<checkpoint>/export``."""
    if out:
        return Path(os.path.abspath(Path(out).expanduser()))
    assert isinstance(checkpoint.path, Path), "a checkpoint in a store exports to one (remote)"
    return checkpoint.path / "export"


def check_output(out: Path, names: Iterable[str]) -> None:
    """Refuse an output folder that is a link or not a folder, or that holds a file of one of
    ``names`` that export may not replace. An absent folder is fine: the export creates it."""
    folder = _open_folder(out, create=False)
    if folder is None:
        return
    try:
        previous = _previous_exports(folder, out)
        for name in [*names, EXPORT_MANIFEST]:
            _check_target(folder, out, name, previous)
    finally:
        os.close(folder)


def _open_folder(out: Path, *, create: bool) -> int | None:
    """A descriptor of the folder ``out``, opened without following a link; None if it is absent
    and not ``create``d."""
    if out.is_symlink():
        raise _link_error(out)
    if create:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(out)  # never follows a link: an existing name, link or not, fails
        except FileExistsError:
            pass
        except OSError as err:
            raise ConfigError(f"out: cannot create the output folder {out}: {err}") from None
    try:
        return os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        if create:
            raise ConfigError(f"out: the output folder {out} vanished while exporting") from None
        return None
    except OSError as err:
        if out.is_symlink():
            raise _link_error(out) from None
        raise ConfigError(
            f"out: {out} is not a folder export can write into ({err.strerror}); pass "
            f"out=<a folder>"
        ) from None


def _link_error(out: Path) -> ConfigError:
    return ConfigError(
        f"out: the output folder {out} is a symbolic link (to {os.readlink(out)!r}); export "
        f"writes only into a real folder and never follows a link out of it: remove the link "
        f"or pass out=<a folder>"
    )


def _same_folder(folder: int, out: Path) -> None:
    """Refuse to go on when ``out`` no longer names the folder ``folder`` was opened on."""
    try:
        now = os.lstat(out)
    except OSError:
        now = None
    opened = os.fstat(folder)
    if (
        now is None
        or stat.S_ISLNK(now.st_mode)
        or (now.st_dev, now.st_ino)
        != (
            opened.st_dev,
            opened.st_ino,
        )
    ):
        raise ConfigError(f"out: the output folder {out} was replaced while exporting")


def _previous_exports(folder: int, out: Path) -> dict[str, Any]:
    """The files earlier exports wrote into ``out``, by name, from its EXPORT_MANIFEST; refuses a
    manifest that export did not write."""
    path = out / EXPORT_MANIFEST
    try:
        info = os.lstat(EXPORT_MANIFEST, dir_fd=folder)
    except FileNotFoundError:
        return {}
    if not stat.S_ISREG(info.st_mode) or info.st_size > MANIFEST_MAX_BYTES:
        raise ConfigError(foreign_manifest(str(path)))
    try:
        fd = os.open(EXPORT_MANIFEST, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
        with os.fdopen(fd, "rb") as file:
            data = file.read(MANIFEST_MAX_BYTES + 1)
    except OSError:
        raise ConfigError(foreign_manifest(str(path))) from None
    return parse_export_manifest(data, str(path))


def parse_export_manifest(data: bytes, where: str) -> dict[str, Any]:
    """The files an EXPORT_MANIFEST's bytes list, by plain name; a ConfigError naming ``where``
    when export did not write it."""
    try:
        manifest = json.loads(data)
    except ValueError:
        raise ConfigError(foreign_manifest(where)) from None
    if not isinstance(manifest, dict) or manifest.get("written_by") != MANIFEST_WRITER:
        raise ConfigError(foreign_manifest(where))
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ConfigError(foreign_manifest(where))
    return {
        name: entry
        for name, entry in files.items()
        if isinstance(name, str) and _plain_name(name) and isinstance(entry, dict)
    }


def manifest_text(entries: dict[str, Any]) -> str:
    """An EXPORT_MANIFEST listing ``entries`` (file name: where it came from)."""
    manifest = {"written_by": MANIFEST_WRITER, "files": dict(sorted(entries.items()))}
    return json.dumps(manifest, indent=2) + "\n"


def foreign_manifest(where: str) -> str:
    """Why an EXPORT_MANIFEST at ``where`` is refused: export did not write it."""
    return (
        f"{where} was not written by {MANIFEST_WRITER}: export does not replace it; move it "
        f"away or pass out=<another folder>"
    )


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and os.sep not in name


def _check_target(folder: int, out: Path, name: str, previous: dict[str, Any]) -> None:
    """Refuse to put a file named ``name`` into ``out`` over a link, a folder, or a file that no
    earlier export wrote. EXPORT_MANIFEST itself was checked by ``_previous_exports``."""
    try:
        info = os.lstat(name, dir_fd=folder)
    except FileNotFoundError:
        return
    path = out / name
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(
            f"out: {path} is a symbolic link (to {os.readlink(name, dir_fd=folder)!r}); export "
            f"neither writes through nor replaces links: remove it or pass out=<another folder>"
        )
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(
            f"out: {path} exists and is not a regular file; export does not replace it: remove "
            f"it or pass out=<another folder>"
        )
    if name != EXPORT_MANIFEST and name not in previous:
        raise ConfigError(
            f"out: {path} exists and was not written by an earlier export (it is not listed in "
            f"{out / EXPORT_MANIFEST}); export does not overwrite it: move it away or pass "
            f"out=<another folder>"
        )


@contextmanager
def staging_folder(out: Path) -> Iterator[tuple[int, Path]]:
    """The output folder, created when absent (a descriptor of it), and a fresh staging folder
    inside it (same filesystem, so the final moves are renames), always removed."""
    folder = _open_folder(out, create=True)
    assert folder is not None  # created
    try:
        name = f"{_STAGING_PREFIX}{secrets.token_hex(8)}"
        try:
            os.mkdir(name, 0o700, dir_fd=folder)
        except OSError as err:
            raise ConfigError(f"out: cannot write into the output folder {out}: {err}") from None
        try:
            _same_folder(folder, out)
            yield folder, out / name
        finally:
            try:
                _same_folder(folder, out)
                shutil.rmtree(out / name, ignore_errors=True)
            except ConfigError:
                pass  # out names another folder now: leave its contents alone
    finally:
        os.close(folder)


def publish(folder: int, out: Path, staging: Path, checkpoint: Checkpoint) -> list[Path]:
    """Move every staged file into ``out`` (the folder open as ``folder``), replacing only files
    an earlier export wrote, after every check passed; EXPORT_MANIFEST first, listing them (an
    ONNX model over 2 GB comes with its external data file, which moves along)."""
    _same_folder(folder, out)
    names = sorted(os.listdir(staging))
    previous = _previous_exports(folder, out)
    for name in names:
        if not stat.S_ISREG(os.lstat(staging / name).st_mode):
            raise ExportError(f"the exporters wrote {name!r}, which is not a regular file")
        _check_target(folder, out, name, previous)
    _check_target(folder, out, EXPORT_MANIFEST, previous)
    entries = dict(previous)
    for name in names:
        entries[name] = {"checkpoint": str(checkpoint.path), "step": checkpoint.step}
    (staging / EXPORT_MANIFEST).write_text(manifest_text(entries))
    umask = os.umask(0)
    os.umask(umask)
    for name in [EXPORT_MANIFEST, *names]:
        # Some writers create private files; these are for sharing.
        os.chmod(staging / name, 0o666 & ~umask)
    # Renames within the opened folder: never through a link that took the place of ``out``.
    for name in [EXPORT_MANIFEST, *names]:
        os.replace(f"{staging.name}/{name}", name, src_dir_fd=folder, dst_dir_fd=folder)
    return [out / name for name in names]
