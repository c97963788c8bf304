"""An export into object storage (``out=s3://...``, or no ``out=`` for a checkpoint in a store: its
prefix's ``export/``). The export is written as any other, into a local temporary folder with
every check of ``output``, then uploaded: each file one PUT, EXPORT_MANIFEST last. As in a
folder, only objects that an earlier export wrote (its EXPORT_MANIFEST lists them) are replaced,
and the check runs before the slow work."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sdnet_trainer.checkpoint import Checkpoint
from sdnet_trainer.checkpoint.objects import ObjectFolder, is_url
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.export.output import (
    EXPORT_MANIFEST,
    MANIFEST_MAX_BYTES,
    foreign_manifest,
    manifest_text,
    parse_export_manifest,
)

logger = logging.getLogger(__name__)


def output_prefix(out: str | None, checkpoint: Checkpoint) -> ObjectFolder | None:
    """Where an export into a store goes: ``out=`` as a URL, or ``<checkpoint>/export`` for a
    checkpoint in a store without ``out=``; None for a local folder."""
    if out and is_url(out):
        return ObjectFolder.of(out)
    if not out and isinstance(checkpoint.path, ObjectFolder):
        return checkpoint.path / "export"
    return None


def check_prefix(out: ObjectFolder, names: Iterable[str]) -> dict[str, Any]:
    """Refuse a prefix holding an object of one of ``names`` that no earlier export wrote; the
    earlier exports' entries (from its EXPORT_MANIFEST, which must be export's own)."""
    present, _ = out.listing()
    previous: dict[str, Any] = {}
    if EXPORT_MANIFEST in present:
        where = f"{out}/{EXPORT_MANIFEST}"
        if present[EXPORT_MANIFEST] > MANIFEST_MAX_BYTES:
            raise ConfigError(foreign_manifest(where))
        previous = parse_export_manifest(out.read_bytes(EXPORT_MANIFEST) or b"", where)
    for name in names:
        if name in present and name not in previous:
            raise ConfigError(
                f"out: {out}/{name} exists and was not written by an earlier export (it is not "
                f"listed in {out}/{EXPORT_MANIFEST}); export does not overwrite it: move it away "
                f"or pass out=<another prefix>"
            )
    return previous


def upload(local: Path, files: list[Path], out: ObjectFolder) -> list[ObjectFolder]:
    """Copy a finished local export (``files`` and its EXPORT_MANIFEST in ``local``) to ``out``:
    the files, then the manifest, which lists the earlier exports' files too."""
    previous = check_prefix(out, [f.name for f in files])
    for path in files:
        out.upload(path.name, str(path))
    manifest = parse_export_manifest((local / EXPORT_MANIFEST).read_bytes(), str(local))
    merged = {**previous, **manifest}
    out.write_bytes(EXPORT_MANIFEST, manifest_text(merged).encode())
    logger.info("uploaded %d file(s) of the export to %s", len(files), out)
    return [out / path.name for path in files]
