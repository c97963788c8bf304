"""Reading ``data.root`` for ``data.name=hf``: its splits, and which of them train and validate.

See :mod:`sdnet_trainer.data.hf` for the layouts ``data.root`` may have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.errors import ConfigError

if TYPE_CHECKING:
    import datasets as hf_datasets

INSTALL_HINT = "pip install 'sdnet_trainer[hf]'"

TRAIN_SPLIT = "train"
# The split that validates, in order of preference; "test" last, as Hub test splits often have
# no labels (ClassLabel -1), which the label check reports.
VAL_SPLITS = ("validation", "val", "valid", "dev", "test")

_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow"}


def require_datasets() -> Any:
    """The ``datasets`` module, or one clear error naming the extra that installs it."""
    try:
        import datasets
    except ImportError as err:
        raise ConfigError(
            f"data.name=hf needs the Hugging Face `datasets` package, which is not installed: "
            f"{INSTALL_HINT}"
        ) from err
    return datasets


@contextlib.contextmanager
def _quiet_progress(datasets: Any) -> Iterator[None]:
    """No per-split progress bars from ``datasets`` while loading: every rank would print them
    into the training log. The caller's setting is restored afterwards."""
    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def _root(cfg: DataConfig) -> Path:
    if cfg.root is None:
        raise ConfigError(
            "data.root is required for data.name='hf'; it is null (set it to a dataset saved "
            "with save_to_disk, or a folder of .parquet/.arrow files)"
        )
    root = Path(cfg.root).expanduser()
    if not root.exists():
        raise ConfigError(f"data.root={cfg.root!r} does not exist")
    return root


def _data_files(root: Path) -> list[Path]:
    """The .parquet/.arrow files under ``root`` (or ``root`` itself), leaving out the hidden and
    ``__``-prefixed paths that ``load_dataset`` leaves out."""
    if root.is_file():
        return [root] if root.suffix in _FILE_BUILDERS else []
    return sorted(
        path
        for path in root.rglob("*")
        if path.suffix in _FILE_BUILDERS
        and path.is_file()
        and not any(part.startswith((".", "__")) for part in path.relative_to(root).parts)
    )


def load_splits(cfg: DataConfig) -> dict[str, hf_datasets.Dataset]:
    """The splits of ``data.root`` by name (a single ``Dataset`` is the ``train`` split)."""
    datasets = require_datasets()
    root = _root(cfg)
    saved = root.is_dir() and any(
        (root / marker).is_file() for marker in ("dataset_dict.json", "state.json")
    )
    with _quiet_progress(datasets):
        if saved:
            loaded = _guarded(cfg, lambda: datasets.load_from_disk(str(root)))
        else:
            files = _data_files(root)
            suffixes = sorted({path.suffix for path in files})
            if not files:
                raise ConfigError(
                    f"data.root={cfg.root!r} holds neither a dataset saved with save_to_disk "
                    f"(dataset_dict.json or state.json) nor .parquet/.arrow files"
                )
            if len(suffixes) > 1:
                raise ConfigError(
                    f"data.root={cfg.root!r} mixes .parquet and .arrow files; keep one format "
                    f"(e.g. {files[0]} and {next(p for p in files if p.suffix != files[0].suffix)})"
                )
            builder = _FILE_BUILDERS[suffixes[0]]
            if root.is_file():
                loaded = _guarded(
                    cfg, lambda: datasets.load_dataset(builder, data_files={"train": str(root)})
                )
            else:
                loaded = _guarded(cfg, lambda: datasets.load_dataset(builder, data_dir=str(root)))
    if isinstance(loaded, datasets.Dataset):
        return {TRAIN_SPLIT: loaded}
    return dict(loaded)


def _guarded(cfg: DataConfig, load: Any) -> Any:
    """``load()``, with whatever a malformed folder makes ``datasets`` or pyarrow raise turned
    into one error that names ``data.root``."""
    try:
        return load()
    except ConfigError:
        raise
    except Exception as err:  # datasets/pyarrow raise many types (ArrowInvalid, FileNotFound, ...)
        raise ConfigError(
            f"data.root={cfg.root!r} cannot be read as a Hugging Face dataset: "
            f"{type(err).__name__}: {err}"
        ) from err


def pick_splits(
    cfg: DataConfig, splits: dict[str, hf_datasets.Dataset]
) -> tuple[hf_datasets.Dataset, hf_datasets.Dataset | None, str | None]:
    """(train, val or None, val's split name)."""
    if TRAIN_SPLIT not in splits:
        raise ConfigError(
            f"data.root={cfg.root!r} has no {TRAIN_SPLIT!r} split; its splits are {sorted(splits)}"
        )
    val_name = next((name for name in VAL_SPLITS if name in splits), None)
    return splits[TRAIN_SPLIT], None if val_name is None else splits[val_name], val_name


def require_column(cfg: DataConfig, ds: hf_datasets.Dataset, key: str, split: str) -> str:
    column = getattr(cfg, key)
    if column not in ds.column_names:
        raise ConfigError(
            f"data.{key}={column!r} is not a column of the {split!r} split of "
            f"data.root={cfg.root!r}; its columns are {ds.column_names}"
        )
    return column
