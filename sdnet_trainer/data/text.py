"""``data=text``: your own text for a language model.

Without ``data.tokenizer`` the text is read as bytes (tokens 0..255; see ``data/tokens.py``).
With one, ``data.root`` (a file, or a folder searched recursively in sorted path order, hidden
paths left out) holds ``.txt`` files (one document each), ``.jsonl`` files (one document per
line, its ``data.text_column`` field, ``text`` by default) and ``.parquet`` files (the
``data.text_column`` column). They are tokenized once into the token cache of
``data/token_cache.py``; each document is ``[BOS] ids EOS`` (BOS where the tokenizer has one
distinct from EOS) and the documents are packed back to back into windows of ``seq_len + 1``.
``data.mask_documents=true`` leaves out of the loss the target after each EOS (the next
document's first token, predicted from the end of another); attention still spans the whole
window. The last ~10% of the tokens are held out for validation.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

from torch.utils.data import Dataset

from sdnet_trainer.config.schema import DataConfig
from sdnet_trainer.data.token_cache import (
    CACHE_FOLDER,
    PackedTokens,
    Piece,
    TokenCache,
    open_cache,
)
from sdnet_trainer.data.tokenizer import TextTokenizer, load_tokenizer
from sdnet_trainer.data.tokens import _TEXT_VAL_FRACTION
from sdnet_trainer.data.tokens import build_text as build_text_bytes
from sdnet_trainer.data.windows import random_windows
from sdnet_trainer.errors import ConfigError

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
DEFAULT_TEXT_KEY = "text"
_BATCH_DOCUMENTS = 1024  # documents tokenized per call
_TXT_CHUNK = 1 << 20  # a .txt file is read (and tokenized) in pieces of about this many bytes


def source_files(cfg: DataConfig, suffixes: tuple[str, ...]) -> tuple[Path, list[Path]]:
    """(``data.root``, the files of it with these suffixes)."""
    if cfg.root is None:
        raise ConfigError(
            f"data.root is not set: data.name={cfg.name!r} needs a file or a folder of "
            f"{'/'.join(suffixes)} files (data.root=PATH)"
        )
    root = Path(cfg.root).expanduser()
    if root.is_file():
        if root.suffix not in suffixes:
            raise ConfigError(
                f"data.root={cfg.root!r} is a {root.suffix or 'suffix-less'} file; "
                f"data.name={cfg.name!r} reads {', '.join(suffixes)} files"
            )
        return root, [root]
    if not root.is_dir():
        raise ConfigError(f"data.root={cfg.root!r} does not exist")
    files = sorted(
        path
        for path in root.rglob("*")
        if path.suffix in suffixes
        and path.is_file()
        and not any(part.startswith(".") for part in path.relative_to(root).parts)
    )
    if not files:
        raise ConfigError(f"data.root={cfg.root!r} is a folder without {', '.join(suffixes)} files")
    return root, files


def cache_folder(cfg: DataConfig, root: Path) -> Path:
    if cfg.cache_dir is not None:
        return Path(cfg.cache_dir).expanduser()
    return (root if root.is_dir() else root.parent) / CACHE_FOLDER


def check_vocab(cfg: DataConfig, tokenizer: TextTokenizer) -> None:
    if cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"data.vocab_size={cfg.vocab_size} is smaller than the {tokenizer.vocab_size} tokens "
            f"of data.tokenizer={cfg.tokenizer!r}; set model.gpt.vocab_size to at least "
            f"{tokenizer.vocab_size}"
        )


def split_windows(
    cfg: DataConfig, cache: TokenCache, *, mask_eos: int | None
) -> tuple[PackedTokens, PackedTokens]:
    """(train, val) windows: val is the last ~10% of the tokens, at least one window; the
    training windows are cut as ``data.windows`` says, val's at stride."""
    random = random_windows(cfg)
    window = cfg.seq_len + 1
    if cfg.seq_len < 1:
        raise ConfigError(f"data.seq_len={cfg.seq_len} must be >= 1 for data.name={cfg.name!r}")
    val_len = max(int(cache.length * _TEXT_VAL_FRACTION), window)
    if cache.length - val_len < window:
        raise ConfigError(
            f"data.root={cfg.root!r} holds {cache.length} tokens; data.seq_len={cfg.seq_len} "
            f"needs at least {2 * window} (one window of seq_len + 1 tokens each for train and val)"
        )
    split = cache.length - val_len
    train = PackedTokens(
        cache, start=0, end=split, seq_len=cfg.seq_len, mask_eos=mask_eos, random=random
    )
    val = PackedTokens(cache, start=split, end=cache.length, seq_len=cfg.seq_len, mask_eos=mask_eos)
    logger.info(
        "%s data: %d tokens, %d train (%s) / %d val windows of %d tokens",
        cfg.name,
        cache.length,
        len(train),
        cfg.windows,
        len(val),
        cfg.seq_len,
    )
    return train, val


