"""The shard index: what each shard holds and where (``SHARD.tar.idx.json``), read and checked
field by field, built by scanning a tar that has none, and cached on local disk.

An index entry is ``[key, ext, offset, size, label]``: the sample's key, its member's extension,
the offset of the member's bytes in the tar, their length and the label (null for text).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from torchvision.datasets.folder import IMG_EXTENSIONS

from sdnet_trainer.data.bad_samples import original_message
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

SHARD_SUFFIX = ".tar"
INDEX_SUFFIX = ".idx.json"
INDEX_FORMAT = "sdnet-shard-index"
INDEX_VERSION = 1

# Image members by extension (lower case, no dot): what ImageFolder reads. The decoder sniffs the
# content, so the extension only has to say "this member is the image".
IMAGE_EXTS = tuple(sorted({ext.lstrip(".").lower() for ext in IMG_EXTENSIONS}))
LABEL_EXTS = ("cls", "json")
# A text member (UTF-8 bytes): text shards make a byte-level language-model data set.
TEXT_EXT = "txt"
# The label of a text entry (null in the index file).
NO_LABEL = -1

_BLOCK = 512  # tar header and padding unit
# An index entry: [key, image extension, offset of the image bytes, their length, label].
_ENTRY_FIELDS = ("key", "ext", "offset", "size", "label")


class ShardError(ConfigError):
    """A shard or its index that cannot be used as it is; the message names the shard (and the
    key or index entry). Raised in a loader worker, it reaches the main process rebuilt from
    torch's traceback text; as for :class:`BadSampleError`, only the one-line message is kept."""

    def __init__(self, message: str) -> None:
        super().__init__(original_message(str(message), type(self)))


@dataclass
class ShardIndex:
    """The samples of one shard, in the order they appear in the tar."""

    url: str
    tar_bytes: int  # the shard's size when the index was made
    keys: list[str]
    exts: list[str]
    offsets: list[int]  # of each image member's bytes (after its tar header)
    sizes: list[int]
    labels: list[int]  # NO_LABEL for text members
    source: str | None = None  # the converter's fingerprint of the files it came from

    def __len__(self) -> int:
        return len(self.keys)

    def append(self, key: str, ext: str, offset: int, size: int, label: int) -> None:
        """Add the entry of one sample (after those already listed)."""
        self.keys.append(key)
        self.exts.append(ext)
        self.offsets.append(offset)
        self.sizes.append(size)
        self.labels.append(label)

    def to_json(self) -> dict[str, Any]:
        samples = [
            [key, ext, offset, size, None if label == NO_LABEL else label]
            for key, ext, offset, size, label in zip(
                self.keys, self.exts, self.offsets, self.sizes, self.labels
            )
        ]
        out: dict[str, Any] = {
            "format": INDEX_FORMAT,
            "version": INDEX_VERSION,
            "tar_bytes": self.tar_bytes,
            "fields": list(_ENTRY_FIELDS),
            "samples": samples,
        }
        if self.source is not None:
            out["source"] = self.source
        return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_index(raw: bytes, *, url: str, where: str) -> ShardIndex:
    """The index of shard ``url`` from the bytes of its JSON file ``where``, every field checked:
    a wrong index would otherwise hand arbitrary bytes of the tar to the decoder."""
    fix = f"delete {where} to rebuild it by scanning the shard, or re-run the converter"
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ShardError(
            f"data: shard {url}: its index {where} is not valid JSON ({err}); {fix}"
        ) from err
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT:
        raise ShardError(
            f'data: shard {url}: {where} is not a shard index (no "format": '
            f"{INDEX_FORMAT!r}); {fix}"
        )
    if doc.get("version") != INDEX_VERSION:
        raise ShardError(
            f"data: shard {url}: {where} has index version {doc.get('version')!r}, this "
            f"version reads {INDEX_VERSION}; {fix}"
        )
    tar_bytes, samples = doc.get("tar_bytes"), doc.get("samples")
    if not isinstance(tar_bytes, int) or isinstance(tar_bytes, bool) or tar_bytes < 0:
        raise ShardError(
            f"data: shard {url}: {where}: tar_bytes={tar_bytes!r} is not a size; {fix}"
        )
    if not isinstance(samples, list):
        raise ShardError(f'data: shard {url}: {where}: "samples" is not a list; {fix}')
    source = doc.get("source")
    index = ShardIndex(
        url, tar_bytes, [], [], [], [], [], source if isinstance(source, str) else None
    )
    seen: set[str] = set()
    for number, entry in enumerate(samples):
        _check_entry(entry, number, url=url, where=where, tar_bytes=tar_bytes, seen=seen, fix=fix)
        key, ext, offset, size, label = entry
        index.append(key, ext, offset, size, NO_LABEL if label is None else label)
    return index


