"""The token cache of ``data=text`` and ``data=chat``: text tokenized once, then memory-mapped.

A cache is three files in ``data.cache_dir`` (default: beside the data, in ``.sdnet_tokens/``):
``NAME.tokens`` (the ids, uint16 when the vocabulary fits in 16 bits, else uint32), for chat data
``NAME.trained`` (one byte per token: 1 where the token is a target the loss trains on), and
``NAME.json`` (what it holds; written last, so a cache without it is incomplete). ``NAME`` ends in
a fingerprint of the sources (each file's path, size, modification time and a hash of its first
and last MiB) and of the tokenizer's files and the settings that change the tokens: while none of
them changes, every run (and every rank) maps the same files instead of tokenizing again; a
changed file gives another name, which is built, and the obsolete cache is removed.

One process builds; the others wait on the cache's lock file and then map what it wrote. Each file
is written under a temporary name and renamed into place, so a build killed half-way leaves
nothing that a later run would read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from sdnet_trainer.data.synthetic import check_index
from sdnet_trainer.data.windows import window_start
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

CACHE_FOLDER = ".sdnet_tokens"
# Bumped whenever the layout of the files or the way text becomes tokens changes.
FORMAT_VERSION = 1
IGNORE_INDEX = -100  # targets the loss leaves out (PyTorch's and Hugging Face's convention)
_SAMPLE_BYTES = 1 << 20  # hashed at each end of a source file for the fingerprint

# What an encoder yields, piece by piece: token ids, which of them are trained (None: all), and
# how many bytes of the sources it has consumed since the last piece (for the progress bar).
Piece = tuple[list[int], list[int] | None, int]


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits in 16 bits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _file_signature(root: Path, file: Path) -> list[Any]:
    stat = file.stat()
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        digest.update(f.read(_SAMPLE_BYTES))
        if stat.st_size > 2 * _SAMPLE_BYTES:
            f.seek(-_SAMPLE_BYTES, os.SEEK_END)
            digest.update(f.read(_SAMPLE_BYTES))
    name = file.name if root.is_file() else str(file.relative_to(root))
    return [name, stat.st_size, stat.st_mtime_ns, digest.hexdigest()]


def cache_names(root: Path, sources: list[Path], settings: dict[str, Any]) -> tuple[str, str]:
    """(the prefix shared by every cache of these settings, this cache's full name)."""
    settings_hash = _hash({"version": FORMAT_VERSION, **settings})[:12]
    prefix = f"{root.name or 'data'}-{settings_hash}-"
    files = [_file_signature(root, file) for file in sources]
    return prefix, prefix + _hash(files)[:16]


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


class TokenCache:
    """A cache's memory maps: ``tokens`` and, for chat data, ``trained``."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder, self.name = folder, name
        self._open()

    def _open(self) -> None:
        folder, name = self.folder, self.name
        meta = json.loads((folder / f"{name}.json").read_text())
        self.meta = meta
        self.dtype = np.dtype(meta["dtype"])
        self.length = int(meta["tokens"])
        self.tokens = _map(folder / f"{name}.tokens", self.dtype, self.length)
        self.trained = (
            _map(folder / f"{name}.trained", np.dtype(np.uint8), self.length)
            if meta["trained"]
            else None
        )

    # Pickled (a loader worker started by spawn) as its file names: a memmap would pickle its
    # whole contents.
    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.folder, self.name = state["folder"], state["name"]
        self._open()


def _map(path: Path, dtype: np.dtype, length: int) -> np.ndarray:
    if path.stat().st_size != length * dtype.itemsize:
        raise ConfigError(f"the token cache {path} is incomplete; delete it to rebuild it")
    if length == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(length,))


def open_cache(
    *,
    root: Path,
    sources: list[Path],
    folder: Path,
    settings: dict[str, Any],
    vocab_size: int,
    with_trained: bool,
    encode: Callable[[], Iterable[Piece]],
) -> TokenCache:
    """The cache of ``sources`` under ``settings``: mapped if it exists (a read-only folder will
    do), else built by ``encode`` (by this process, or awaited from the one holding the lock)."""
    prefix, name = cache_names(root, sources, settings)
    meta = folder / f"{name}.json"
    if meta.is_file():
        logger.info("token cache: reusing %s", meta)
        return TokenCache(folder, name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _locked(folder / f"{prefix}lock"):
            if meta.is_file():  # built by another process while this one waited
                logger.info("token cache: reusing %s", meta)
            else:
                _build(
                    folder,
                    name,
                    encode(),
                    dtype=token_dtype(vocab_size),
                    with_trained=with_trained,
                    # The progress bar counts the sources' bytes as encode reads them.
                    total_bytes=sum(source.stat().st_size for source in sources),
                    settings=settings,
                )
                _remove_obsolete(folder, prefix, keep=name)
    except OSError as err:
        raise ConfigError(
            f"the token cache cannot be written in {folder}: {err}; set data.cache_dir to a "
            f"writable folder"
        ) from err
    return TokenCache(folder, name)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (advisory, released when the process dies)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(
    folder: Path,
    name: str,
    pieces: Iterable[Piece],
    *,
    dtype: np.dtype,
    with_trained: bool,
    total_bytes: int,
    settings: dict[str, Any],
) -> None:
    suffix = f".tmp-{os.getpid()}"
    tokens_tmp = folder / f"{name}.tokens{suffix}"
    trained_tmp = folder / f"{name}.trained{suffix}"
    count = trained_count = 0
    logger.info("token cache: tokenizing into %s", folder / name)
    try:
        with (
            open(tokens_tmp, "wb") as tokens_out,
            open(trained_tmp, "wb") if with_trained else contextlib.nullcontext() as trained_out,
            tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing") as progress,
        ):
            for ids, trained, done in pieces:
                np.asarray(ids, dtype=dtype).tofile(tokens_out)
                if trained_out is not None:
                    assert trained is not None and len(trained) == len(ids)
                    np.asarray(trained, dtype=np.uint8).tofile(trained_out)
                    trained_count += sum(trained)
                count += len(ids)
                progress.update(done)
            _sync(tokens_out)
            if trained_out is not None:
                _sync(trained_out)
        os.replace(tokens_tmp, folder / f"{name}.tokens")
        if with_trained:
            os.replace(trained_tmp, folder / f"{name}.trained")
        meta = {
            "version": FORMAT_VERSION,
            "dtype": dtype.name,
            "tokens": count,
            "trained": with_trained,
            "trained_tokens": trained_count if with_trained else count,
            "settings": settings,
        }
        meta_tmp = folder / f"{name}.json{suffix}"
        meta_tmp.write_text(json.dumps(meta, indent=1))
        os.replace(meta_tmp, folder / f"{name}.json")
    finally:
        for tmp in (tokens_tmp, trained_tmp, folder / f"{name}.json{suffix}"):
            tmp.unlink(missing_ok=True)
    logger.info("token cache: %d tokens in %s", count, folder / f"{name}.tokens")


def _sync(handle: Any) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def _remove_obsolete(folder: Path, prefix: str, *, keep: str) -> None:
    """Caches of the same settings built from an older state of the sources."""
    for path in folder.glob(f"{prefix}*"):
        if not path.name.startswith(f"{keep}.") and path.name != f"{prefix}lock":
            logger.info("token cache: removing the obsolete %s", path)
            path.unlink(missing_ok=True)


class PackedTokens(Dataset):
    """Windows of ``seq_len + 1`` tokens at stride ``seq_len`` over ``[start, end)`` of a token
    cache: sample ``i`` is ``(inputs, targets)``, the targets shifted by one, as
    :class:`~sdnet_trainer.data.tokens.TokenWindows`. Targets the loss leaves out are
    ``IGNORE_INDEX``: tokens the cache marks as not trained (chat prompts), and with
    ``mask_eos`` set the token that follows ``mask_eos`` (the next document's first token,
    which its predecessor cannot predict). With ``random`` each window starts at a random offset
    of ``[start, end)`` instead, as many windows per epoch (data/windows.py)."""

    draws_random = False  # each sample is a pure function of its index (no per-sample seeding)

    def __init__(
        self,
        cache: TokenCache,
        *,
        start: int,
        end: int,
        seq_len: int,
        mask_eos: int | None,
        random: bool = False,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"PackedTokens: seq_len must be >= 1, got {seq_len}")
        self.cache, self.start, self.end = cache, start, end
        self.seq_len, self.mask_eos = seq_len, mask_eos
        self.size = max(0, (end - start - 1) // seq_len)
        # Random starts draw from the generator the loader seeds per sample (data/seeding.py).
        self.draws_random = random

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = check_index(index, self.size, type(self).__name__)
        tokens = self.end - self.start
        begin = self.start + window_start(
            index, seq_len=self.seq_len, tokens=tokens, random=self.draws_random
        )
        window = torch.from_numpy(
            self.cache.tokens[begin : begin + self.seq_len + 1].astype(np.int64)
        )
        inputs, targets = window[:-1], window[1:].clone()
        if self.cache.trained is not None:
            trained = self.cache.trained[begin + 1 : begin + self.seq_len + 1]
            targets[torch.from_numpy(trained == 0)] = IGNORE_INDEX
        if self.mask_eos is not None:
            targets[inputs == self.mask_eos] = IGNORE_INDEX
        return inputs, targets

    def __repr__(self) -> str:
        windows = ", random windows" if self.draws_random else ""
        return (
            f"PackedTokens({self.cache.name}, tokens={self.end - self.start}, "
            f"seq_len={self.seq_len}, samples={self.size}{windows})"
        )
