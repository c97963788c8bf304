"""Data in tar shards (the WebDataset layout), local or behind any fsspec URL, read with random
access so that the global-index sampler, ``set_epoch`` and exact resume on any world size work
exactly as they do for a folder of files.

A shard is a plain tar whose members are grouped into samples by key (the member name up to the
first dot of its base name): ``KEY.jpg`` (or ``.png``, ``.webp``, any image type ImageFolder
reads) plus ``KEY.cls`` (the label as a decimal integer) or ``KEY.json`` (an object with an
integer ``label``) make a labelled image (:class:`ShardImages`, with ``data=imagefolder``'s
transforms, from ``data.augment``); ``KEY.txt`` alone makes a text sample, and a shard set of
text samples is read as byte-level language-model windows like ``data=text``
(:class:`ShardText`).

Random access comes from an index per shard, ``SHARD.tar.idx.json`` next to it: for every sample
its key, the member's extension, the offset of the member's bytes in the tar, their length and
the label (null for text). The converter writes it; for shards made elsewhere it is built once by
scanning the tar and cached on local disk (``$SDNET_CACHE_DIR`` or ``~/.cache/sdnet_trainer``).
Image ``i`` is then one range read of the member's tar header plus its bytes: the header is
checked against the index (checksum, size, name), so an index that does not describe its tar is
caught at the first read instead of feeding wrong bytes to the decoder.

Everything read from the shards and their indexes is untrusted: a malformed index is a
:class:`ConfigError` naming the shard, the entry and the field, raised when the data set is
built; a member that cannot be read (the shard is truncated) or decoded follows
``data.on_bad_sample`` as a bad file of an ImageFolder does, with a message naming the shard and
the key. A failure to reach the storage (network, permissions) is not a bad sample: it raises.

Convert an ImageFolder (its ``train/`` and ``val/``), or ``train/`` and ``val/`` folders of
``.txt`` files, with::

    python -m sdnet_trainer.data.shards SRC OUT shard_size=1000

(``shard_size``: samples per shard) which writes ``OUT/train/train-000000.tar`` (+
``.idx.json``), ..., ``OUT/val/...`` and, for images, ``OUT/classes.json``; it keeps
ImageFolder's sample order (sample ``i`` of the shards is sample ``i`` of the folder), or
``data=text``'s file order, and skips, when run again, the shards already written from the same
files.
"""

from __future__ import annotations

import bisect
import gc
import hashlib
import io
import itertools
import json
import logging
import os
import re
import sys
import tarfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from sdnet_trainer.config.checks import check_choice
from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.augment import build_transforms
from sdnet_trainer.data.bad_samples import (
    ON_BAD_SAMPLE,
    BadSampleError,
    SkippedSamples,
    first_loadable,
    original_message,
)
from sdnet_trainer.data.tokens import BYTE_VOCAB
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")

SHARD_SUFFIX = ".tar"
INDEX_SUFFIX = ".idx.json"
CLASSES_FILE = "classes.json"
INDEX_FORMAT = "sdnet-shard-index"
INDEX_VERSION = 1
SPLITS = ("train", "val")

# Image members by extension (lower case, no dot): what ImageFolder reads. The decoder sniffs the
# content, so the extension only has to say "this member is the image".
IMAGE_EXTS = tuple(sorted({ext.lstrip(".").lower() for ext in IMG_EXTENSIONS}))
LABEL_EXTS = ("cls", "json")
# A text member (UTF-8 bytes): text shards make a byte-level language-model data set.
TEXT_EXT = "txt"
# The label of a text entry (null in the index file).
NO_LABEL = -1

_BLOCK = 512  # tar header and padding unit
# Open local shard files kept per process (per loader worker): random sampling touches every
# shard, so this bounds file descriptors rather than promising hits.
_MAX_OPEN_SHARDS = 16
# An index entry: [key, image extension, offset of the image bytes, their length, label].
_ENTRY_FIELDS = ("key", "ext", "offset", "size", "label")


