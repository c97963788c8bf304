"""Which base a LoRA run's adapters were trained on, recorded in its checkpoints and checked
wherever the adapters go back into a base (a resumed run, export and serving).

A LoRA checkpoint holds the adapters alone: the frozen base is ``model.weights=hf:PATH``, read
again from the folder. A path says nothing about what the folder holds by then: a folder
replaced by another model of the same architecture (a newer release, another fine-tune) would
take the adapters without a word, and they would compute something nobody trained. So the
checkpoint also records a fingerprint of the folder's weights, cheap enough for every set-up
(no full read of the weights): each weight file's name and size, a SHA-256 of its safetensors
header (the 8-byte length and the JSON that names every tensor with its dtype, shape and
offsets), a SHA-256 of a sample of its values (the first and last :data:`SAMPLE_BYTES` of its
data: a model of the same architecture with other values keeps every header and size), the
total size, and a SHA-256 of ``model.safetensors.index.json``. A copy of the folder elsewhere
has the same fingerprint: the folder may move, its contents may not change. Values changed only
between the sampled bytes of every file go unseen; that is the price of not reading them.

The folder is untrusted input (``models/hf_folder.py``): the files the index names, plain names
opened without following links; a header length past the end of its file, or a header that is
not a JSON object, is an error naming the file.

A checkpoint written before fingerprints (``meta.lora`` without ``base_fingerprint``) is
accepted with a warning: nothing says which base it was trained on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from sdnet_trainer.errors import ConfigError
from sdnet_trainer.models.hf_folder import (
    INDEX_FILE,
    hf_weights_folder,
    listed,
    regular_file,
    weight_files,
)

logger = logging.getLogger(__name__)

FINGERPRINT_KEY = "base_fingerprint"  # in a checkpoint's meta.lora
FINGERPRINT_VERSION = 1
HEADER_LENGTH_BYTES = 8  # safetensors: a little-endian u64, then that many bytes of JSON
# safetensors refuses larger headers itself; a larger claimed length is no weight file.
MAX_HEADER_BYTES = 100_000_000
SAMPLE_BYTES = 64 << 10  # at each end of a file's data
MAX_INDEX_BYTES = 64 << 20
KEY = "model.weights"


def adapters_meta(weights: str | None) -> dict[str, Any]:
    """A LoRA checkpoint's ``meta.lora``: the model entry holds the adapters, their base is
    ``weights`` (``model.weights``), whose folder's fingerprint goes with it (None: no folder,
    the base is the run's seeded initialisation)."""
    folder = hf_weights_folder(weights)
    return {
        "model_entry": "adapters",
        "base": weights,
        FINGERPRINT_KEY: None if folder is None else base_fingerprint(folder),
    }


def base_fingerprint(folder: Path) -> dict[str, Any]:
    """The fingerprint of the weights of Hugging Face folder ``folder`` (module docstring)."""
    names = sorted(set(weight_files(folder).values()))
    files = {name: _file_record(folder, name) for name in names}
    index = None
    if (folder / INDEX_FILE).exists():
        with regular_file(folder, INDEX_FILE, key=KEY) as via, open(via, "rb") as f:
            data = f.read(MAX_INDEX_BYTES + 1)
        if len(data) > MAX_INDEX_BYTES:
            raise ConfigError(f"{KEY}: {folder / INDEX_FILE} is larger than an index holds")
        index = hashlib.sha256(data).hexdigest()
    return {
        "version": FINGERPRINT_VERSION,
        "files": files,
        "total_bytes": sum(record["bytes"] for record in files.values()),
        "index_sha256": index,
    }


