"""Folders the run creates, checked before launch: a path key (``checkpoint.dir``, ``run.root``,
``logging.mlflow.tracking_uri``, ...) whose folder cannot be created is one ConfigError naming the
key, the path and why, instead of a traceback from whatever first tries to create it.

``RunDirCheck`` does it for the run directory, which Hydra creates before any of this package's
code runs: a Hydra callback, named in configs/config.yaml, that runs just before.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from sdnet_trainer.errors import EXIT_CONFIG_ERROR, ConfigError


def check_creatable_folder(key: str, value: str | os.PathLike) -> None:
    """ConfigError unless ``value`` is a folder this process can create files in, or can create:
    an existing one must be a folder it can write into; an absent one must have a nearest existing
    ancestor that is a folder it can create folders in.

    Tried, not inferred from permission bits: a folder is made in that place and removed at once
    (a unique hidden name, so ranks checking the same path at once do not meet), because only the
    filesystem knows (root ignores the bits; /proc, a read-only mount or a full quota refuse)."""
    path = Path(value).expanduser().absolute()
    try:
        place = _nearest_existing(path)
    except OSError as exc:  # a folder on the way that cannot be looked into
        raise ConfigError(
            f"{key}={str(value)!r}: cannot use the folder {path}: {exc.strerror or exc}"
        ) from None
    if not place.is_dir():
        what = "it" if place == path else f"{place}"
        raise ConfigError(
            f"{key}={str(value)!r}: cannot create the folder {path}: {what} exists and is not a "
            f"folder"
        )
    try:
        probe = tempfile.mkdtemp(prefix=".sdnet_write_check_", dir=place)
    except OSError as exc:
        action = "write into it" if place == path else f"create a folder in {place}"
        raise ConfigError(
            f"{key}={str(value)!r}: cannot use the folder {path}: cannot {action} "
            f"({exc.strerror or exc})"
        ) from None
    os.rmdir(probe)


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (a dangling link counts: nothing can be
    created through it)."""
    place = path
    while not (place.exists() or place.is_symlink()) and place != place.parent:
        place = place.parent
    return place


def is_local_path(uri: str) -> bool:
    """Whether a tracking URI names a local folder: a plain path or a file: URI."""
    return "://" not in uri or uri.startswith("file:")


def local_path(uri: str) -> str:
    """The folder of a plain path or a ``file:`` URI."""
    return uri.removeprefix("file://") if uri.startswith("file://") else uri.removeprefix("file:")


class RunDirCheck(Callback):
    """Hydra callback: before Hydra creates the run (or sweep) directory, check that it can; else
    print one line naming the key (``hydra.run.dir`` if given, else ``run.root``) and exit 2."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "run")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "sweep")

    def _check(self, config: DictConfig, mode: str) -> None:
        key = f"hydra.{mode}.dir"
        overrides = [*config.hydra.overrides.hydra, *config.hydra.overrides.task]
        if not any(str(o).lstrip("+~").startswith(f"{key}=") for o in overrides):
            # The default, ${run.root}/...: what can go wrong is run.root.
            key, value = "run.root", config.run.root
        else:
            value = config.hydra[mode].dir
        try:
            check_creatable_folder(key, str(value))
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)