def build_text(cfg: DataConfig) -> tuple[Dataset, Dataset]:
    """The (train, val) pair of ``data=text``: bytes, or the token cache of ``data.tokenizer``."""
    if cfg.tokenizer is None:
        if cfg.mask_documents:
            raise ConfigError(
                "data.mask_documents=true needs data.tokenizer: bytes of text have no document "
                "boundaries (EOS) to mask"
            )
        return build_text_bytes(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer)
    check_vocab(cfg, tokenizer)
    eos = tokenizer.require_eos("data.name='text'")
    bos = tokenizer.bos_id if tokenizer.bos_id != eos else None
    root, files = source_files(cfg, TEXT_SUFFIXES)
    key = cfg.text_column or DEFAULT_TEXT_KEY
    settings = {"kind": "text", "tokenizer": tokenizer.fingerprint, "key": key, "bos": bos}
    cache = open_cache(
        root=root,
        sources=files,
        folder=cache_folder(cfg, root),
        settings=settings,
        vocab_size=tokenizer.vocab_size,
        with_trained=False,
        encode=lambda: encode_documents(read_texts(files, key), tokenizer, bos=bos, eos=eos),
    )
    return split_windows(cfg, cache, mask_eos=eos if cfg.mask_documents else None)


# A run of text, whether it ends its document, and the source bytes read for it.
TextPart = tuple[str, bool, int]


def encode_documents(
    parts: Iterable[TextPart], tokenizer: TextTokenizer, *, bos: int | None, eos: int
) -> Iterator[Piece]:
    """Token pieces of the documents: ``[bos] ids eos`` each, ids tokenized in batches."""
    starting = True
    batch: list[TextPart] = []

    def flush() -> Piece:
        nonlocal starting
        ids: list[int] = []
        for (_, ends, _), part_ids in zip(batch, tokenizer.encode([text for text, _, _ in batch])):
            if starting and bos is not None:
                ids.append(bos)
            ids += part_ids
            if ends:
                ids.append(eos)
            starting = ends
        done = sum(size for _, _, size in batch)
        batch.clear()
        return ids, None, done

    for part in parts:
        batch.append(part)
        if len(batch) >= _BATCH_DOCUMENTS:
            yield flush()
    if batch:
        yield flush()


def read_texts(files: list[Path], key: str) -> Iterator[TextPart]:
    for file in files:
        try:
            if file.suffix == ".txt":
                yield from _read_txt(file)
            elif file.suffix == ".jsonl":
                for number, record, size in read_jsonl(file):
                    text = record.get(key)
                    if not isinstance(text, str):
                        raise ConfigError(
                            f"data.root: {file}:{number} has no string field {key!r} "
                            f"(data.text_column); its keys are {sorted(record)}"
                        )
                    yield text, True, size
            else:
                yield from _read_parquet(file, key)
        except OSError as err:
            raise ConfigError(f"data.root: {file} cannot be read: {err}") from err


def _read_txt(file: Path) -> Iterator[TextPart]:
    """The file as one document, in pieces cut after a newline (tokenizers split there anyway)."""
    carry = b""
    with open(file, "rb") as f:
        while chunk := f.read(_TXT_CHUNK):
            data = carry + chunk
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                carry = data
                continue
            carry = data[cut:]
            yield _decode(file, data[:cut]), False, cut
    yield _decode(file, carry), True, len(carry)


def _decode(file: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"data.root: {file} is not UTF-8 text: {err}") from err


def read_jsonl(file: Path) -> Iterator[tuple[int, dict, int]]:
    """(line number, the JSON object on it, its bytes) for each non-empty line."""
    with open(file, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ConfigError(
                    f"data.root: {file}:{number} is not a line of JSON: {err}"
                ) from err
            if not isinstance(record, dict):
                raise ConfigError(f"data.root: {file}:{number} is not a JSON object")
            yield number, record, len(line)


def _read_parquet(file: Path, key: str) -> Iterator[TextPart]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ConfigError(
            f"data.root: {file} is parquet, which needs pyarrow: pip install 'sdnet_trainer[hf]'"
        ) from err
    try:
        table = pq.ParquetFile(file)
        names = table.schema_arrow.names
        if key not in names:
            raise ConfigError(
                f"data.root: {file} has no column {key!r} (data.text_column); its columns are "
                f"{names}"
            )
        column_type = table.schema_arrow.field(key).type
        if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
            raise ConfigError(
                f"data.root: {file}'s column {key!r} (data.text_column) holds {column_type}, "
                f"not text"
            )
        rows = max(table.metadata.num_rows, 1)
        size = file.stat().st_size
        for batch in table.iter_batches(batch_size=_BATCH_DOCUMENTS, columns=[key]):
            texts = batch.column(0).to_pylist()
            share = size * len(texts) // rows
            for i, text in enumerate(texts):
                if text is not None:
                    yield text, True, share if i == 0 else 0
    except ConfigError:
        raise
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise ConfigError(
            f"data.root: {file} cannot be read as parquet: {type(err).__name__}: {err}"
        ) from err