def _file_record(folder: Path, name: str) -> dict[str, Any]:
    """One weight file's size and the SHA-256s of its header and of its sampled values."""
    path = folder / name
    with regular_file(folder, name, key=KEY) as via, open(via, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        length = f.read(HEADER_LENGTH_BYTES)
        if len(length) < HEADER_LENGTH_BYTES:
            raise ConfigError(
                f"{KEY}: {path} is truncated: {size} bytes, not even the "
                f"{HEADER_LENGTH_BYTES}-byte length of a safetensors header"
            )
        claimed = int.from_bytes(length, "little")
        room = size - HEADER_LENGTH_BYTES
        if claimed > min(room, MAX_HEADER_BYTES):
            limit = "the file holds" if claimed > room else "a safetensors header may be"
            raise ConfigError(
                f"{KEY}: {path} is not a whole safetensors file: its header length says "
                f"{claimed:,} bytes, more than {limit} ({min(room, MAX_HEADER_BYTES):,})"
            )
        header = f.read(claimed)
        try:
            parsed = json.loads(header)
        except ValueError as err:  # UnicodeDecodeError included
            raise ConfigError(f"{KEY}: {path}: its safetensors header is not JSON: {err}") from None
        if not isinstance(parsed, dict):
            raise ConfigError(f"{KEY}: {path}: its safetensors header is not a JSON object")
        start = HEADER_LENGTH_BYTES + claimed
        sample = hashlib.sha256(f.read(min(SAMPLE_BYTES, size - start)))
        tail = max(start, size - SAMPLE_BYTES)
        f.seek(tail)
        sample.update(f.read(size - tail))
    return {
        "bytes": size,
        "header_sha256": hashlib.sha256(length + header).hexdigest(),
        "sample_sha256": sample.hexdigest(),
    }


def fingerprint_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between a recorded fingerprint and the folder's now, one phrase each."""
    old, new = saved["files"], current["files"]
    found = []
    if gone := sorted(set(old) - set(new)):
        found.append(f"weight files gone: {listed(gone)}")
    if added := sorted(set(new) - set(old)):
        found.append(f"weight files the trained base did not have: {listed(added)}")
    if saved["total_bytes"] != current["total_bytes"]:
        found.append(
            f"weight files' total size {saved['total_bytes']:,} -> {current['total_bytes']:,} bytes"
        )
    if saved["index_sha256"] != current["index_sha256"]:
        found.append(f"{INDEX_FILE} differs")
    for name in sorted(set(old) & set(new)):
        if old[name]["bytes"] != new[name]["bytes"]:
            found.append(f"{name}: {old[name]['bytes']:,} -> {new[name]['bytes']:,} bytes")
        if old[name]["header_sha256"] != new[name]["header_sha256"]:
            found.append(f"{name}: its header (tensor names, dtypes, shapes) differs")
        elif old[name]["sample_sha256"] != new[name]["sample_sha256"]:
            found.append(f"{name}: the same tensors with other values")
    return found


def check_adapters_base(saved: Any, current: dict[str, Any], *, source: str) -> None:
    """Refuse to put a checkpoint's adapters into another base than theirs: ``saved`` is the
    checkpoint's ``meta.lora`` (untrusted: None where it has none), ``current`` this run's
    (:func:`adapters_meta`), ``source`` names the checkpoint (``checkpoint.resume=PATH``)."""
    if not isinstance(saved, dict):
        return
    now = current["base"]
    if FINGERPRINT_KEY not in saved:
        logger.warning(
            "%s: its LoRA adapters were saved without a fingerprint of their base (a checkpoint "
            "from before base fingerprints): model.weights=%s is not checked against the base "
            "they were trained on (%s)",
            source,
            now,
            saved.get("base"),
        )
        return
    recorded, fingerprint = saved.get("base"), saved[FINGERPRINT_KEY]
    trained = f"its LoRA adapters were trained on model.weights={recorded}"
    if fingerprint is None or current[FINGERPRINT_KEY] is None:
        if fingerprint is None and current[FINGERPRINT_KEY] is None:
            return  # the seeded initialisation both times (the config says which seed)
        raise ConfigError(
            f"{source}: {trained}, and this run's base is model.weights={now}: another base. "
            f"Set model.weights={recorded}, or start the adapters afresh"
        )
    if not _well_formed(fingerprint):
        raise ConfigError(f"{source}: its meta.lora.{FINGERPRINT_KEY} is malformed")
    differences = fingerprint_differences(fingerprint, current[FINGERPRINT_KEY])
    if differences:
        raise ConfigError(
            f"{source}: {trained}, and the folder of model.weights={now} is no longer that base: "
            f"{'; '.join(differences)}. Point model.weights at the base the adapters were "
            f"trained on, or start the adapters afresh"
        )


def _well_formed(fingerprint: Any) -> bool:
    fields = ("bytes", "header_sha256", "sample_sha256")
    return (
        isinstance(fingerprint, dict)
        and fingerprint.get("version") == FINGERPRINT_VERSION
        and isinstance(fingerprint.get("total_bytes"), int)
        and isinstance(fingerprint.get("index_sha256"), (str, type(None)))
        and isinstance(fingerprint.get("files"), dict)
        and all(
            isinstance(record, dict) and all(field in record for field in fields)
            for record in fingerprint["files"].values()
        )
    )


__all__ = [
    "FINGERPRINT_KEY",
    "adapters_meta",
    "base_fingerprint",
    "check_adapters_base",
    "fingerprint_differences",
]