def _check_entry(
    entry: Any, number: int, *, url: str, where: str, tar_bytes: int, seen: set[str], fix: str
) -> None:
    head = f"data: shard {url}: {where}: entry {number}"
    if not isinstance(entry, list) or len(entry) != len(_ENTRY_FIELDS):
        raise ShardError(f"{head} is not a list of {list(_ENTRY_FIELDS)}; {fix}")
    key, ext, offset, size, label = entry
    if not isinstance(key, str) or not key or "\0" in key:
        raise ShardError(f"{head}: key={key!r} is not a sample key; {fix}")
    head = f"data: shard {url}, key {key!r}: {where}"
    if key in seen:
        raise ShardError(f"{head} lists the key twice; {fix}")
    seen.add(key)
    if ext not in IMAGE_EXTS and ext != TEXT_EXT:
        raise ShardError(
            f"{head}: ext={ext!r} is neither an image type ({', '.join(IMAGE_EXTS)}) nor "
            f"{TEXT_EXT!r}; {fix}"
        )
    # Member bytes start right after a 512-byte header, on a block boundary.
    if not _is_int(offset) or offset < _BLOCK or offset % _BLOCK:
        raise ShardError(
            f"{head}: offset={offset!r} is not the start of a tar member's data; {fix}"
        )
    if not _is_int(size) or size < 0 or offset + size > tar_bytes:
        raise ShardError(
            f"{head}: size={size!r} at offset {offset} does not fit in the {tar_bytes}-byte shard; "
            f"{fix}"
        )
    if ext == TEXT_EXT:
        if label is not None:
            raise ShardError(f"{head}: label={label!r} on a text entry (must be null); {fix}")
    elif not _is_int(label) or label < 0:
        raise ShardError(f"{head}: label={label!r} is not a class index (an integer >= 0); {fix}")


def _split_name(name: str) -> tuple[str, str]:
    """(key, extension) of a member name: WebDataset's rule, the key ends at the first dot of the
    base name."""
    directory, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    key = f"{directory}/{stem}" if directory else stem
    return key, ext.lower() if dot else ""


def _parse_label(data: bytes, ext: str, *, url: str, key: str) -> int:
    try:
        if ext == "cls":
            label = int(data.decode("utf-8").strip())
        else:
            doc = json.loads(data)
            field = doc.get("label") if isinstance(doc, dict) else None
            if not isinstance(field, int) or isinstance(field, bool):
                raise ValueError(f'no integer "label" field (got {field!r})')
            label = field
    except (UnicodeDecodeError, ValueError) as err:
        raise ShardError(
            f"data: shard {url}, key {key!r}: {key}.{ext} is not a label ({err})"
        ) from err
    if label < 0:
        raise ShardError(f"data: shard {url}, key {key!r}: label {label} is negative")
    return label


