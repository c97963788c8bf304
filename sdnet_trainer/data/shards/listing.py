"""Where the shards are: a folder (or fsspec URL) with ``train/`` and ``val/`` shard sets and the
converter's ``classes.json``, or a brace pattern naming the training shards; and the remote file
system that listing them opened, closed before loader workers fork."""

from __future__ import annotations

import gc
import itertools
import json
import re

import fsspec
from fsspec.implementations.local import LocalFileSystem

from sdnet_trainer.data.shards.index import SHARD_SUFFIX
from sdnet_trainer.errors import ConfigError

CLASSES_FILE = "classes.json"
SPLITS = ("train", "val")

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
            f"python -m sdnet_trainer.data.shards SRC OUT)"
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


def _drop_remote_filesystems(root: str) -> None:
    """Close the remote file system that listing and indexing opened, here, where its event loop
    runs. Left in fsspec's instance cache, it would be inherited by every forked loader worker,
    whose copy of the cache fsspec clears: collecting the instance there waits a full second for
    an event loop no thread of the worker runs (about 1 s per worker, and half the HTTP
    throughput of one worker, by scripts/bench/bench_data.py). Readers open their own, lazily."""
    fs, _ = fsspec.core.url_to_fs(root)
    if not isinstance(fs, LocalFileSystem):
        type(fs).clear_instance_cache()
        del fs
        gc.collect()
