"""The converter: an ImageFolder's (or ``.txt`` folders') ``train/`` and ``val/`` written as tar
shards with their indexes, in the folder's sample order, skipping on a re-run the shards already
written from the same files."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from sdnet_trainer.data.shards.index import (
    INDEX_SUFFIX,
    INDEX_VERSION,
    NO_LABEL,
    SHARD_SUFFIX,
    ShardError,
    _write_atomic,
    parse_index,
    scan_shard,
)
from sdnet_trainer.data.shards.listing import CLASSES_FILE, SPLITS
from sdnet_trainer.errors import ConfigError

# Samples per shard when none is given. WebDataset's ShardWriter closes a shard at 100,000
# samples or 3e9 bytes, whichever comes first; this converter counts samples only, so its default
# is a count that keeps image shards under that byte cap with room to spare: 10,000 ImageNet
# JPEGs (about 110 KB each) make a shard of about 1.1 GB, 129 shards for the 1.28 million
# training images. A shard is also what a re-run skips or rewrites whole, and its index is read
# at once when the data set is built, which a smaller count keeps cheap.
DEFAULT_SHARD_SIZE = 10_000


def _fingerprint(files: list[tuple[str, int]], src: Path, shard_size: int) -> str:
    """What a shard was written from: its files (relative path, size, mtime), labels and the
    shard size; a re-run skips a shard only when this is unchanged."""
    digest = hashlib.sha256(f"v{INDEX_VERSION}:{shard_size}".encode())
    for path, label in files:
        stat = os.stat(path)
        rel = os.path.relpath(path, src)
        digest.update(f"\0{rel}\0{label}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _tar_member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0  # reproducible bytes
    return info, io.BytesIO(data)


def _write_shard(path: Path, files: list[tuple[str, int]], keys: list[str], source: str) -> int:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for (file, label), key in zip(files, keys):
            ext = Path(file).suffix.lower().lstrip(".")
            ext = "jpg" if ext == "jpeg" else ext
            tar.addfile(*_tar_member(f"{key}.{ext}", Path(file).read_bytes()))
            if label != NO_LABEL:
                tar.addfile(*_tar_member(f"{key}.cls", str(label).encode()))
    index = scan_shard(str(tmp))
    index.url, index.source = str(path), source
    os.replace(tmp, path)
    # The index last: a shard without its index is one a re-run writes again.
    _write_atomic(path.with_name(path.name + INDEX_SUFFIX), json.dumps(index.to_json()).encode())
    return len(index)


def _finished(path: Path, source: str) -> bool:
    index_path = path.with_name(path.name + INDEX_SUFFIX)
    if not (path.is_file() and index_path.is_file()):
        return False
    try:
        index = parse_index(index_path.read_bytes(), url=str(path), where=str(index_path))
    except ShardError:
        return False
    return index.source == source and index.tar_bytes == path.stat().st_size


def _text_files(directory: Path) -> list[tuple[str, int]]:
    """The ``.txt`` files of a text folder in ``data=text``'s order (sorted paths, recursive),
    when it holds no images; [] for an image folder."""
    if any(p.suffix.lower() in IMG_EXTENSIONS for p in directory.rglob("*") if p.is_file()):
        return []
    return [(str(p), NO_LABEL) for p in sorted(directory.rglob("*.txt"))]


def convert(
    src: str | Path, out: str | Path, *, shard_size: int = DEFAULT_SHARD_SIZE
) -> dict[str, Any]:
    """Write ``src``'s ``train/`` and ``val/`` as shards under ``out``: an ImageFolder (class
    folders of images; the class names go to ``OUT/classes.json``), or folders of ``.txt`` files
    (one text member per file, for a byte-level language model). ``shard_size``: samples (files)
    per shard (:data:`DEFAULT_SHARD_SIZE`). Returns {"classes": n or None, split: {"samples",
    "shards", "written", "skipped"}}."""
    src, out = Path(src), Path(out)
    if shard_size < 1:
        raise ConfigError(f"shard_size={shard_size} must be >= 1")
    for split in SPLITS:
        if not (src / split).is_dir():
            raise ConfigError(
                f"{src} has no {split}/ folder (expected {split}/<class>/<images> or {split}/*.txt)"
            )
    texts = {split: _text_files(src / split) for split in SPLITS}
    listing: dict[str, list[tuple[str, int]]]
    if texts["train"] and texts["val"]:
        listing, classes = texts, None
    else:
        class_lists = {}
        for split in SPLITS:
            try:
                class_lists[split] = find_classes(str(src / split))[0]
            except FileNotFoundError as err:
                raise ConfigError(
                    f"{src / split} holds neither class folders of images nor .txt files ({err})"
                ) from err
        if class_lists["train"] != class_lists["val"]:
            raise ConfigError(f"{src}: train/ and val/ have different class folders")
        classes = class_lists["train"]
        class_to_idx = {name: number for number, name in enumerate(classes)}
        # ImageFolder's own listing: the shards keep its sample order.
        listing = {
            split: make_dataset(str(src / split), class_to_idx, extensions=IMG_EXTENSIONS)
            for split in SPLITS
        }
    out.mkdir(parents=True, exist_ok=True)
    if classes is not None:
        _write_atomic(out / CLASSES_FILE, json.dumps({"classes": classes}, indent=1).encode())
    report: dict[str, Any] = {"classes": None if classes is None else len(classes)}
    for split in SPLITS:
        files = listing[split]
        count = -(-len(files) // shard_size)
        names = [f"{split}-{number:06d}{SHARD_SUFFIX}" for number in range(count)]
        stale = (
            sorted(
                p.name
                for p in (out / split).glob(f"{split}-*{SHARD_SUFFIX}")
                if p.name not in names
            )
            if (out / split).is_dir()
            else []
        )
        if stale:
            raise ConfigError(
                f"{out / split} holds shards this conversion does not write ({', '.join(stale[:3])}"
                f"{', ...' if len(stale) > 3 else ''}): remove them or convert into a new OUT"
            )
        width = max(8, len(str(len(files))))
        written = skipped = 0
        for number, name in enumerate(names):
            chunk = files[number * shard_size : (number + 1) * shard_size]
            keys = [f"{number * shard_size + i:0{width}d}" for i in range(len(chunk))]
            source = _fingerprint(chunk, src, shard_size)
            path = out / split / name
            if _finished(path, source):
                skipped += 1
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_shard(path, chunk, keys, source)
            written += 1
        report[split] = {
            "samples": len(files),
            "shards": count,
            "written": written,
            "skipped": skipped,
        }
    return report