def scan_shard(url: str) -> ShardIndex:
    """Build the index of shard ``url`` by reading it once from start to end."""
    fs, path = fsspec.core.url_to_fs(url)
    tar_bytes = int(fs.size(path))
    images: dict[str, tuple[str, int, int]] = {}
    texts: dict[str, tuple[int, int]] = {}
    labels: dict[str, int] = {}
    order: list[str] = []
    key = None
    try:
        with fs.open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = _split_name(member.name)
                if member.offset_data + member.size > tar_bytes:
                    raise ShardError(
                        f"data: shard {url} is truncated: member {member.name} (key {key!r}) "
                        f"ends at byte {member.offset_data + member.size} of {tar_bytes}; "
                        f"re-create the shard"
                    )
                if key not in images and key not in labels and key not in texts:
                    order.append(key)
                if ext in IMAGE_EXTS:
                    images[key] = (ext, member.offset_data, member.size)
                elif ext == TEXT_EXT:
                    texts[key] = (member.offset_data, member.size)
                elif ext in LABEL_EXTS:
                    extracted = tar.extractfile(member)
                    assert extracted is not None  # a regular file
                    labels[key] = _parse_label(extracted.read(), ext, url=url, key=key)
    except tarfile.TarError as err:
        after = f" after key {key!r}" if key is not None else ""
        raise ShardError(
            f"data: shard {url} is not a readable tar{after} ({type(err).__name__}: {err}); "
            f"re-create the shard"
        ) from err
    index = ShardIndex(url, tar_bytes, [], [], [], [], [])
    for key in order:
        if key not in images and key in texts:  # a text sample (a .txt beside an image: caption)
            offset, size = texts[key]
            index.append(key, TEXT_EXT, offset, size, NO_LABEL)
            continue
        if key not in images:
            raise ShardError(
                f"data: shard {url}, key {key!r}: no image member (.{', .'.join(IMAGE_EXTS)}) "
                f"and no text member (.{TEXT_EXT})"
            )
        if key not in labels:
            raise ShardError(
                f"data: shard {url}, key {key!r}: no label member ({key}.cls or {key}.json)"
            )
        ext, offset, size = images[key]
        index.append(key, ext, offset, size, labels[key])
    return index


def _cache_dir() -> Path:
    base = os.environ.get("SDNET_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "sdnet_trainer"


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# What a file system reports that changes when a file is replaced: local mtime, S3/GCS ETags and
# generations, HTTP validators. A tar's size alone does not (tarfile pads to 10 KiB records).
_VERSION_FIELDS = (
    "mtime",
    "LastModified",
    "last_modified",
    "Last-Modified",
    "ETag",
    "etag",
    "Content-MD5",
    "generation",
    "md5Hash",
)


def load_index(url: str) -> tuple[ShardIndex, int]:
    """(index, the shard's current size) of shard ``url``: its ``.idx.json`` next to it, or else
    one built by scanning and cached locally, keyed by the URL, the shard's size and what its
    storage reports of its version (:data:`_VERSION_FIELDS`)."""
    fs, path = fsspec.core.url_to_fs(url)
    try:
        info = fs.info(path)
    except FileNotFoundError as err:
        raise ShardError(f"data: shard {url} does not exist") from err
    actual = int(info["size"])
    try:
        raw = fs.cat_file(path + INDEX_SUFFIX)
    except FileNotFoundError:
        raw = None
    if raw is not None:
        return parse_index(raw, url=url, where=url + INDEX_SUFFIX), actual
    version = [url, actual, *(str(info.get(field)) for field in _VERSION_FIELDS)]
    digest = hashlib.sha256(json.dumps(version).encode()).hexdigest()[:40]
    cached = _cache_dir() / "shard-index" / f"{digest}{INDEX_SUFFIX}"
    if cached.is_file():
        index = parse_index(cached.read_bytes(), url=url, where=str(cached))
        if index.tar_bytes == actual:
            return index, actual
    logger.info(
        "data: shard %s has no %s; scanning it (once, cached in %s)", url, INDEX_SUFFIX, cached
    )
    index = scan_shard(url)
    _write_atomic(cached, json.dumps(index.to_json()).encode())
    return index, actual