class ShardError(ConfigError):
    """A shard or its index that cannot be used as it is; the message names the shard (and the
    key or index entry). Raised in a loader worker, it reaches the main process rebuilt from
    torch's traceback text; as for :class:`BadSampleError`, only the one-line message is kept."""

    def __init__(self, message: str) -> None:
        super().__init__(original_message(str(message), type(self)))


# --------------------------------------------------------------------------------------------
# The shard index
# --------------------------------------------------------------------------------------------


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
        index.keys.append(key)
        index.exts.append(ext)
        index.offsets.append(offset)
        index.sizes.append(size)
        index.labels.append(NO_LABEL if label is None else label)
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
            index.keys.append(key)
            index.exts.append(TEXT_EXT)
            index.offsets.append(offset)
            index.sizes.append(size)
            index.labels.append(NO_LABEL)
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
        index.keys.append(key)
        index.exts.append(ext)
        index.offsets.append(offset)
        index.sizes.append(size)
        index.labels.append(labels[key])
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


# --------------------------------------------------------------------------------------------
# Shard sets: a folder (train/, val/), a brace pattern, or a URL of either
# --------------------------------------------------------------------------------------------

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(\d+)\.\.(\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """``train-{000000..000002}.tar`` -> ``train-000000.tar``, ..., ``train-000002.tar``; also
    ``{a,b}`` lists, several braces (their product, in order), and zero padding from the first
    bound's width."""
    parts = _BRACE.split(pattern)
    choices: list[list[str]] = []
    for number, part in enumerate(parts):
        if number % 2 == 0:
            choices.append([part])
            continue
        match = _RANGE.match(part)
        if match:
            low, high = match.groups()
            if int(high) < int(low):
                raise ConfigError(f"data.root={pattern!r}: the range {{{part}}} runs backwards")
            width = len(low)
            choices.append([str(n).zfill(width) for n in range(int(low), int(high) + 1)])
        elif "," in part:
            choices.append(part.split(","))
        else:
            raise ConfigError(
                f"data.root={pattern!r}: {{{part}}} is neither a range {{000000..000127}} nor a "
                f"list {{a,b}}"
            )
    return ["".join(combo) for combo in itertools.product(*choices)]


def _is_pattern(root: str) -> bool:
    return bool(_BRACE.search(root))


def _list_split(root: str, split: str) -> list[str]:
    """The shard URLs of ``root/split``, in name order."""
    fs, path = fsspec.core.url_to_fs(root)
    directory = f"{path.rstrip('/')}/{split}"
    try:
        found = fs.glob(f"{directory}/*{SHARD_SUFFIX}")
    except FileNotFoundError:
        found = []
    if not found:
        raise ConfigError(
            f"data.root={root!r} has no {split}/*{SHARD_SUFFIX} shards (expected "
            f"{split}/{split}-000000{SHARD_SUFFIX}, ...; convert an ImageFolder with "
            f"python -m sdnet_trainer.data.shards SRC OUT shard_size=N)"
        )
    return [
        fs.unstrip_protocol(p) if not isinstance(fs, LocalFileSystem) else p for p in sorted(found)
    ]


def _read_classes(root: str) -> list[str] | None:
    """``root/classes.json`` (the converter's class names, in label order), if there is one."""
    fs, path = fsspec.core.url_to_fs(root)
    where = f"{root.rstrip('/')}/{CLASSES_FILE}"
    try:
        raw = fs.cat_file(f"{path.rstrip('/')}/{CLASSES_FILE}")
    except FileNotFoundError:
        return None
    try:
        classes = json.loads(raw).get("classes")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        raise ConfigError(f"data.root={root!r}: {where} is not valid ({err})") from err
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise ConfigError(f'data.root={root!r}: {where} has no "classes" list of names')
    return classes


# --------------------------------------------------------------------------------------------
# The data set
# --------------------------------------------------------------------------------------------


class _BadMember(Exception):
    """A member that cannot be read as the index says: follows data.on_bad_sample."""


class _Reader:
    """Range reads from shards, one per process: local shards through a few cached open files
    (``os.pread``, no shared seek position), others through their fsspec file system's
    ``cat_file(path, start, end)``, one range request each. Built lazily in the process that
    reads, since open files and HTTP sessions must not cross a fork."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._targets: dict[str, tuple[Any, str]] = {}
        self._files: OrderedDict[str, int] = OrderedDict()

    def read(self, url: str, start: int, length: int) -> bytes:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = fsspec.core.url_to_fs(url)
        fs, path = target
        if isinstance(fs, LocalFileSystem):
            return os.pread(self._file(path), length, start)
        return bytes(fs.cat_file(path, start=start, end=start + length))

    def _file(self, path: str) -> int:
        fd = self._files.get(path)
        if fd is not None:
            self._files.move_to_end(path)
            return fd
        fd = os.open(path, os.O_RDONLY)
        self._files[path] = fd
        if len(self._files) > _MAX_OPEN_SHARDS:
            _, oldest = self._files.popitem(last=False)
            os.close(oldest)
        return fd

    def close(self) -> None:
        while self._files:
            os.close(self._files.popitem()[1])

    def __del__(self, _getpid=os.getpid, _close=os.close) -> None:
        # Raw descriptors are not closed by the garbage collector. The os functions are bound
        # here because module globals may already be gone at interpreter exit. Not in a forked
        # child: its copies of the parent's descriptors are closed when it exits.
        if self.pid == _getpid():
            while self._files:
                _close(self._files.popitem()[1])


def _check_header(block: bytes, *, name: str, size: int) -> str | None:
    """Why ``block`` is not the tar header of member ``name`` of ``size`` bytes; None if it is."""
    try:
        checksum = int(block[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
        member_size = int(block[124:136].split(b"\0", 1)[0].strip() or b"-1", 8)
    except ValueError:
        return "no tar header in front of it"
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    if checksum != unsigned:
        return "no tar header in front of it (checksum mismatch)"
    if member_size != size:
        return f"its tar header says {member_size} bytes, the index {size}"
    encoded = name.encode("utf-8")
    # Longer or non-ASCII names live in a pax/GNU header before this one; this one holds a stand-in.
    if name.isascii() and len(encoded) <= 100:
        header_name = block[:100].split(b"\0", 1)[0]
        prefix = block[345:500].split(b"\0", 1)[0]
        full = prefix + b"/" + header_name if prefix else header_name
        if full != encoded:
            return f"its tar header names {full.decode('utf-8', 'replace')!r}"
    return None


class _ShardSet(Dataset):
    """What the image and the text data sets share: the shards, a per-process reader, and
    ``data.on_bad_sample`` for members that cannot be read (or decoded)."""

    urls: list[str]
    shard_bytes: list[int]
    skipped: SkippedSamples | None
    _reader: _Reader | None

    def __len__(self) -> int:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_reader"] = None  # open files stay in the process that opened them
        return state

    def _read_range(self, number: int, start: int, length: int) -> bytes:
        """``length`` bytes of shard ``number`` from ``start``; short only at the shard's end."""
        reader = self._reader
        if reader is None or reader.pid != os.getpid():
            reader = self._reader = _Reader()
        data = reader.read(self.urls[number], start, length)
        if len(data) > length:
            # A server that ignores Range sends the whole shard: fail rather than read it all.
            raise ShardError(
                f"data: shard {self.urls[number]}: asked for {length} bytes at {start}, got "
                f"{len(data)}; the server does not honour HTTP range requests"
            )
        return data

    def _member(self, number: int, key: str, offset: int, size: int, *, header: bool) -> bytes:
        """The bytes of member ``key`` (at ``offset``, ``size`` long) of shard ``number``; with
        ``header``, its tar header is read along and checked against the index."""
        if offset + size > self.shard_bytes[number]:
            raise _BadMember(
                f"the shard is truncated: it has {self.shard_bytes[number]} bytes, the member "
                f"ends at byte {offset + size}"
            )
        extra = _BLOCK if header else 0
        data = self._read_range(number, offset - extra, size + extra)
        if len(data) < size + extra:
            raise _BadMember(f"the shard ends {size + extra - len(data)} bytes before the member")
        if header:
            problem = _check_header(data[:_BLOCK], name=key, size=size)
            if problem is not None:
                raise _BadMember(f"the shard's index does not match it: {problem}")
        return data[extra:]

    def _first_loadable(self, index: int, load: Callable[[int], T | None]) -> T:
        size = len(self)
        return first_loadable(
            index,
            size,
            load,
            self.skipped,
            none_loads=f"none of the {size} samples in {len(self.urls)} shards can be loaded; "
            f"check data.root",
        )

    def _bad(self, index: int, where: str, verb: str, reason: str, cause: Exception) -> None:
        """Raise for a bad sample under error; log it once under skip."""
        if self.skipped is None:
            raise BadSampleError(
                f"data: cannot {verb} {where} ({reason}); fix or re-create the shard, or set "
                f"data.on_bad_sample=skip"
            ) from cause
        if self.skipped.mark_bad(index):
            logger.warning(
                "data: skipping %s (%s): it cannot be %s; the next sample that can is loaded in "
                "its place (data.on_bad_sample=skip)",
                where,
                reason,
                "read" if verb == "read" else "decoded",
            )


class ShardImages(_ShardSet):
    """Labelled images in tar shards (see the module's docstring), sample ``i`` being the
    ``i``-th entry of the shards' indexes in shard order.

    ``on_bad_sample`` works as for :class:`~sdnet_trainer.data.folders.CheckedImageFolder`:
    ``error`` raises :class:`BadSampleError` naming the shard and the key, ``skip`` loads the
    first of ``i+1, i+2, ...`` that can be read and decoded in place of ``i`` (the same one every
    time), logs each bad member once and counts the replaced loads in :attr:`skipped`.
    """

    def __init__(
        self,
        shards: Sequence[ShardIndex],
        *,
        transform: Any = None,
        on_bad_sample: str = "error",
        classes: list[str] | None = None,
        shard_bytes: Sequence[int] | None = None,
    ) -> None:
        check_choice("data.on_bad_sample", on_bad_sample, ON_BAD_SAMPLE)
        self.transform = transform
        self.target_transform = None
        self.on_bad_sample = on_bad_sample
        self.urls = [shard.url for shard in shards]
        # What can be read of each shard: its size now (shorter than the index says when the
        # shard was truncated after indexing; those members then fail as bad samples).
        self.shard_bytes = (
            list(shard_bytes) if shard_bytes is not None else [s.tar_bytes for s in shards]
        )
        self.keys = [f"{key}.{ext}" for shard in shards for key, ext in zip(shard.keys, shard.exts)]
        # Compact columns: ImageNet has 1.28 million samples, and spawned workers get a copy.
        self._shard = torch.tensor(
            [number for number, shard in enumerate(shards) for _ in range(len(shard))],
            dtype=torch.int32,
        )
        self._offset = torch.tensor([o for s in shards for o in s.offsets], dtype=torch.int64)
        self._size = torch.tensor([n for s in shards for n in s.sizes], dtype=torch.int64)
        self.targets = [label for s in shards for label in s.labels]
        self.classes = classes
        # What the data says of its class count: the class names when the converter recorded
        # them, else the largest label + 1 (a set data.num_classes replaces it, see build_shards).
        self.num_classes: int | None = (
            len(classes) if classes is not None else max(self.targets, default=-1) + 1 or None
        )
        self.skipped = SkippedSamples(len(self.keys)) if on_bad_sample == "skip" else None
        self._reader: _Reader | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"ShardImages(shards={len(self.urls)}, samples={len(self)})"

    def where(self, index: int) -> str:
        """``KEY.EXT in shard URL``: how messages name sample ``index``."""
        return f"{self.keys[index]} in shard {self.urls[int(self._shard[index])]}"

    def read(self, index: int) -> bytes:
        """The image bytes of sample ``index``, checked against their tar header."""
        return self._member(
            int(self._shard[index]),
            self.keys[index],
            int(self._offset[index]),
            int(self._size[index]),
            header=True,
        )

    def decode(self, data: bytes) -> Image.Image:
        # As torchvision's pil_loader: the same pixels as an ImageFolder of the same files.
        return Image.open(io.BytesIO(data)).convert("RGB")

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        sample, target = self._first_loadable(index, self._load)
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, target

    def _load(self, index: int) -> tuple[Image.Image, int] | None:
        skipped = self.skipped
        if skipped is not None and skipped.is_bad(index):
            return None
        # Only what the shard holds is a bad sample; an I/O failure (network, permissions) from
        # read() is not, and propagates rather than being skipped.
        cause: Exception
        try:
            data = self.read(index)
        except _BadMember as err:
            verb, reason, cause = "read", str(err), err
        else:
            try:
                return self.decode(data), self.targets[index]
            except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, ...
                verb, reason, cause = "decode", f"{type(err).__name__}: {err}", err
        self._bad(index, self.where(index), verb, reason, cause)
        return None


class ShardText(_ShardSet):
    """Byte-level language-model windows over text shards: the ``.txt`` members of all shards,
    in index order, concatenated, then cut as :class:`~sdnet_trainer.data.tokens.TextBytes` cuts
    a text file (windows of ``seq_len + 1`` bytes at stride ``seq_len``), so the windows equal
    ``data=text``'s over the same bytes. A window is read with a range read per member it spans;
    a member's tar header is checked against the index the first time a process reads it.

    A window that cannot be read (a truncated shard) follows ``on_bad_sample``; under skip the
    next readable window takes its place.
    """

    draws_random = False  # each sample is a pure function of its index

    def __init__(
        self,
        shards: Sequence[ShardIndex],
        *,
        seq_len: int,
        on_bad_sample: str = "error",
        shard_bytes: Sequence[int] | None = None,
    ) -> None:
        check_choice("data.on_bad_sample", on_bad_sample, ON_BAD_SAMPLE)
        if seq_len < 1:
            raise ConfigError(f"data.seq_len={seq_len} must be >= 1")
        self.seq_len = seq_len
        self.on_bad_sample = on_bad_sample
        self.urls = [shard.url for shard in shards]
        self.shard_bytes = (
            list(shard_bytes) if shard_bytes is not None else [s.tar_bytes for s in shards]
        )
        self.keys = [f"{key}.{ext}" for shard in shards for key, ext in zip(shard.keys, shard.exts)]
        self._shard = [number for number, shard in enumerate(shards) for _ in range(len(shard))]
        self._offset = [o for s in shards for o in s.offsets]
        self._size = [n for s in shards for n in s.sizes]
        # Where each member starts in the concatenated text.
        self._starts = list(itertools.accumulate(self._size, initial=0))
        self.total_bytes = self._starts[-1]
        self.size = max(0, (self.total_bytes - 1) // seq_len)
        self.skipped = SkippedSamples(self.size) if on_bad_sample == "skip" else None
        self._reader = None
        self._verified: tuple[int, set[int]] = (os.getpid(), set())

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return (
            f"ShardText(shards={len(self.urls)}, bytes={self.total_bytes}, "
            f"seq_len={self.seq_len}, samples={self.size})"
        )

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self._first_loadable(index, self._load)
        return window[:-1], window[1:]

    def window(self, index: int) -> bytes:
        """The ``seq_len + 1`` bytes of window ``index``."""
        start, end = index * self.seq_len, index * self.seq_len + self.seq_len + 1
        pid, verified = self._verified
        if pid != os.getpid():
            verified = set()
            self._verified = (os.getpid(), verified)
        out = bytearray()
        member = bisect.bisect_right(self._starts, start) - 1
        while len(out) < end - start:
            number, key = self._shard[member], self.keys[member]
            begin, offset, size = self._starts[member], self._offset[member], self._size[member]
            lo, hi = max(start, begin) - begin, min(end, begin + size) - begin
            try:
                if member not in verified:
                    # First read of this member in this process: check its header too.
                    problem = _check_header(
                        self._member(number, key, offset - _BLOCK, _BLOCK, header=False),
                        name=key,
                        size=size,
                    )
                    if problem is not None:
                        raise _BadMember(f"the shard's index does not match it: {problem}")
                    verified.add(member)
                out += self._member(number, key, offset + lo, hi - lo, header=False)
            except _BadMember as err:
                raise _BadMember(f"{key} in shard {self.urls[number]}: {err}") from err
            member += 1
        return bytes(out)

    def _load(self, index: int) -> torch.Tensor | None:
        skipped = self.skipped
        if skipped is not None and skipped.is_bad(index):
            return None
        try:
            data = self.window(index)
        except _BadMember as err:
            self._bad(index, f"text window {index}", "read", str(err), err)
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def _load_split(urls: list[str], cfg: DataConfig) -> tuple[list[ShardIndex], list[int]]:
    """The indexes of ``urls`` and the shards' sizes now; a shard shorter than its index is an
    error, or under skip a warning (its members past the end are then skipped when read)."""
    indexes, sizes = [], []
    for url in urls:
        index, actual = load_index(url)
        if actual != index.tar_bytes:
            if actual < index.tar_bytes and cfg.on_bad_sample == "skip":
                logger.warning(
                    "data: shard %s has %d bytes, its index %d: the members past the end are "
                    "skipped (data.on_bad_sample=skip)",
                    url,
                    actual,
                    index.tar_bytes,
                )
            else:
                past = [
                    k for k, o, n in zip(index.keys, index.offsets, index.sizes) if o + n > actual
                ]
                which = f"; key {past[0]!r} is past its end" if past else ""
                raise ShardError(
                    f"data: shard {url} has {actual} bytes, but its index says {index.tar_bytes} "
                    f"(truncated or replaced since it was indexed{which}); re-create the shard "
                    f"and its {INDEX_SUFFIX}"
                )
        indexes.append(index)
        sizes.append(actual)
    return indexes, sizes


def _is_text(indexes: list[ShardIndex], *, root: str, split: str) -> bool:
    """Whether the shard set holds text (else images); a mix is an error."""
    kinds = {ext == TEXT_EXT for index in indexes for ext in index.exts}
    if len(kinds) > 1:
        raise ConfigError(
            f"data.root={root!r}: the {split} shards mix images and text members; a shard set "
            f"holds one or the other"
        )
    return kinds == {True}


def _images(
    indexes: list[ShardIndex],
    sizes: list[int],
    cfg: DataConfig,
    *,
    transform: Any,
    classes: list[str] | None,
) -> ShardImages:
    # The class count known before reading the labels: classes.json, else the config.
    bound, source = (
        (len(classes), f"the {len(classes)} classes of {CLASSES_FILE}")
        if classes is not None
        else (cfg.num_classes, f"data.num_classes={cfg.num_classes}")
    )
    if bound is not None:
        for index in indexes:
            for key, label in zip(index.keys, index.labels):
                if label >= bound:
                    raise ShardError(
                        f"data: shard {index.url}, key {key!r}: label {label} is out of range "
                        f"for {source}"
                    )
    dataset = ShardImages(
        indexes,
        transform=transform,
        on_bad_sample=cfg.on_bad_sample,
        classes=classes,
        shard_bytes=sizes,
    )
    if classes is None and cfg.num_classes is not None:
        dataset.num_classes = cfg.num_classes  # the labels fit it (checked above)
    return dataset


def _text(indexes: list[ShardIndex], sizes: list[int], cfg: DataConfig) -> ShardText:
    if cfg.vocab_size != BYTE_VOCAB:
        raise ConfigError(
            f"data.vocab_size={cfg.vocab_size}: text shards are read as bytes, so it must be "
            f"{BYTE_VOCAB} (set model.gpt.vocab_size={BYTE_VOCAB})"
        )
    return ShardText(
        indexes, seq_len=cfg.seq_len, on_bad_sample=cfg.on_bad_sample, shard_bytes=sizes
    )


def _drop_remote_filesystems(root: str) -> None:
    """Close the remote file system that listing and indexing opened, here, where its event loop
    runs. Left in fsspec's instance cache, it would be inherited by every forked loader worker,
    whose copy of the cache fsspec clears: collecting the instance there waits a full second for
    an event loop no thread of the worker runs (about 1 s per worker, and half the HTTP
    throughput of one worker, by scripts/bench_data.py). Readers open their own, lazily."""
    fs, _ = fsspec.core.url_to_fs(root)
    if not isinstance(fs, LocalFileSystem):
        type(fs).clear_instance_cache()
        del fs
        gc.collect()


def build_shards(cfg: DataConfig) -> tuple[_ShardSet, _ShardSet | None]:
    """(train, val) from tar shards at ``data.root``: a folder (or URL) with ``train/`` and
    ``val/`` shard sets, or a brace pattern naming the training shards only (no validation set).

    Image shards give :class:`ShardImages` with the transforms of ``data=imagefolder``; text
    shards (``.txt`` members) give :class:`ShardText`, byte-level windows as ``data=text``."""
    if cfg.root is None:
        raise ConfigError("data.root is required for data.name='shards'; it is null")
    check_choice("data.on_bad_sample", cfg.on_bad_sample, ON_BAD_SAMPLE)
    root = str(cfg.root)
    pattern = _is_pattern(root)
    splits = (
        {"train": expand_braces(root)} if pattern else {s: _list_split(root, s) for s in SPLITS}
    )
    loaded = {split: _load_split(urls, cfg) for split, urls in splits.items()}
    text = {
        split: _is_text(indexes, root=root, split=split) for split, (indexes, _) in loaded.items()
    }
    if len(set(text.values())) > 1:
        raise ConfigError(
            f"data.root={root!r}: one of train/ and val/ holds text, the other images"
        )
    if text["train"]:
        built: dict[str, _ShardSet] = {s: _text(*loaded[s], cfg) for s in loaded}
    else:
        if cfg.channels != 3:
            raise ConfigError(
                f"data.channels={cfg.channels}, but image shards yield RGB images (3 channels)"
            )
        classes = None if pattern else _read_classes(root)
        if classes is not None and cfg.num_classes is not None and len(classes) != cfg.num_classes:
            raise ConfigError(
                f"data.num_classes={cfg.num_classes}, but data.root={root!r} has {len(classes)} "
                f"classes ({CLASSES_FILE}); set data.num_classes (and model.num_classes) to "
                f"{len(classes)}"
            )
        transforms = dict(zip(SPLITS, build_transforms(cfg)))
        built = {
            s: _images(*loaded[s], cfg, transform=transforms[s], classes=classes) for s in loaded
        }
    train, val = built["train"], built.get("val")
    _drop_remote_filesystems(root)
    logger.info(
        "shards %s: %s %d train / %s val samples in %d / %s shards",
        root,
        "text" if text["train"] else "images",
        len(train),
        "no" if val is None else len(val),
        len(train.urls),
        "no" if val is None else len(val.urls),
    )
    return train, val


# --------------------------------------------------------------------------------------------
# The converter: ImageFolder -> shards
# --------------------------------------------------------------------------------------------


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


def convert(src: str | Path, out: str | Path, *, shard_size: int) -> dict[str, Any]:
    """Write ``src``'s ``train/`` and ``val/`` as shards under ``out``: an ImageFolder (class
    folders of images; the class names go to ``OUT/classes.json``), or folders of ``.txt`` files
    (one text member per file, for a byte-level language model). ``shard_size``: samples (files)
    per shard. Returns {"classes": n or None, split: {"samples", "shards", "written",
    "skipped"}}."""
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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m sdnet_trainer.data.shards SRC OUT shard_size=N"
    positional = [a for a in args if "=" not in a]
    options = dict(a.split("=", 1) for a in args if "=" in a)
    unknown = sorted(set(options) - {"shard_size"})
    if len(positional) != 2 or unknown or "shard_size" not in options:
        extra = f" (unknown: {', '.join(unknown)})" if unknown else ""
        print(f"{usage}{extra}", file=sys.stderr)
        return 2
    try:
        shard_size = int(options["shard_size"])
    except ValueError:
        print(f"error: shard_size={options['shard_size']!r} is not an integer", file=sys.stderr)
        return 2
    try:
        report = convert(positional[0], positional[1], shard_size=shard_size)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
